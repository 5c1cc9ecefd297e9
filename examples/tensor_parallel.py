"""Tensor parallel + FSDP2 + dmuon: a (dp 2, tp 2) mesh, runnable on CPU with 4 gloo ranks.

    torchrun --nproc_per_node 4 examples/tensor_parallel.py [A|B]     # or
    python examples/tensor_parallel.py [A|B]                         # spawns 4 local ranks itself

Each block's q / k / v and up projections are ``ColwiseParallel`` (rows split over TP), its output
and down projections ``RowwiseParallel`` (columns split). Order ``A`` (default): TP, then
``dedicate_params(model, mesh["dp"])``, then ``fully_shard(mesh=mesh["dp"])``. Order ``B`` (the
seeds' torchtitan order): ``dedicate_params`` first (deferred: it returns ``{}``), then TP and
``fully_shard``; ``dmuon.Muon(model)`` dedicates the TP-applied model.

Per step and matrix: the owner of each TP slice (one per TP index, at one dp coordinate) broadcasts
its slice in forward and gets its slice's gradient in backward; at the step the TP group gathers the
NS input to one root, which orthogonalizes the full matrix and scatters the slices back. Rank 0
prints the loss and the bytes of the TP gathers / scatters.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import dmuon
from dmuon.launch import run

VOCAB, DIM, HEADS, SEQ, TP = 64, 64, 4, 32, 2
PLAN = {"q_proj": ColwiseParallel, "k_proj": ColwiseParallel, "v_proj": ColwiseParallel,
        "o_proj": RowwiseParallel, "up_proj": ColwiseParallel, "down_proj": RowwiseParallel}


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.up_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)

        def heads(y):  # the local heads under TP (-1: the width this rank's slice produced)
            return y.view(b, t, -1, DIM // HEADS).transpose(1, 2)
        a = F.scaled_dot_product_attention(heads(self.q_proj(h)), heads(self.k_proj(h)),
                                           heads(self.v_proj(h)), is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
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


def batches(dp_rank: int, steps: int, per_rank: int):
    """Learnable synthetic data (counting sequences); the TP ranks of one dp rank get the same."""
    g = torch.Generator().manual_seed(3000 + dp_rank)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (per_rank, 1), generator=g)
        yield (start + torch.arange(SEQ)) % VOCAB


def main(order: str = "A", steps: int = 40, verbose: bool = True) -> dict:
    """Train ``steps`` steps on the current process group; returns the losses and TP bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % TP:
        raise SystemExit(f"world size {world} must be a multiple of the TP degree {TP}")
    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same model on every rank
    model = Model()
    predicate = lambda n, p: p.ndim == 2 and "proj" in n  # noqa: E731

    def tensor_parallel() -> None:
        for block in model.layers:
            parallelize_module(block, mesh["tp"], {k: v() for k, v in PLAN.items()})
    if order == "A":
        tensor_parallel()
        dmuon.dedicate_params(model, mesh["dp"], predicate)
    else:
        dmuon.dedicate_params(model, mesh["dp"], predicate)  # deferred until dmuon.Muon
        tensor_parallel()
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)

    losses = []
    for i, batch in enumerate(batches(mesh["dp"].get_local_rank(), steps, per_rank=8)):
        optimizer.zero_grad()
        loss = model(batch)
        loss.backward()
        dmuon.clip_grad_norm_(model, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if verbose and rank == 0 and (i + 1) % 10 == 0:
            print(f"step {i + 1:3d}  loss {loss.item():.4f}", flush=True)
    tp_bytes = optimizer._tp.bytes_received if optimizer._tp is not None else 0
    sd = dmuon.get_model_state_dict(model)  # full matrices, as one device's model.state_dict()
    if verbose and rank == 0:
        print(f"order {order}: rank 0 received {tp_bytes / steps / 1e3:.1f} kB per step in the TP "
              f"gathers / scatters; {len(sd)} full tensors in the state dict, e.g. "
              f"layers.0.q_proj.weight {tuple(sd['layers.0.q_proj.weight'].shape)}", flush=True)
    return {"losses": losses, "tp_bytes": tp_bytes,
            "shapes": {k: tuple(v.shape) for k, v in sd.items()}}


if __name__ == "__main__":
    run(main, sys.argv[1] if len(sys.argv) > 1 else "A", world_size=4, backend="gloo")
