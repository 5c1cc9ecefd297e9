"""The seeds' HuggingFace recipe: an HF causal LM + dmuon, runnable on CPU with gloo.

    torchrun --nproc_per_node 2 examples/hf_llama.py --steps 20
    python examples/hf_llama.py --steps 20          # spawns 2 local ranks itself

``dedicate_params`` (every attention / MLP projection) -> ``fully_shard`` per decoder layer, then
the root -> ``dmuon.Muon``; the loop is the usual ``zero_grad / model(**batch).loss.backward() /
step``. A tiny ``LlamaForCausalLM`` built from a ``LlamaConfig`` stands in for
``AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.2-3B", torch_dtype=torch.bfloat16)``
(no download); on GPU drop ``backend="gloo"`` from the ``run`` call (nccl, one GPU per rank), use
``init_device_mesh("cuda", ...)`` and ``.cuda()``, nothing else changes. Rank 0 prints the loss; at the end every rank takes part in
``dmuon.get_model_state_dict`` and rank 0 writes a ``save_pretrained`` checkpoint if asked.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import dmuon
from dmuon.launch import run

VOCAB, SEQ = 64, 32
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dataloader(rank: int, steps: int, per_rank: int):
    """Each rank's batches of learnable sequences (count up by one from a random start)."""
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        ids = (torch.randint(0, VOCAB, (per_rank, 1), generator=g) + torch.arange(SEQ)) % VOCAB
        yield {"input_ids": ids, "labels": ids}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save", default=None, help="directory for a save_pretrained checkpoint")
    a = ap.parse_args(argv)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    torch.manual_seed(0)  # the same weights on every rank
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))

    # step 1: mark the Muon matrices (before fully_shard)
    dmuon.dedicate_params(model, mesh,
                          predicate=lambda n, p: p.ndim == 2 and any(k in n for k in PROJ))
    # step 2: FSDP2 as usual; the dedicated matrices are skipped automatically
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # step 3: dmuon.Muon as the optimizer (AdamW for embeddings, norms, lm_head)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)

    for step, batch in enumerate(dataloader(rank, a.steps, per_rank=4)):
        optimizer.zero_grad()
        outputs = model(**batch)
        outputs.loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step + 1:3d}  loss {outputs.loss.item():.4f}", flush=True)

    state_dict = dmuon.get_model_state_dict(model)  # collective: every rank calls it
    if a.save and rank == 0:
        model.save_pretrained(a.save, state_dict=state_dict)
        print(f"saved to {a.save}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    run(main, sys.argv[1:], world_size=2, backend="gloo")
