"""What dmuon's tensor guards let through, answer and say (pure): the allow-lists of torch functions
harmless on a tensor whose values are not on this rank, the full-shape answers of a placeholder
standing for a whole matrix, and the fix each refusal names
(:mod:`dmuon.stateful.runtime.guard_base` and :mod:`dmuon.stateful.runtime.guards` act on them)."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

__all__ = ["ATTRIBUTE_CALLS", "LOCAL_METADATA", "ALLOWED", "CONVERSIONS", "SHAPE_QUERIES", "DATA",
           "PASS_ON", "FP16_LOSS_SCALING", "func_name", "first_instance", "full_shape_query",
           "refusal_hint", "written_while_gathered"]

#: attribute access, hooks, repr / hashing, dtype and layout facts: harmless on any guard
ATTRIBUTE_CALLS = frozenset({
    "__get__", "__set__", "__delete__", "__repr__", "__format__", "__hash__", "__dir__",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "_backward_hooks",
    "_has_compatible_shallow_copy_type", "is_floating_point", "is_complex", "element_size",
    "get_device", "is_contiguous", "_is_view", "has_names", "is_shared", "is_pinned",
    "untyped_storage", "_typed_storage", "data_ptr", "storage_offset",
})
#: facts of the local tensor itself (its shape, strides, length, truth value, type string)
LOCAL_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "__len__", "__bool__",
    "is_nonzero", "type", "is_set_to",
})
#: the one allow-list (a guard without the local-tensor facts uses :data:`ATTRIBUTE_CALLS`)
ALLOWED = ATTRIBUTE_CALLS | LOCAL_METADATA
#: conversions that are fine when they change nothing (``model.to(device)`` on the same device)
CONVERSIONS = frozenset({"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "type_as"})
#: the shape queries a guard standing for a whole matrix answers with its full shape
SHAPE_QUERIES = frozenset({"size", "dim", "ndimension", "numel", "nelement"})


class _PassOn:
    def __repr__(self) -> str:
        return "PASS_ON"


#: "not answered here": a guard's special cases (and :func:`full_shape_query`) return it for a
#: call they leave to the shared dispatch
PASS_ON: Any = _PassOn()


#: the name :func:`func_name` gives reading ``t.data``: not an attribute fact like the others
#: ``__get__`` covers (``.grad``, ``.shape``): it is the local tensor itself, a guard's empty
#: placeholder (a write through it is lost, a read sees nothing), so no allow-list holds it
DATA = ".data"


def func_name(func: Any) -> str:
    """The name the allow-lists use for a torch function (``Tensor.size`` -> ``"size"``; the
    getter of ``.data``: :data:`DATA`)."""
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data":
        return DATA
    return name


def first_instance(cls: type, args: tuple, kwargs: dict) -> Any:
    """The first argument of type ``cls``, also inside a list / tuple argument (``None``)."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, cls):
            return a
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, cls):
                    return x
    return None


def full_shape_query(name: str, func: Callable, args: tuple, kwargs: dict, me: Any,
                     shape: tuple[int, ...]) -> Any:
    """The answer to a shape query on ``me`` (``.shape``, ``.ndim``, ``size()``, ``dim()``,
    ``numel()``, ...) for a tensor of full ``shape``; :data:`PASS_ON` for any other call."""
    if name == "__get__":
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        if attr == "shape":
            return torch.Size(shape)
        if attr == "ndim":
            return len(shape)
        return PASS_ON
    if name in SHAPE_QUERIES and args and args[0] is me:
        if name in ("numel", "nelement"):
            return math.prod(shape)
        if name in ("dim", "ndimension"):
            return len(shape)
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return torch.Size(shape) if dim is None else shape[dim]
    return PASS_ON


#: torch.amp.GradScaler on a dmuon model (its unscale_ reaches a gradient marker)
FP16_LOSS_SCALING = (
    "dmuon: torch.amp.GradScaler (fp16 loss scaling) is not supported on a dmuon model: fp16 "
    "loss scaling is not supported; use bf16 (a MixedPrecisionPolicy(param_dtype=torch.bfloat16) "
    "or torch.autocast(dtype=torch.bfloat16): no scaler needed) or fp32. The scaler cannot see "
    "the dedicated matrices' gradients (they live on their owner ranks), so it could neither "
    "unscale them nor detect their overflows. Call optimizer.zero_grad() before going on "
    "(FSDP2's gradients of another dtype may have been unscaled already).")

_NORM_HINT = ("dmuon.clip_grad_norm_(model, max_norm) (torch's clip_grad_norm_ cannot see "
              "gradients held by their owner ranks)")
#: torch.autograd.grad / backward(inputs=...) with respect to a Z3 block's matrix
_DIFF_HINT = ("a target the forward used: with reshard_after_forward=True (Z3) a block's dedicated "
              "matrix is freed after the block's forward (the forward used a gathered copy), so "
              "torch.autograd.grad / backward(inputs=...) cannot take it; with "
              "reshard_after_forward=False (Z2) they give this rank's local gradient (not yet "
              "averaged over ranks, as FSDP2's unsharded params do), or differentiate with "
              "respect to the block's input or output")
#: what dmuon offers instead, by the name of the torch function that was refused
_HINTS = {
    "linalg_vector_norm": _NORM_HINT,
    "_foreach_norm": _NORM_HINT,
    "norm": "dmuon.clip_grad_norm_(model, max_norm)",
    "clamp_": "dmuon.clip_grad_value_(model, clip_value) (torch's clip_grad_value_ may have "
              "clamped FSDP2's gradients before this one: call optimizer.zero_grad() and redo the "
              "step)",
    "_foreach_clamp_min_": "dmuon.clip_grad_value_(model, clip_value)",
    "_foreach_clamp_max_": "dmuon.clip_grad_value_(model, clip_value)",
    "clamp": "dmuon.clip_grad_value_(model, clip_value)",
    "grad": _DIFF_HINT,
    "backward": _DIFF_HINT,
    DATA: "dmuon's calls instead of .data (here it is this rank's empty local tensor): "
          "dmuon.clip_grad_norm_ / dmuon.clip_grad_value_ to clip gradients, a scaled loss to "
          "scale them, dmuon.get_model_state_dict(model) to read weights (copy.deepcopy reads "
          ".data: for a copy, load that state dict into a plain model of the same class), an "
          "init before dmuon.dedicate_params to write them (a loop over model.parameters() may have changed "
          "FSDP2's params or gradients before this one: call optimizer.zero_grad() and redo the "
          "step)",
    "detach": "dmuon.get_model_state_dict(model) to read weights; if this came from a "
              "submodule's state_dict() (torch's Module.state_dict detaches each param, and "
              "dmuon's state-dict hooks sit on the model dedicate_params prepared), call "
              "model.state_dict() or dmuon.get_model_state_dict(model) on that model and keep the "
              "keys under the submodule's prefix; to load a submodule, "
              "dmuon.set_model_state_dict(model, {prefix + key: value, ...}, strict=False)",
}
_DEFAULT_HINT = ("dmuon.Muon(model, ...) to update the model, dmuon.clip_grad_norm_ / "
                 "dmuon.clip_grad_value_ to clip, dmuon.get_model_state_dict(model) to read weights"
                 ", dmuon.set_model_state_dict(model, sd, strict=False) to write them"
                 " (a tool that goes param by param may have changed FSDP2's params before this "
                 "one: call optimizer.zero_grad() and redo the step)")
_MOVE_HINT = ("model.to(device / dtype) before dmuon.dedicate_params (move or cast the whole "
              "model first): afterwards the masters stay where dedicate_params put them")
_INIT_HINT = ("the model's init before dmuon.dedicate_params (its values are copied to the owner "
              "there), or build the model under torch.device('meta') and run its init after "
              "fully_shard and model.to_empty(device=...) (docs/integrations/fsdp2.md: meta-device init)")


def refusal_hint(name: str, func: Any = None, group: Optional[str] = None) -> str:
    """What to use instead of torch function ``func`` (named ``name``) refused on a dedicated
    param (``func=None``: on a gradient marker, where conversions and inits do not arise);
    ``group``: the param's hook group, for a computation (it may come from a forward that did
    not run the hooks that gather it)."""
    if func is not None and name in CONVERSIONS:
        return _MOVE_HINT
    if getattr(func, "__module__", "") == "torch.nn.init":
        return _INIT_HINT
    if name in _HINTS or group is None:
        return _HINTS.get(name, _DEFAULT_HINT)
    module = f"the module {group!r}" if group else "the model"
    return (f"{_DEFAULT_HINT}. If this came from a forward: dmuon gathers this matrix in the "
            f"forward hooks of {module}, and a forward that does not run them sees this "
            "placeholder (a method other than forward, such as one registered with torch's "
            f"register_fsdp_forward_method, or the weight used outside a call of {module}): "
            f"call {module} itself there")


def written_while_gathered(name: str, owner: Any) -> str:
    """A gathered dedicated param written in place (an optimizer step in a post-accumulate-grad
    hook): the write would be lost with the gathered copy."""
    return (f"dmuon: the dedicated param {name!r} was written in place while gathered (e.g. an "
            "optimizer step inside a post-accumulate-grad hook: optimizer-in-backward). Its "
            f"values live whole on owner rank {owner}; the gathered copy written here is "
            "discarded after use, so the write would be lost. Update dedicated params through "
            "dmuon.Muon's step() (hooks may read or scale p.grad, which dmuon then reduces).")
