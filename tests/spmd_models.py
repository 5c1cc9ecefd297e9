"""A small LM whose params are DTensors on a full SPMD mesh (data-parallel axes and a TP axis),
the way ``fully_shard(..., dp_mesh_dims=...)`` wants them (torchtitan 0.3's "full DTensor"
layout), computing on local tensors (each block's TP collectives are DTensor redistributes on the
TP axis). With no mesh it is the same model on plain tensors: the single-process reference.

Dedicated matrices: ``up_proj`` (column-parallel: ``Shard(0)`` on the TP axis) and ``down_proj``
(row-parallel: ``Shard(1)``); every other param is ``Replicate()`` everywhere.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

TP_DIMS = {"up_proj.weight": 0, "down_proj.weight": 1}


def _local(p: torch.Tensor) -> torch.Tensor:
    """A replicated param's local tensor (the whole of it)."""
    from torch.distributed.tensor import DTensor
    return p.to_local() if isinstance(p, DTensor) else p


def _on_tp(p: torch.Tensor, model: "SpmdLM") -> torch.Tensor:
    """A param as what the block computes with: its local tensor, as a DTensor on the 1-D TP
    mesh when there is one (so DTensor runs TP's collectives and their backward)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(p, DTensor):
        return p
    local = p.to_local()
    if model.tp_mesh is None:
        return local
    return DTensor.from_local(local, model.tp_mesh, [p.placements[model.tp_index]],
                              run_check=False)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, root: "list[SpmdLM]"):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(dim))
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self._root = root  # a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate
        m = self._root[0]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * _local(self.norm)
        if m.tp_mesh is not None:
            h = DTensor.from_local(h, m.tp_mesh, [Replicate()], run_check=False)
        y = F.linear(F.silu(F.linear(h, _on_tp(self.up_proj.weight, m))),
                     _on_tp(self.down_proj.weight, m))
        if m.tp_mesh is not None:
            y = y.redistribute(m.tp_mesh, [Replicate()]).to_local()
        return x + y


class SpmdLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, hidden: int = 24, n_layers: int = 2):
        super().__init__()
        root = [self]
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, hidden, root) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.tp_mesh, self.tp_index = None, 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids[:, :-1], _local(self.embed.weight))
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(x, _local(self.head.weight))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def make_spmd_model(seed: int = 0) -> SpmdLM:
    gen = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = SpmdLM().double()
    with torch.no_grad():
        for layer in model.layers:
            layer.norm.add_(0.1 * torch.randn_like(layer.norm))
    torch.random.set_rng_state(gen)
    return model


def distribute_spmd(model: SpmdLM, mesh, tp: str | None) -> None:
    """Make every param (dedicated placeholders are skipped by their pending slot, see
    dmuon.stateful.modes.deferred) a DTensor on the full ``mesh``: ``Replicate()`` on every axis
    but ``tp``, where ``up_proj`` / ``down_proj`` are ``Shard(0)`` / ``Shard(1)``."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    names = mesh.mesh_dim_names
    model.tp_index = names.index(tp) if tp is not None else 0
    model.tp_mesh = mesh[tp] if tp is not None else None
    for mod_name, module in model.named_modules():
        for leaf, p in list(module.named_parameters(recurse=False)):
            full = f"{mod_name}.{leaf}" if mod_name else leaf
            kind = next((d for k, d in TP_DIMS.items() if full.endswith(k)), None)
            placements = [Shard(kind) if (a == tp and kind is not None) else Replicate()
                          for a in names]
            module.register_parameter(leaf, nn.Parameter(
                distribute_tensor(p.detach(), mesh, placements), requires_grad=p.requires_grad))


def spmd_predicate(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and "proj" in name
