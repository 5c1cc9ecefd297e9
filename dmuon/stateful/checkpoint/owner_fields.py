"""The owners' chain state across ranks, field by field: gathered to every rank for a checkpoint
(:func:`gather_fields`) and staged back onto the owners (:func:`stage_fields`) through the bucketed
checkpoint transfer; TP slices assembled (and cut by ``tensor_parallel.local_part``).

Design notes: docs/design/checkpoint.md, "dmuon.stateful.checkpoint.owner_fields".
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

import torch

from dmuon.functional.state_dtype import checkpoint_dtype
from dmuon.stateful.checkpoint.state_dict import full_copy
from dmuon.stateful.checkpoint.transfer import transfer_of
from dmuon.stateful.modes.tensor_parallel import assemble_tp_slices, full_shape, local_part

__all__ = ["layout_of", "gather_fields", "entry_shape", "stage_fields"]


def layout_of(optimizer: Any, key: str) -> str:
    """The layout of state-dict key ``key`` of a dedicated matrix (``"param"`` for Muon's
    ``momentum_buffer`` and a ``master``)."""
    return next((f.layout for f in optimizer._owner.fields if f.key == key), "param")


def gather_fields(optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Collective: ``{name: {key: full tensor}}`` of every field of every dedicated matrix, on
    every rank, hook group by hook group (the owners' values through the checkpoint transfer's
    buckets, a field smaller than its param in the first elements of the param's entry; TP slices
    assembled), with its ``"master"`` where the master dtype is not the param's."""
    var, rt = optimizer._owner, optimizer.dedicated_state
    tr = transfer_of(rt)
    out: dict[str, dict[str, torch.Tensor]] = {}
    masters = rt.owned_masters()
    for group in tr.layout.groups:
        for f in var.fields:  # the stored momentum: its exact values (checkpoint dtype)
            mine = var.value_of(f.key, masters, names=rt.hook_groups.names(group))
            got = tr.to_every_rank(group, mine, owner_only=True)
            for n, t in got.items():
                shape = var.local_shapes[f.key][n]
                v = assemble_tp_slices(rt.tp_layouts, {n: t.reshape(-1)[:math.prod(shape)].view(
                    shape).clone()}, rt.mesh_groups.tp_group, f.layout)[n]
                if f is var.stored_field and var.storage is not None:  # bf16 for bf16 / 8-bit
                    v = v.to(checkpoint_dtype(var.storage.dtype, v.dtype))
                out.setdefault(n, {})[f.key] = v
        wide = {n for n in rt.hook_groups.names(group)
                if n in out and rt.master_dtype[n] != rt.orig_dtype[n]}  # its master kept
        for n, t in tr.full_masters([group] if wide else []):
            if n in wide:
                out[n]["master"] = t.clone()
    return out


def entry_shape(optimizer: Any, n: str, key: str) -> tuple[int, ...]:
    """The single-device shape of dedicated entry ``key`` of matrix ``n``."""
    if key == "master":
        return full_shape(optimizer.dedicated_state, n)
    return optimizer._owner.full_shapes[key][n]


def stage_fields(optimizer: Any, ded: Mapping[str, Mapping[str, Any]], *,
                 rank0: bool) -> dict[str, dict[str, torch.Tensor]]:
    """Collective: ``{key: {owned name: tensor}}`` staged from the dedicated entries ``ded``
    (validated), and ``"master"``: ``{name: tensor}`` of this rank's column where ``ded`` has a
    master: ``"param"`` fields and masters (full tensors or ``Shard(0)`` rows) through the
    checkpoint transfer to the owner columns, the others (full tensors on every rank) taken by
    their owner. ``rank0``: only rank 0 holds the values; everything moves from it (a smaller
    field: each rank's piece, 1-D, in the first elements of its matrix)."""
    var, rt = optimizer._owner, optimizer.dedicated_state

    def move(key: str, part: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Entry ``key`` of the matrices that have it on their owner columns (``part(n, full)``:
        this rank's piece of a full value; default: its TP slice)."""
        names = {n: entry_shape(optimizer, n, key) for n, e in ded.items() if key in e}
        return transfer_of(rt).to_owners(names, lambda n: ded[n][key], rank0=rank0,
                                         shapes=names, part=part)

    owned = set(rt.owned_names)
    out: dict[str, dict[str, torch.Tensor]] = {f.key: {} for f in var.fields}
    for f in var.fields:
        if f.layout == "param" or rank0:
            part = None if f.layout == "param" else \
                (lambda n, v, lay=f.layout: local_part(rt, n, v, lay).reshape(-1))
            for n, t in move(f.key, part):
                if n in owned and f.layout == "param":
                    out[f.key][n] = t.clone()
                elif n in owned:  # a smaller field: its first elements
                    live = var.field_values(f.key)[n]
                    out[f.key][n] = t.reshape(-1)[:live.numel()].view(live.shape).to(
                        dtype=live.dtype, copy=True)
            continue
        for n in rt.names:
            v = full_copy(ded[n][f.key])  # (collective for a DTensor)
            if n in owned:
                out[f.key][n] = local_part(rt, n, v, f.layout).to(
                    device=rt.device, dtype=var.field_values(f.key)[n].dtype)
    out["master"] = {n: t.clone() for n, t in move("master")}
    return out
