"""Deferred dedication: ``dedicate_params`` before tensor parallelism (the seeds' torchtitan
order). It records the selection and marks the params' slots (``fully_shard`` skips them);
``dmuon.Muon(model)`` finishes the dedication on the TP-applied model. A forward before that raises.

Design notes: docs/design/modes.md, "dmuon.stateful.modes.deferred".
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Optional

import torch.nn as nn
from torch.nn.modules.module import register_module_forward_pre_hook

from dmuon.compat.fsdp_patch import PENDING_SLOTS_ATTR
from dmuon.compat.torch_api import mesh_root

__all__ = ["PENDING_ATTR", "covers_world", "should_defer", "defer", "find_pending",
           "finish_pending", "clear_pending"]

#: a deferred ``dedicate_params`` call's record: ``finish(model)``, the dedication itself with the
#: call's arguments (run by :func:`finish_pending`)
PENDING_ATTR = "_dmuon_pending"


def covers_world(mesh: Any, replicate_mesh: Any = None) -> bool:
    """Whether ``mesh`` (times ``replicate_mesh``) spans the world (else a sub-mesh, e.g. the dp
    part of a (dp, tp) mesh)."""
    import torch.distributed as dist
    try:
        size = mesh.size() * (replicate_mesh.size() if replicate_mesh is not None else 1)
    except AttributeError:  # not a DeviceMesh: the setup check names it
        return True
    if size >= dist.get_world_size():
        return True
    # a slice of dmuon's own HSDP mesh: an HSDP mistake, not TP (the setup check names it)
    root = mesh_root(mesh)
    return root is not None and set(root.mesh_dim_names or ()) == {"replicate", "shard"}


def should_defer(chosen: Mapping[str, Any], sub_mesh: bool) -> bool:
    """Defer when TP is not applied yet to a dp sub-mesh's model, or when the selected TP DTensors
    are still on meta."""
    from torch.distributed.tensor import DTensor
    dts = [p for p in chosen.values() if isinstance(p, DTensor)]
    if sub_mesh and not dts:
        return True
    return bool(dts) and any(p.is_meta for p in chosen.values())


#: models with a pending dedication; one global forward pre-hook while any (before FSDP2's hooks)
_PENDING_MODELS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_GLOBAL_HOOK: list = []


def _global_guard(module: nn.Module, args: Any) -> None:
    if module in _PENDING_MODELS:
        raise RuntimeError(
            "dmuon: this model's Muon matrices are not dedicated yet: dedicate_params ran before "
            "tensor parallelism (or on a meta-device model), so the dedication completes in "
            "dmuon.Muon(model). Build the optimizer (dmuon.Muon(model, ...)) on every rank before "
            "the first forward (after fully_shard, to_empty and the model's init).")


def defer(model: nn.Module, chosen: Mapping[str, nn.Parameter],
          finish: Callable[[nn.Module], None]) -> None:
    """Record a deferred dedication on ``model``; ``finish(model)`` completes it."""
    for n in chosen:
        mod_name, _, leaf = n.rpartition(".")
        module = model.get_submodule(mod_name) if mod_name else model
        slots = set(getattr(module, PENDING_SLOTS_ATTR, ()))
        slots.add(leaf)
        setattr(module, PENDING_SLOTS_ATTR, frozenset(slots))
    _PENDING_MODELS.add(model)
    if not _GLOBAL_HOOK:
        _GLOBAL_HOOK.append(register_module_forward_pre_hook(_global_guard))
    setattr(model, PENDING_ATTR, finish)


def find_pending(model: nn.Module) -> Optional[Callable[[nn.Module], None]]:
    return getattr(model, PENDING_ATTR, None)


def finish_pending(model: nn.Module) -> None:
    """Complete a deferred ``dedicate_params`` (collective; ``dmuon.Muon(model)`` calls it; no-op
    without one): the same dedication, on the model TP, ``fully_shard`` and the init made."""
    finish = find_pending(model)
    if finish is not None:
        finish(model)
        clear_pending(model)


def clear_pending(model: nn.Module) -> None:
    """Drop the record, the slot marks and the forward guard (the dedication is done)."""
    if find_pending(model) is None:
        return
    _PENDING_MODELS.discard(model)
    if not _PENDING_MODELS and _GLOBAL_HOOK:
        _GLOBAL_HOOK.pop().remove()
    for m in model.modules():
        if PENDING_SLOTS_ATTR in m.__dict__:
            delattr(m, PENDING_SLOTS_ATTR)
    delattr(model, PENDING_ATTR)
