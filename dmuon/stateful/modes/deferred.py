"""Deferred dedication: ``dedicate_params`` before tensor parallelism (the seeds' torchtitan order).

torchtitan's recipe calls ``dmuon.dedicate_params(model, mesh["dp"], predicate)`` *before*
``parallelize_model`` applies TP and ``fully_shard``, often on a model built on the meta device
that ``to_empty`` + ``init_weights`` materialize afterwards. How TP slices a matrix (rows or
columns, over which ranks) is only known once TP ran, and a meta-built model has no values yet.
So when ``dedicate_params`` is given the dp sub-mesh of a larger mesh (or TP DTensors still on
meta), it *defers*:

1. it checks its arguments and the meshes on every rank (the same checks, raising on all ranks),
   records the selected names and arguments (:class:`PendingDedication`, ``model._dmuon_pending``),
   and marks each selected param's *slot* (module + attribute name), so that every later
   ``fully_shard`` skips whatever param sits there, also the new DTensor objects TP puts there
   (:data:`dmuon.compat.fsdp_patch.PENDING_SLOTS_ATTR`);
2. TP, ``fully_shard``, ``to_empty`` and the model's init then run as without dmuon: the selected
   matrices are ordinary TP DTensors meanwhile (each rank holds its TP slice of every one of them:
   TP's own footprint, until step 3), and TP's own init gives them their values;
3. ``dmuon.Muon(model)`` finishes the dedication exactly as ``dedicate_params`` would have on the
   TP-applied model (:func:`finish_pending`): every slice moves to its
   owner's master and the other ranks free theirs.

A forward before ``dmuon.Muon(model)`` raises (the matrices are not dedicated yet), before any
hook of the model runs (a global forward pre-hook while a dedication is pending).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch.nn as nn
from torch.nn.modules.module import register_module_forward_pre_hook

from dmuon.compat.fsdp_patch import PENDING_SLOTS_ATTR
from dmuon.compat.torch_api import mesh_root

__all__ = ["PENDING_ATTR", "PendingDedication", "covers_world", "should_defer", "defer",
           "check_materialized", "find_pending", "finish_pending", "clear_pending"]

PENDING_ATTR = "_dmuon_pending"


@dataclass
class PendingDedication:
    """What a deferred ``dedicate_params`` call recorded: the selected ``names``, the keyword
    arguments of the call (``mesh`` included) and ``finish(model)``, the dedication itself (set
    by ``dedicate_params``: the optimizer completes it through :func:`finish_pending` without
    importing the setup wing)."""

    names: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    finish: Any = None


def covers_world(mesh: Any, replicate_mesh: Any = None) -> bool:
    """Whether ``mesh`` (times ``replicate_mesh``) has as many ranks as the world (else it is a
    sub-mesh, e.g. the dp part of a (dp, tp) mesh; checked in full when dedicating)."""
    import torch.distributed as dist
    try:
        size = mesh.size() * (replicate_mesh.size() if replicate_mesh is not None else 1)
    except AttributeError:  # not a DeviceMesh: the setup check names it
        return True
    if size >= dist.get_world_size():
        return True
    # a slice of dmuon's own HSDP mesh (replicate, shard) passed without replicate_mesh is an
    # HSDP mistake, not TP: the setup check names it at once
    root = mesh_root(mesh)
    return root is not None and set(root.mesh_dim_names or ()) == {"replicate", "shard"}


def should_defer(chosen: Mapping[str, Any], sub_mesh: bool) -> bool:
    """Defer when TP is not applied yet to a dp sub-mesh's model (no selected param is a DTensor),
    or when the selected TP DTensors are still on meta (their values come after ``fully_shard``)."""
    from torch.distributed.tensor import DTensor
    dts = [p for p in chosen.values() if isinstance(p, DTensor)]
    if sub_mesh and not dts:
        return True
    return bool(dts) and any(p.is_meta for p in chosen.values())


def check_materialized(chosen: Mapping[str, Any]) -> None:
    """Finishing a deferred dedication: every selected param must hold values by now.

    Raises:
      RuntimeError: some are still on the meta device, naming them and the fix.
    """
    meta = [n for n, p in chosen.items() if p.is_meta]
    if meta:
        raise RuntimeError(
            f"dmuon.Muon(model): the selected matrices {meta[:4]}{' ...' if len(meta) > 4 else ''} "
            "are still on the meta device. With a deferred dedication (dedicate_params before "
            "tensor parallelism, or on a meta-device model) call model.to_empty(device=...) and the "
            "model's init (e.g. init_weights()) after fully_shard and before dmuon.Muon(model).")


def _forward_guard(module: nn.Module, args: Any) -> None:
    raise RuntimeError(
        "dmuon: this model's Muon matrices are not dedicated yet: dedicate_params ran before "
        "tensor parallelism (or on a meta-device model), so the dedication completes in "
        "dmuon.Muon(model). Build the optimizer (dmuon.Muon(model, ...)) on every rank before the "
        "first forward (after fully_shard, to_empty and the model's init).")


#: models with a pending dedication; one global forward pre-hook (it runs before every module's
#: own hooks, FSDP2's included, so a refused forward leaves FSDP2's state untouched) while any
_PENDING_MODELS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_GLOBAL_HOOK: list = []


def _global_guard(module: nn.Module, args: Any) -> None:
    if module in _PENDING_MODELS:
        _forward_guard(module, args)


def defer(model: nn.Module, chosen: Mapping[str, nn.Parameter], kwargs: dict,
          finish: Any) -> None:
    """Record a deferred dedication on ``model`` (see the module docstring); ``finish(model)``
    completes it."""
    for n in chosen:
        mod_name, _, leaf = n.rpartition(".")
        module = model.get_submodule(mod_name) if mod_name else model
        slots = set(getattr(module, PENDING_SLOTS_ATTR, ()))
        slots.add(leaf)
        setattr(module, PENDING_SLOTS_ATTR, frozenset(slots))
    pending = PendingDedication(tuple(chosen), dict(kwargs), finish)
    _PENDING_MODELS.add(model)
    if not _GLOBAL_HOOK:
        _GLOBAL_HOOK.append(register_module_forward_pre_hook(_global_guard))
    setattr(model, PENDING_ATTR, pending)


def find_pending(model: nn.Module) -> Optional[PendingDedication]:
    return getattr(model, PENDING_ATTR, None)


def finish_pending(model: nn.Module) -> None:
    """Complete a deferred ``dedicate_params`` (collective; ``dmuon.Muon(model)`` calls it; no-op
    without one): the same dedication, on the model TP, ``fully_shard`` and the init made."""
    pending = find_pending(model)
    if pending is not None:
        pending.finish(model)


def clear_pending(model: nn.Module) -> None:
    """Drop the record, the slot marks and the forward guard (the dedication is done)."""
    pending = find_pending(model)
    if pending is None:
        return
    _PENDING_MODELS.discard(model)
    if not _PENDING_MODELS and _GLOBAL_HOOK:
        _GLOBAL_HOOK.pop().remove()
    for m in model.modules():
        if PENDING_SLOTS_ATTR in m.__dict__:
            delattr(m, PENDING_SLOTS_ATTR)
    delattr(model, PENDING_ATTR)
