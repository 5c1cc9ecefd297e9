"""HSDP with dmuon: a 2-D (replicate, shard) mesh, runnable on CPU with 4 gloo ranks.

    torchrun --nproc_per_node 4 examples/hsdp.py     # or
    python examples/hsdp.py                           # spawns 4 local ranks itself

Mesh ``(R, G) = (2, 2)``: ranks ``r * G + s``. FSDP2 shards the other params over ``hsdp["shard"]``
and replicates them over ``hsdp["replicate"]``; dmuon plans the Muon matrices over all ``G * R``
slots. Per step, for each matrix with global owner ``(s, r_o)``:

* forward: in every replica ``r``, rank ``(s, r)`` broadcasts the matrix to its shard group (every
  rank of column ``s`` holds the master);
* backward: gradients are averaged over the shard group to ``(s, r)`` (stage 1, lane "reduce"),
  then over column ``s`` to ``(s, r_o)`` (stage 2, lane "replicate"): the mean over all G*R ranks;
* step: only ``(s, r_o)`` runs momentum + Newton–Schulz + update, then publishes the new master to
  the rest of column ``s`` asynchronously; the next forward's pre-hook of each layer waits it.

Rank 0 prints the loss as it falls and the bytes each lane moved.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.launch import run

VOCAB, DIM, SEQ, REPLICAS = 64, 64, 32, 2


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim)
        self.qkv_proj = nn.Linear(dim, 3 * dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.up_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv_proj(self.norm1(x)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out_proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down_proj(F.silu(self.up_proj(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(n_layers))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def batches(rank: int, steps: int, per_rank: int):
    """Learnable synthetic data: each sequence counts up from a random start, modulo VOCAB."""
    g = torch.Generator().manual_seed(2000 + rank)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (per_rank, 1), generator=g)
        yield (start + torch.arange(SEQ)) % VOCAB


def main(steps: int = 60, verbose: bool = True) -> dict:
    """Train for ``steps`` steps on the current process group; returns losses and lane bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % REPLICAS:
        raise SystemExit(f"world size {world} must be a multiple of {REPLICAS} replicas")
    torch.manual_seed(0)  # same init on every rank
    hsdp = init_device_mesh("cpu", (REPLICAS, world // REPLICAS),
                            mesh_dim_names=("replicate", "shard"))
    model = Model()

    dmuon.dedicate_params(model, hsdp["shard"], lambda n, p: p.ndim == 2 and "proj" in n,
                          replicate_mesh=hsdp["replicate"])
    for layer in model.layers:
        fully_shard(layer, mesh=hsdp)
    fully_shard(model, mesh=hsdp)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)  # replicate_async=True by default

    losses = []
    for i, batch in enumerate(batches(rank, steps, per_rank=8)):
        optimizer.zero_grad()
        loss = model(batch)       # each layer's pre-hook waits its part of the last publish
        loss.backward()
        optimizer.step()          # owners update, then publish to their shard column (async)
        losses.append(loss.item())
        if verbose and rank == 0 and (i + 1) % 10 == 0:
            print(f"step {i + 1:3d}  loss {loss.item():.4f}", flush=True)

    dmuon.wait_all_replicate_broadcasts(model)  # e.g. before a foreign checkpointer reads weights
    sd = dmuon.get_model_state_dict(model)      # (drains by itself too)
    lanes = optimizer.dedicated_state.executor.counters()
    if verbose and rank == 0:
        sent = ", ".join(f"{k} {v['sent_bytes'] / steps / 1e3:.1f} kB" for k, v in lanes.items())
        print(f"rank 0 sent per step: {sent}", flush=True)
        print(f"done: {len(sd)} tensors in the full state dict", flush=True)
    return {"losses": losses, "lanes": lanes, "n_tensors": len(sd)}


if __name__ == "__main__":
    run(main, world_size=int(sys.argv[1]) if len(sys.argv) > 1 else 4, backend="gloo")
