"""Custom training loop with dmuon (the seeds' recipe), runnable on CPU with gloo.

    torchrun --nproc_per_node 2 examples/custom_loop.py     # or
    python examples/custom_loop.py                           # spawns 2 local ranks itself

dedicate_params -> fully_shard (layers, then root) -> dmuon.Muon, then an unchanged loop with
gradient accumulation through ``dmuon.no_sync``. Rank 0 prints the loss as it falls.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.launch import run

VOCAB, DIM, SEQ = 64, 64, 32


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


class MyModel(nn.Module):
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


def batches(rank: int, world: int, steps: int, per_rank: int):
    """Learnable synthetic data: each sequence counts up from a random start, modulo VOCAB."""
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (per_rank, 1), generator=g)
        yield (start + torch.arange(SEQ)) % VOCAB


def main() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same init on every rank
    mesh = init_device_mesh("cpu", (world,))
    model = MyModel()

    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and "proj" in n)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)

    accum_steps = 2
    for i, batch in enumerate(batches(rank, world, steps=80, per_rank=8)):
        ctx = dmuon.no_sync(model) if (i + 1) % accum_steps != 0 else contextlib.nullcontext()
        with ctx:
            loss = model(batch) / accum_steps
            loss.backward()
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0 and ((i + 1) // accum_steps) % 5 == 0:
                print(f"step {(i + 1) // accum_steps:3d}  loss {loss.item() * accum_steps:.4f}",
                      flush=True)
    sd = dmuon.get_model_state_dict(model)
    if rank == 0:
        print(f"done: {len(sd)} tensors in the full state dict", flush=True)


if __name__ == "__main__":
    run(main, world_size=int(sys.argv[1]) if len(sys.argv) > 1 else 2, backend="gloo")
