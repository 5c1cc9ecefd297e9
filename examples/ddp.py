"""dmuon under DistributedDataParallel (DDP mode), runnable on CPU with 2 gloo ranks.

    torchrun --nproc_per_node 2 examples/ddp.py     # or
    python examples/ddp.py                           # spawns 2 local ranks itself

The natural call order: ``dedicate_params(..., options=dmuon.DedicateOptions(data_parallel="ddp"))``
on the 1-D mesh of the DDP ranks, then ``DistributedDataParallel(model)`` (it skips the dedicated
matrices), then
``dmuon.Muon(model)``. Every rank holds every matrix whole; per step each matrix's gradient is
averaged to its owner only, only the owner runs momentum + Newton–Schulz + update, and the new
value is broadcast back (async, waited by the next forward). Gradient accumulation uses DDP's own
``no_sync()``; clipping ``dmuon.clip_grad_norm_``.

Rank 0 prints the loss as it falls and the dedicated bytes it moved per step.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.launch import run

VOCAB, DIM, SEQ = 64, 64, 32


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up_proj = nn.Linear(dim, 4 * dim, bias=False)
        self.down_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(F.gelu(self.up_proj(self.norm(x))))


class Model(nn.Module):
    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(n_layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids[:, :-1])
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids[:, 1:].flatten())


def batches(rank: int, steps: int, per_rank: int):
    """Learnable synthetic data: each sequence counts up from a random start, modulo VOCAB."""
    g = torch.Generator().manual_seed(3000 + rank)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (per_rank, 1), generator=g)
        yield (start + torch.arange(SEQ)) % VOCAB


def main(steps: int = 40, accum: int = 2, verbose: bool = True) -> dict:
    """Train for ``steps`` optimizer steps on the current process group; returns the losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same init on every rank
    model = Model()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)),
                          lambda n, p: p.ndim == 2 and "proj" in n,
                          options=dmuon.DedicateOptions(data_parallel="ddp"))
    model = DistributedDataParallel(model)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)

    losses = []
    for i, batch in enumerate(batches(rank, steps, per_rank=8)):
        optimizer.zero_grad()
        for j, mb in enumerate(batch.chunk(accum)):
            if j < accum - 1:
                with model.no_sync():     # no traffic for the dedicated matrices either
                    (model(mb) / accum).backward()
            else:
                loss = model(mb) / accum
                loss.backward()
        dmuon.clip_grad_norm_(model, 1.0)
        optimizer.step()                  # owners update, then broadcast to every rank (async)
        losses.append(loss.item() * accum)
        if verbose and rank == 0 and (i + 1) % 10 == 0:
            print(f"step {i + 1:3d}  loss {losses[-1]:.4f}", flush=True)
    sd = dmuon.get_model_state_dict(model)   # single-device names, loadable into an FSDP2 run
    lanes = optimizer.dedicated_state.executor.counters()
    if verbose and rank == 0:
        moved = sum(v["sent_bytes"] + v["received_bytes"] for v in lanes.values()) / steps
        print(f"rank 0 dedicated bytes per step (sent + received): {moved / 1e3:.1f} kB; "
              f"{len(sd)} tensors in the full state dict", flush=True)
    return {"losses": losses, "n_tensors": len(sd)}


if __name__ == "__main__":
    run(main, world_size=int(sys.argv[1]) if len(sys.argv) > 1 else 2, backend="gloo")
