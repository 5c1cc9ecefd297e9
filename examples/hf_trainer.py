"""The seeds' HF ``Trainer`` recipe, runnable on CPU with gloo (tiny Llama, no downloads).

    torchrun --nproc_per_node 2 examples/hf_trainer.py --output-dir /tmp/dmuon_trainer
    python examples/hf_trainer.py --output-dir /tmp/dmuon_trainer    # spawns 2 local ranks itself

``dedicate_params`` -> ``fully_shard`` per decoder layer and root -> ``dmuon.Muon`` ->
``Trainer(optimizers=(optimizer, None))`` with ``fsdp=""``. Nothing else: ``import dmuon`` teaches
Accelerate / Trainer about dmuon models (see ``dmuon/integrations/hf_trainer.py``): no DDP wrapping
of the already-sharded model, Trainer's gradient clipping (``max_grad_norm``, default 1.0) covers
the dedicated matrices, gradient accumulation skips collectives, and Trainer's checkpoints are full
``save_pretrained`` checkpoints (reload them with ``LlamaForCausalLM.from_pretrained``) that also
carry dmuon's optimizer state, so ``trainer.train(resume_from_checkpoint=...)`` continues exactly; the
training logs gain ``dmuon_ns_ms`` / ``dmuon_comm_bytes`` / ``dmuon_ns_imbalance`` /
``dmuon_owned_imbalance`` beside ``grad_norm``.

On GPU: no ``backend="gloo"`` in the ``run`` call (nccl), ``init_device_mesh("cuda", ...)`` and a real
``AutoModelForCausalLM.from_pretrained(...).cuda()``; the rest is unchanged.

Resume is Trainer's own: ``--save-steps K`` writes ``checkpoint-K`` folders (model, dmuon's full
optimizer state, scheduler, per-rank RNG, trainer state) and ``--resume last`` (or a folder) continues
from one, on any number of ranks (``torchrun --nproc_per_node 1 ... --batch-size 4`` keeps the global
batch of a 2-rank run). ``--stop-after N`` ends a run after step N (as a preemption would, but after
that step's save), keeping the LR schedule of the full run.

``--probe-out FILE`` (used by the tests) also writes, on rank 0, the Trainer's log history and the
trained model's logits on a fixed probe batch; ``--dtype float64`` trains in fp64 (the tests).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments)

import dmuon
from dmuon.launch import run

VOCAB, SEQ = 64, 16
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama() -> LlamaForCausalLM:
    """A 2-layer Llama small enough for CPU tests (same weights on every rank: fixed seed)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


class CountingDataset(torch.utils.data.Dataset):
    """Learnable synthetic sequences: each counts up by one from its start, modulo VOCAB."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1234)
        self.starts = torch.randint(0, VOCAB, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        ids = (torch.arange(SEQ) + self.starts[i]) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def probe_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


class StopAfter(TrainerCallback):
    """End training after optimizer step ``n``, saving a checkpoint there (a clean preemption)."""

    def __init__(self, n: int):
        self.n = n

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102
        if state.global_step >= self.n:
            control.should_save = True
            control.should_training_stop = True
        return control


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-dir", default="./output_dmuon_trainer")
    ap.add_argument("--samples", type=int, default=4, help="dataset size")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=2, help="per-rank micro-batch size")
    ap.add_argument("--save-steps", type=int, default=None, help="checkpoint every K steps")
    ap.add_argument("--stop-after", type=int, default=None, help="end after step N (and save)")
    ap.add_argument("--resume", default=None, help="'last' or a checkpoint folder")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--probe-out", default=None)
    a = ap.parse_args(argv)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_llama().to(getattr(torch, a.dtype))

    # the seeds' three steps: dedicate, fully_shard (layers, root), dmuon.Muon
    dmuon.dedicate_params(model, mesh,
                          predicate=lambda n, p: p.ndim == 2 and any(k in n for k in PROJ))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)

    training_args = TrainingArguments(
        output_dir=a.output_dir,
        per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=a.grad_accum,
        num_train_epochs=a.epochs,
        fsdp="",                       # Trainer's own FSDP wrapping stays off
        logging_steps=1,
        save_strategy="steps" if a.save_steps else ("epoch" if a.probe_out else "no"),
        save_steps=a.save_steps or 500,
        save_total_limit=None if a.save_steps else 1,
        report_to=[],
        use_cpu=True,                  # CPU: without it transformers runs torchrun NOT_PARALLEL
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=CountingDataset(a.samples),
        optimizers=(optimizer, None),  # (optimizer, lr_scheduler): Trainer adds its linear schedule
        callbacks=[StopAfter(a.stop_after)] if a.stop_after else None,
    )
    resume = True if a.resume == "last" else a.resume
    trainer.train(resume_from_checkpoint=resume)

    if a.probe_out:
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=probe_batch()).logits
        rt = optimizer.dedicated_state
        weights = dmuon.get_model_state_dict(model, cpu_offload=True)       # collective
        optim = dmuon.get_optimizer_state_dict(model, optimizer, cpu_offload=True)
        stats = [None] * dist.get_world_size()
        dist.all_gather_object(stats, optimizer.last_step_stats().as_dict())
        if dist.get_rank() == 0:
            torch.save({"logits": logits, "log_history": trainer.state.log_history,
                        "weights": weights, "optimizer": optim, "step_stats": stats,
                        "routing_log": getattr(trainer, "_dmuon_routing_log", None),
                        "checkpoint": _last_checkpoint(a.output_dir),
                        "reduce_collectives": rt.executor.counters()["reduce"]["collectives"],
                        "reduce_ops_per_sync": sum(len(g.phases.reduce) for g in rt.groups.values())},
                       a.probe_out)
        dist.barrier()


def _last_checkpoint(output_dir: str) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint
    return get_last_checkpoint(output_dir)


if __name__ == "__main__":
    run(main, sys.argv[1:], world_size=2, backend="gloo")
