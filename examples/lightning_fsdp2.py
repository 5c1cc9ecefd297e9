"""dmuon under PyTorch Lightning's FSDP2 path (``ModelParallelStrategy``), runnable on CPU with gloo.

    python examples/lightning_fsdp2.py --devices 2                     # Lightning starts rank 1 itself
    python examples/lightning_fsdp2.py --devices 2 --max-steps 3 --save ckpt
    python examples/lightning_fsdp2.py --devices 1 --batch-size 4 --max-steps 6 --resume ckpt

The three dmuon lines sit where Lightning wants parallelization:

* ``configure_model``: ``dmuon.dedicate_params(model, mesh["data_parallel"], ...)``, *then*
  ``fully_shard`` per block and on the root (guarded: Lightning may call the hook again);
* ``configure_optimizers``: return ``dmuon.Muon(model, ...)`` (here with a ``LambdaLR`` schedule);
* ``configure_gradient_clipping``: ``dmuon.clip_grad_norm_`` when ``gradient_clip_val`` is set
  (``dmuon.clip_grad_value_`` with ``gradient_clip_algorithm="value"``) —
  Lightning's default clips with ``torch.nn.utils.clip_grad_norm_`` over ``.grad``, which never
  sees the dedicated matrices' gradients (they live on their owners).

Checkpoints are Lightning's own: ``trainer.save_checkpoint(path)`` writes a DCP folder of torch's
``get_model_state_dict`` / ``get_optimizer_state_dict`` (sharded: every rank writes its pieces), and
``trainer.fit(module, ckpt_path=path)`` loads it back through torch's ``set_*_state_dict`` -- on the
same or another number of ranks (DCP re-shards; keep the global batch, ``--batch-size``). Lightning
resumes a checkpoint taken mid-epoch from the epoch's first batch unless the dataloader is resumable
(it warns): checkpoint at epoch ends (``ModelCheckpoint``'s default) or use a stateful loader.

``--dtype float64`` trains in fp64 (the tests); ``--probe-out FILE`` writes, on rank 0, the losses
and the trained model's full state dict (``dmuon.get_model_state_dict``).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, SEQ = 64, 32, 16
PROJ = ("qkv_proj", "o_proj", "up_proj", "down_proj")


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.qkv_proj = nn.Linear(dim, 3 * dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.up_proj = nn.Linear(dim, 4 * dim, bias=False)
        self.down_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv_proj(self.norm(x)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down_proj(F.gelu(self.up_proj(self.norm2(x))))


class TinyLM(nn.Module):
    """Embedding, 2 pre-norm blocks, head; returns the mean next-token cross-entropy (nats)."""

    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(n_layers))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def tiny_lm(dtype: torch.dtype = torch.float32) -> TinyLM:
    torch.manual_seed(0)  # the same initial weights on every rank and in the tests' reference
    return TinyLM().to(dtype)


def is_muon(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and any(k in name for k in PROJ)


def dataset(samples: int) -> torch.Tensor:
    """Counting sequences (each counts up by one from a random start, modulo VOCAB)."""
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, VOCAB, (samples, 1), generator=g)
    return (torch.arange(SEQ) + starts) % VOCAB


def lr_factor(step: int, total: int) -> float:
    """Linear decay to 0 over ``total`` steps (the LambdaLR factor at ``step``)."""
    return max(0.0, (total - step) / total)


def build_module(total_steps: int, dtype: torch.dtype):
    import lightning as L

    import dmuon

    class DmuonLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_lm(dtype)
            self.losses: list[float] = []
            self.lrs: list[list[float]] = []
            self._parallelized = False

        def configure_model(self):
            if self._parallelized:
                return  # already dedicated and sharded (Lightning may call this hook again)
            self._parallelized = True
            mesh = self.device_mesh["data_parallel"]
            dmuon.dedicate_params(self.model, mesh, predicate=is_muon)
            from torch.distributed.fsdp import fully_shard
            for layer in self.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            loss = self.model(batch)
            self.losses.append(float(loss.detach()))  # this rank's micro-batch loss
            self.lrs.append([g["lr"] for g in self.trainer.optimizers[0].param_groups])
            return loss

        def configure_optimizers(self):
            opt = dmuon.Muon(self.model, lr=0.02, adamw_lr=3e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                        gradient_clip_algorithm=None):
            if gradient_clip_val and gradient_clip_algorithm == "value":
                dmuon.clip_grad_value_(self.model, float(gradient_clip_val))
            elif gradient_clip_val:  # "norm", Lightning's default
                dmuon.clip_grad_norm_(self.model, float(gradient_clip_val))

    return DmuonLM()


def main(argv: list[str]) -> None:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    import dmuon

    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--samples", type=int, default=48, help="dataset size")
    ap.add_argument("--batch-size", type=int, default=2, help="per-rank batch")
    ap.add_argument("--max-steps", type=int, default=6)
    ap.add_argument("--total-steps", type=int, default=6, help="length of the LR schedule")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--clip-algorithm", default="norm", choices=("norm", "value"))
    ap.add_argument("--save", default=None, help="trainer.save_checkpoint(path) at the end")
    ap.add_argument("--resume", default=None, help="trainer.fit(..., ckpt_path=path)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--probe-out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the machine's cores

    module = build_module(a.total_steps, getattr(torch, a.dtype))
    trainer = L.Trainer(
        accelerator="cpu", devices=a.devices, max_steps=a.max_steps,
        strategy=ModelParallelStrategy(data_parallel_size=a.devices, tensor_parallel_size=1,
                                       process_group_backend="gloo"),
        gradient_clip_val=a.clip or None, gradient_clip_algorithm=a.clip_algorithm, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=True)
    loader = torch.utils.data.DataLoader(dataset(a.samples), batch_size=a.batch_size, shuffle=False)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=a.resume)
    if a.save:
        trainer.save_checkpoint(a.save)  # collective: every rank writes its pieces
    if a.probe_out:
        weights = dmuon.get_model_state_dict(module.model, cpu_offload=True)  # collective
        optim = dmuon.get_optimizer_state_dict(module.model, trainer.optimizers[0],
                                               cpu_offload=True)
        if trainer.global_rank == 0:
            torch.save({"weights": weights, "optimizer": optim, "losses": module.losses,
                        "lrs": module.lrs,
                        "global_step": trainer.global_step}, a.probe_out)
        trainer.strategy.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
