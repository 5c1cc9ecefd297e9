"""Torch's own tools on a dmuon model: right, or a clear error naming the dmuon call.

Between uses a dedicated param is a zero-size placeholder (its values live whole on its owner), and
its gradient lives in dmuon's buckets, not in ``.grad``. Tools written for local tensors would
silently see nothing: ``torch.nn.utils.clip_grad_norm_`` would clip without the matrices (and return
a smaller norm), ``torch.optim.AdamW(model.parameters())`` would never update them,
``parameters_to_vector`` would leave them out. Two guards make every such use loud:

* :class:`DedicatedPlaceholder` — the class of a dedicated param while it is a placeholder (dmuon
  switches ``param.__class__`` between it and ``nn.Parameter`` when it frees / gathers the param, so
  forward and backward run on plain parameters at no cost). Metadata, attribute access and hook
  registration work; any op that reads or writes its values raises :class:`DedicatedParamError`,
  naming the param, its owner rank and the dmuon call to use.
* :func:`guard_module_apply` — ``model.to(dtype)`` / ``model.cuda()`` / ``model.half()`` after
  ``dedicate_params`` would convert FSDP2's params one by one and then fail at the first
  placeholder, leaving a half-converted model; the root module's ``_apply`` first tries the
  conversion on one placeholder, so it raises before anything changes (a no-op conversion, such
  as HF Trainer's ``model.to(its device)``, passes).
* :class:`DedicatedGradMarker` — after a synced backward, each dedicated param whose gradient dmuon
  holds gets a zero-size marker as ``.grad``. Math on it raises (``clip_grad_norm_`` ->
  ``dmuon.clip_grad_norm_``, ``clip_grad_value_`` -> ``dmuon.clip_grad_value_``, an optimizer's
  update -> ``dmuon.Muon``). Zeroing it (``model.zero_grad(set_to_none=False)``) zeroes dmuon's
  gradient for that param and dropping it (``model.zero_grad()``, ``p.grad = None``) drops it,
  exactly as torch would a local one; dmuon notices a dropped marker before the next reduce, clip
  or step. After a step, the owners' stepped matrices carry *consumed* markers
  (:mod:`dmuon.stateful.runtime.ledger`).

Allowed on both: attribute get / set (``.grad``, ``.data``, ``.requires_grad``, ``.shape``, ...),
metadata (``size()``, ``dim()``, ``numel()``, ``dtype``, ...), ``repr``, hashing, hook registration.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from dmuon.stateful.runtime.errors import DedicatedParamError

__all__ = ["DedicatedParamError", "saving_state_dict", "DedicatedPlaceholder", "DedicatedGradMarker", "to_placeholder",
           "to_plain", "make_marker", "guard_module_apply"]

#: functions that only read metadata or attributes, or register hooks: fine on a placeholder
_ALLOWED = frozenset({
    "__get__", "__set__", "__delete__", "__repr__", "__format__", "__hash__", "__bool__",
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point",
    "is_complex", "is_contiguous", "stride", "storage_offset", "get_device", "type",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "_is_view",
    "is_shared", "is_pinned", "has_names", "_backward_hooks", "__dir__",
    "_has_compatible_shallow_copy_type", "is_set_to", "data_ptr", "untyped_storage",
    "_typed_storage", "__len__", "is_nonzero",
})
#: what dmuon offers instead, by the name of the torch function that was refused
_HINTS = {
    "linalg_vector_norm": "dmuon.clip_grad_norm_(model, max_norm) (torch's clip_grad_norm_ "
                          "cannot see gradients held by their owner ranks)",
    "_foreach_norm": "dmuon.clip_grad_norm_(model, max_norm) (torch's clip_grad_norm_ cannot see "
                     "gradients held by their owner ranks)",
    "norm": "dmuon.clip_grad_norm_(model, max_norm)",
    "clamp_": "dmuon.clip_grad_value_(model, clip_value) (torch's clip_grad_value_ may have "
              "clamped FSDP2's gradients before this one: call optimizer.zero_grad() and redo the "
              "step)",
    "_foreach_clamp_min_": "dmuon.clip_grad_value_(model, clip_value)",
    "_foreach_clamp_max_": "dmuon.clip_grad_value_(model, clip_value)",
    "clamp": "dmuon.clip_grad_value_(model, clip_value)",
}
#: conversions that are fine when they change nothing (``model.to(device)`` on the same device,
#: as HF Trainer does); one that would move or cast a placeholder raises
_CONVERSIONS = frozenset({"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "type_as"})
_DEFAULT_HINT = ("dmuon.Muon(model, ...) to update the model, dmuon.clip_grad_norm_ / "
                 "dmuon.clip_grad_value_ to clip, dmuon.get_model_state_dict(model) to read weights"
                 " (a tool that goes param by param may have changed FSDP2's params before this "
                 "one: call optimizer.zero_grad() and redo the step)")


_SAVING = threading.local()


def saving_state_dict(delta: int = 0) -> bool:
    """Enter (``+1``) / leave (``-1``) dmuon's own ``model.state_dict()`` pass, during which a
    placeholder may be ``detach``-ed into the dict (dmuon's post-hook replaces it); returns whether
    such a pass is running on this thread."""
    depth = max(0, getattr(_SAVING, "depth", 0) + delta)
    _SAVING.depth = depth
    return depth > 0


def _name(func: Any) -> str:
    return getattr(func, "__name__", None) or str(func)


def _first(types_of: type, args: tuple, kwargs: dict) -> Any:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, types_of):
            return a
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, types_of):
                    return x
    return None


def _call_plain(func: Callable, args: tuple, kwargs: dict) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _no_op_conversion(name: str, func: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``(True, result)`` when ``func`` is a dtype / device conversion that leaves the (empty)
    tensor's dtype and device as they are (``.to("cpu:0")`` of a CPU tensor returns an equal new
    one)."""
    if name not in _CONVERSIONS or not args or not isinstance(args[0], torch.Tensor):
        return False, None
    out = _call_plain(func, args, kwargs)
    src = args[0]
    same = (isinstance(out, torch.Tensor) and out.dtype == src.dtype and out.device == src.device
            and out.numel() == src.numel())
    return same, out


_MOVE_HINT = ("move or cast the model (model.to(device / dtype)) before dmuon.dedicate_params: "
              "afterwards the masters stay where dedicate_params put them")


_INIT_HINT = ("the model's init before dmuon.dedicate_params (its values are copied to the owner "
              "there), or build the model under torch.device('meta') and run its init after "
              "fully_shard and model.to_empty(device=...) (README: meta-device init)")


def _hint(name: str, func: Any) -> str:
    if name in _CONVERSIONS:
        return _MOVE_HINT
    if getattr(func, "__module__", "") == "torch.nn.init":
        return _INIT_HINT
    return _HINTS.get(name, _DEFAULT_HINT)


class DedicatedPlaceholder(nn.Parameter):
    """The class of a dedicated param while it is a zero-size placeholder (see module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name in _ALLOWED or (name == "detach" and saving_state_dict()):
            return _call_plain(func, args, kwargs)
        if name == "copy_" and len(args) >= 2 and args[0] is args[1]:
            return args[0]  # load_state_dict copying the placeholder dmuon left in the dict
        same, out = _no_op_conversion(name, func, args, kwargs)
        if same:
            return out
        p = _first(DedicatedPlaceholder, args, kwargs)
        pname = getattr(p, "_dmuon_name", "?")
        owner = getattr(p, "_dedicated_owner_rank", "?")
        from dmuon.stateful.modes.tp_errors import from_dtensor_api, tp_error
        if from_dtensor_api():
            raise tp_error(pname, owner)
        from dmuon.compat.fsdp_patch import is_installed
        patch = "" if is_installed() else (
            f" dmuon's fully_shard patch is NOT installed on torch {torch.__version__}: if this "
            "came from fully_shard, it is trying to shard the param; call "
            "dmuon.compat.fsdp_patch.install_fully_shard_patch() (import dmuon does) first.")
        raise DedicatedParamError(
            f"dmuon: torch's {name!r} was applied to the dedicated param {pname!r}, whose values "
            f"live whole on owner rank {owner} (here it is an empty placeholder between forward "
            f"passes), so it would silently see nothing. Use "
            f"{_hint(name, func)}." + patch)


class TPSliceGuard(nn.Parameter):
    """The class of a tensor-parallel dedicated param that holds its gathered TP slice outside
    the forward of its hook group (Z2, the root group): ops on its values raise, since TP code
    there would silently compute on the local slice instead of TP's DTensor
    (:mod:`dmuon.stateful.modes.tensor_parallel`)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name in _ALLOWED:
            return _call_plain(func, args, kwargs)
        p = _first(TPSliceGuard, args, kwargs)
        raise DedicatedParamError(
            f"dmuon: torch's {name!r} was applied to the tensor-parallel dedicated param "
            f"{getattr(p, '_dmuon_name', '?')!r} outside the forward of its hook group: there it "
            "holds only this rank's TP slice as a plain tensor (TP's DTensor exists inside that "
            "forward), so it would silently compute on the slice. Read it inside the forward of "
            "its hook-boundary module (dedicate_params(hook_boundary_predicate=...) can widen "
            "it), or use dmuon.get_model_state_dict for its full value.")


class DedicatedGradMarker(torch.Tensor):
    """The ``.grad`` of a dedicated param whose gradient dmuon holds (see module docstring)."""

    _dmuon_name: str = "?"
    _dmuon_on_zero: Optional[Callable[[], None]] = None
    _dmuon_what: str = "gradient"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        m = _first(DedicatedGradMarker, args, kwargs)
        if name in ("zero_", "_foreach_zero_", "detach_", "requires_grad_") or name in _ALLOWED:
            if name in ("zero_", "_foreach_zero_"):  # zeroing a held gradient zeroes it
                flat = [x for a in args for x in (a if isinstance(a, (list, tuple)) else [a])]
                for x in flat:
                    if isinstance(x, DedicatedGradMarker) and x._dmuon_on_zero is not None:
                        x._dmuon_on_zero()
            return _call_plain(func, args, kwargs)
        same, out = _no_op_conversion(name, func, args, kwargs)
        if same:
            return out
        what = getattr(m, "_dmuon_what", "gradient")
        raise DedicatedParamError(
            f"dmuon: torch's {name!r} was applied to the {what} of the dedicated param "
            f"{getattr(m, '_dmuon_name', '?')!r}, which dmuon holds on its owner rank (here it "
            "is only a marker). Use "
            + ("optimizer.state_dict() (or dmuon.get_optimizer_state_dict) to read it"
               if what != "gradient" else _HINTS.get(name, _DEFAULT_HINT)) + ".")


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
                what: str = "gradient") -> DedicatedGradMarker:
    """A zero-size marker of placeholder ``p``'s ``what`` (its gradient: ``on_zero()`` runs when it is
    zeroed; ``"momentum"``: the optimizer state a non-owner rank lists but does not hold)."""
    with torch._C.DisableTorchFunctionSubclass():
        base = torch.empty(0, dtype=p.dtype, device=p.device)
    m = torch.Tensor._make_subclass(DedicatedGradMarker, base)
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
