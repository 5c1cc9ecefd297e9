"""The owners' chain state across ranks, field by field: gathered to every rank for a checkpoint
(:func:`gather_fields`) and staged back onto the owners (:func:`stage_fields`) through the bucketed
checkpoint transfer; TP slices assembled and cut (:func:`local_field`).

Design notes: docs/design/checkpoint.md, "dmuon.stateful.checkpoint.owner_fields".
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from dmuon.functional.state_dtype import checkpoint_dtype
from dmuon.functional.state_fields import tp_concat_dim
from dmuon.stateful.checkpoint.transfer import transfer_of

__all__ = ["layout_of", "gather_fields", "local_field", "stage_fields"]


def layout_of(optimizer: Any, key: str) -> str:
    """The layout of state-dict key ``key`` of a dedicated matrix (``"param"`` for Muon's
    ``momentum_buffer`` and a ``master``)."""
    return next((f.layout for f in optimizer._owner.fields if f.key == key), "param")


def gather_fields(optimizer: Any, group: str) -> dict[str, dict[str, torch.Tensor]]:
    """Collective: ``{name: {key: full tensor}}`` of every field of the matrices of hook group
    ``group``, on every rank (the owners' values through the checkpoint transfer's buckets, a
    field smaller than its param in the first elements of the param's entry; TP slices
    assembled)."""
    var, rt = optimizer._owner, optimizer.dedicated_state
    tr = transfer_of(rt)
    out: dict[str, dict[str, torch.Tensor]] = {}
    masters = rt.owned_masters()
    for f in var.fields:  # the stored momentum: its exact values (checkpoint dtype)
        mine = var.value_of(f.key, masters, names=rt.hook_groups.names(group))
        got = tr.to_every_rank(group, mine, owner_only=True)
        for n, t in got.items():
            shape = var.local_shapes[f.key][n]
            v = t.reshape(-1)[:math.prod(shape)].view(shape).clone()
            rule = tp_concat_dim(f.layout, getattr(rt.tp_layouts.get(n), "dim", None))
            if rule is not None:
                parts = [torch.empty_like(v) for _ in range(rt.tp_layouts[n].parts)]
                dist.all_gather(parts, v.contiguous(), group=rt.mesh_groups.tp_group)
                v = torch.cat(parts, dim=rule)
            if f is var.stored_field and var.storage is not None:  # bf16 for bf16 / 8-bit
                v = v.to(checkpoint_dtype(var.storage.dtype, v.dtype))
            out.setdefault(n, {})[f.key] = v
    return out


def local_field(rt: Any, layout: str, n: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full field value of matrix ``n`` (its TP slice's)."""
    lay = rt.tp_layouts.get(n)
    rule = tp_concat_dim(layout, getattr(lay, "dim", None))
    if rule is None:
        return full
    return full.chunk(lay.parts, dim=rule)[rt.mesh_groups.tp_index]


def stage_fields(optimizer: Any, ded: Mapping[str, Mapping[str, Any]], move: Callable, *,
                 rank0: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """Collective: ``{key: {owned name: tensor}}`` staged from the dedicated entries ``ded``
    (validated): ``"param"`` fields (full tensors or ``Shard(0)`` rows) through the checkpoint
    transfer to the owner columns (``move(group, key, part)`` -> ``{name: value}`` of this
    rank's column; ``part``: this rank's piece of a full value, ``None``: its TP slice), the
    others (full tensors on every rank) taken by their owner. ``rank0``: only rank 0 holds the
    values; the others move too (each rank's piece, 1-D, in the first elements of its matrix)."""
    var, rt = optimizer._owner, optimizer.dedicated_state
    tr = transfer_of(rt)
    owned = set(rt.owned_names)
    out: dict[str, dict[str, torch.Tensor]] = {f.key: {} for f in var.fields}
    for f in var.fields:
        if f.layout == "param" or rank0:
            part = None if f.layout == "param" else \
                (lambda n, v, lay=f.layout: local_field(rt, lay, n, v).reshape(-1))
            for group in tr.each_group():
                full = move(group, f.key, part)
                for n, t in full.items():
                    if n in owned and f.layout == "param":
                        out[f.key][n] = t.clone()
                    elif n in owned:  # a smaller field: its first elements
                        live = var.field_values(f.key)[n]
                        out[f.key][n] = t.reshape(-1)[:live.numel()].view(live.shape).to(
                            dtype=live.dtype, copy=True)
            continue
        for n in rt.names:
            v = ded[n][f.key]
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            if n in owned:
                out[f.key][n] = local_field(rt, f.layout, n, v).to(
                    device=rt.device, dtype=var.field_values(f.key)[n].dtype)
    return out
