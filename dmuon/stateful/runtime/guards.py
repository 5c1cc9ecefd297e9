"""Torch's own tools on a dmuon model: right, or a clear error naming the dmuon call. The guards
(:class:`DedicatedPlaceholder`, :class:`DedicatedGradMarker`, :class:`TPSliceGuard`,
:func:`guard_module_apply`) refuse, with :class:`DedicatedParamError`, any op on values that are
not on this rank, where a tool written for local tensors would silently see nothing.

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.guards".
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from dmuon.compat.torch_api import make_tensor_subclass, torch_function_disabled
from dmuon.functional.guard_rules import (FP16_LOSS_SCALING, PASS_ON, first_instance,
                                          full_shape_query, refusal_hint, written_while_gathered)
from dmuon.stateful.runtime.errors import DedicatedParamError, from_dtensor_api, tp_error
from dmuon.stateful.runtime.guard_base import TorchGuard, call_plain

__all__ = ["DedicatedParamError", "saving_state_dict", "DedicatedPlaceholder", "DedicatedGradMarker",
           "TPSliceGuard", "to_placeholder", "to_plain", "to_tp_slice_guard", "make_marker",
           "guard_module_apply"]

_SAVING = threading.local()


def saving_state_dict(delta: int = 0) -> bool:
    """Enter (``+1``) / leave (``-1``) dmuon's own ``model.state_dict()`` pass, during which a
    placeholder may be ``detach``-ed into the dict (dmuon's post-hook replaces it); returns whether
    such a pass is running on this thread."""
    depth = max(0, getattr(_SAVING, "depth", 0) + delta)
    _SAVING.depth = depth
    return depth > 0


class DedicatedPlaceholder(TorchGuard, nn.Parameter):
    """The class of a dedicated param while it is a zero-size placeholder (shape queries answer
    the full shape)."""

    @classmethod
    def _guard_special(cls, name: str, func: Callable, args: tuple, kwargs: dict) -> Any:
        if name == "register_post_accumulate_grad_hook" and args:  # dmuon's own hook stays last
            handle = call_plain(func, args, kwargs)
            keep_dmuon_hook_last(args[0])
            return handle
        if name == "detach" and saving_state_dict():  # dmuon's own state_dict pass
            return call_plain(func, args, kwargs)
        me = args[0] if args else None
        shape = getattr(me, "_dmuon_shape", None)
        if shape is not None:  # the matrix's true shape, as FSDP2's DTensors show theirs
            out = full_shape_query(name, func, args, kwargs, me, shape)
            if out is not PASS_ON:
                return out
        if name == "copy_" and len(args) >= 2 and args[0] is args[1]:
            return args[0]  # load_state_dict copying the placeholder dmuon left in the dict
        return PASS_ON

    @classmethod
    def _guard_error(cls, name: str, func: Callable, args: tuple,
                     kwargs: dict) -> DedicatedParamError:
        p = first_instance(DedicatedPlaceholder, args, kwargs)
        pname = getattr(p, "_dmuon_name", "?")
        owner = getattr(p, "_dedicated_owner_rank", "?")
        if from_dtensor_api():
            return tp_error(pname, owner)
        from dmuon.compat.fsdp_patch import is_installed
        patch = "" if is_installed() else (
            f" dmuon's fully_shard patch is NOT installed on torch {torch.__version__}: if this "
            "came from fully_shard, it is trying to shard the param; call "
            "dmuon.compat.fsdp_patch.install_fully_shard_patch() (import dmuon does) first.")
        return DedicatedParamError(
            f"dmuon: torch's {name!r} was applied to the dedicated param {pname!r}, whose values "
            f"live whole on owner rank {owner} (here it is an empty placeholder between forward "
            f"passes), so it would silently see nothing. Use "
            f"{refusal_hint(name, func, getattr(p, '_dmuon_group', None))}." + patch)


class TPSliceGuard(TorchGuard, nn.Parameter):
    """The class of a TP dedicated param holding its gathered slice outside its hook group's
    forward: ops on its values raise, even a no-op conversion."""

    _guard_no_op_conversions = False

    @classmethod
    def _guard_error(cls, name: str, func: Callable, args: tuple,
                     kwargs: dict) -> DedicatedParamError:
        p = first_instance(TPSliceGuard, args, kwargs)
        return DedicatedParamError(
            f"dmuon: torch's {name!r} was applied to the tensor-parallel dedicated param "
            f"{getattr(p, '_dmuon_name', '?')!r} outside the forward of its hook group: there it "
            "holds only this rank's TP slice as a plain tensor (TP's DTensor exists inside that "
            "forward), so it would silently compute on the slice. Read it inside the forward of "
            "its hook-boundary module (dedicate_params(hook_boundary_predicate=...) can widen "
            "it), or use dmuon.get_model_state_dict for its full value.")


class DedicatedGradMarker(TorchGuard, torch.Tensor):
    """The ``.grad`` of a dedicated param whose gradient dmuon holds (zeroing it zeroes that)."""

    _dmuon_name: str = "?"
    _dmuon_on_zero: Optional[Callable[[], None]] = None
    _dmuon_what: str = "gradient"
    #: also ``detach_`` (``zero_grad``'s path); zeroing is a special case
    _guard_allowed = TorchGuard._guard_allowed | {"detach_"}

    @classmethod
    def _guard_special(cls, name: str, func: Callable, args: tuple, kwargs: dict) -> Any:
        if name not in ("zero_", "_foreach_zero_"):
            return PASS_ON
        flat = [x for a in args for x in (a if isinstance(a, (list, tuple)) else [a])]
        for x in flat:  # zeroing a held gradient zeroes it
            if isinstance(x, DedicatedGradMarker) and x._dmuon_on_zero is not None:
                x._dmuon_on_zero()
        return call_plain(func, args, kwargs)

    @classmethod
    def _guard_error(cls, name: str, func: Callable, args: tuple,
                     kwargs: dict) -> DedicatedParamError:
        m = first_instance(DedicatedGradMarker, args, kwargs)
        what = getattr(m, "_dmuon_what", "gradient")
        if name == "_amp_foreach_non_finite_check_and_unscale_":  # GradScaler.unscale_ / step
            return DedicatedParamError(FP16_LOSS_SCALING)
        return DedicatedParamError(
            f"dmuon: torch's {name!r} was applied to the {what} of the dedicated param "
            f"{getattr(m, '_dmuon_name', '?')!r}, which dmuon holds on its owner rank (here it "
            "is only a marker). Use "
            + ("optimizer.state_dict() (or dmuon.get_optimizer_state_dict) to read it"
               if what != "gradient" else refusal_hint(name)) + ".")


def keep_dmuon_hook_last(p: nn.Parameter) -> bool:
    """Move dmuon's post-accumulate-grad hook of ``p`` last, so that hooks registered after it
    see ``.grad``; True when it was not last. Records the version :func:`check_not_written` reads."""
    hooks, hid = p._post_accumulate_grad_hooks, getattr(p, "_dmuon_grad_hook", None)
    p._dmuon_version = p._version
    if hooks is None or hid not in hooks or next(reversed(hooks)) == hid:
        return False
    # move_to_end leaves torch's (dict) order as it is: insert anew (handles remove by id)
    items = [(k, v) for k, v in hooks.items() if k != hid] + [(hid, hooks[hid])]
    hooks.clear()
    hooks.update(items)
    return True


def check_not_written(name: str, p: nn.Parameter, owner: Any) -> None:
    """Raise :class:`DedicatedParamError` if the gathered param ``p`` was written in place since
    :func:`keep_dmuon_hook_last` looked (e.g. optimizer-in-backward: the write would be lost)."""
    seen = getattr(p, "_dmuon_version", None)
    if seen is not None and p._version != seen:
        raise DedicatedParamError(written_while_gathered(name, owner))
    p._dmuon_version = p._version


def to_placeholder(p: nn.Parameter) -> None:
    """Mark ``p`` (now a zero-size placeholder) so that ops on its values raise."""
    if type(p) in (nn.Parameter, TPSliceGuard):
        p.__class__ = DedicatedPlaceholder


def to_plain(p: nn.Parameter) -> None:
    """Make ``p`` a plain ``nn.Parameter`` again (it is gathered: forward / backward use it)."""
    if type(p) in (DedicatedPlaceholder, TPSliceGuard):
        p.__class__ = nn.Parameter


def to_tp_slice_guard(p: nn.Parameter) -> None:
    """Mark a gathered TP slice outside its group's forward (:class:`TPSliceGuard`)."""
    if type(p) is nn.Parameter:
        p.__class__ = TPSliceGuard


def make_marker(p: nn.Parameter, name: str, on_zero: Optional[Callable[[], None]],
                what: str = "gradient", shape: tuple[int, ...] = (0,)) -> DedicatedGradMarker:
    """A marker of ``p``'s ``what`` (its gradient: ``on_zero()`` runs when it is zeroed;
    ``"momentum"``: the optimizer state a non-owner rank lists but does not hold), of ``shape``:
    zero-size for a placeholder, a gathered param's own (zero strides: one element of memory)."""
    with torch_function_disabled():
        base = torch.zeros((), dtype=p.dtype, device=p.device).expand(shape)
    m = make_tensor_subclass(DedicatedGradMarker, base)
    m._dmuon_name = name
    m._dmuon_on_zero = on_zero
    m._dmuon_what = what
    return m


def guard_module_apply(module: nn.Module, params: list[nn.Parameter]) -> None:
    """Make ``module._apply(fn)`` (``to``, ``cuda``, ``float``, ``half``, ...) try ``fn`` on a
    dedicated placeholder first, so that a conversion that would change one raises before
    ``module``'s other params are touched. Dispatches to ``type(module)._apply`` at call time
    (FSDP2 replaces the module's class with one that overrides ``_apply``)."""
    def _apply(fn, *args, **kwargs):
        # a placeholder, or (meta-device init) a DedicatedUninit, whose to_empty check raises
        probe = next((p for p in params if type(p) is not nn.Parameter), None)
        if probe is not None:
            with torch.no_grad():
                fn(probe)
        return type(module)._apply(module, fn, *args, **kwargs)

    module._apply = _apply
