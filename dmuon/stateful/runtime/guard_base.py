"""One dispatch for dmuon's ``__torch_function__`` guards (:class:`TorchGuard`), and their one
allow-list (:data:`ALLOWED`). Order: the subclass's special cases, the allow-list, a conversion
that changes nothing, else :class:`~dmuon.stateful.runtime.errors.DedicatedParamError`.

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.guard_base".
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch

from dmuon.compat.torch_api import torch_function_disabled
from dmuon.stateful.runtime.errors import DedicatedParamError

__all__ = ["TorchGuard", "PASS_ON", "ALLOWED", "ATTRIBUTE_CALLS", "LOCAL_METADATA", "CONVERSIONS",
           "SHAPE_QUERIES", "func_name", "first_instance", "call_plain", "full_shape_query",
           "no_op_conversion", "DedicatedParamError"]

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


class _PassOn:
    def __repr__(self) -> str:
        return "PASS_ON"


#: returned by :meth:`TorchGuard._guard_special` for a call it leaves to the shared dispatch
PASS_ON: Any = _PassOn()


def func_name(func: Any) -> str:
    """The name the allow-lists use for a torch function (``Tensor.size`` -> ``"size"``)."""
    return getattr(func, "__name__", None) or str(func)


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


def call_plain(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` as on plain tensors (no subclass's ``__torch_function__``)."""
    with torch_function_disabled():
        return func(*args, **kwargs)


#: the shape queries a guard standing for a whole matrix answers with its full shape
SHAPE_QUERIES = frozenset({"size", "dim", "ndimension", "numel", "nelement"})


def full_shape_query(name: str, func: Callable, args: tuple, kwargs: dict, me: Any,
                     shape: tuple[int, ...]) -> Any:
    """The answer to a shape query on ``me`` (``.shape``, ``.ndim``, ``size()``, ``dim()``,
    ``numel()``, ...) for a tensor of full ``shape``; :data:`PASS_ON` for any other call."""
    import math
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


def no_op_conversion(name: str, func: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``(True, result)`` when ``func`` is a dtype / device conversion that leaves the tensor's
    dtype, device and size as they are (``.to("cpu:0")`` of a CPU tensor returns an equal new
    one); ``(False, ...)`` otherwise."""
    if name not in CONVERSIONS or not args or not isinstance(args[0], torch.Tensor):
        return False, None
    out = call_plain(func, args, kwargs)
    src = args[0]
    same = (isinstance(out, torch.Tensor) and out.dtype == src.dtype and out.device == src.device
            and call_plain(torch.Tensor.numel, (out,), {}) ==
            call_plain(torch.Tensor.numel, (src,), {}))  # the local sizes (a guard may report more)
    return same, out


class TorchGuard:
    """The shared ``__torch_function__`` of dmuon's guards; a mixin before ``nn.Parameter`` /
    ``torch.Tensor``. A subclass sets its allow-list, whether no-op conversions pass, its special
    cases and its error."""

    __slots__ = ()

    _guard_allowed: ClassVar[frozenset[str]] = ALLOWED
    _guard_no_op_conversions: ClassVar[bool] = True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func_name(func)
        out = cls._guard_special(name, func, args, kwargs)
        if out is not PASS_ON:
            return out
        if name in cls._guard_allowed:
            return call_plain(func, args, kwargs)
        if cls._guard_no_op_conversions:
            same, out = no_op_conversion(name, func, args, kwargs)
            if same:
                return out
        raise cls._guard_error(name, func, args, kwargs)

    @classmethod
    def _guard_special(cls, name: str, func: Callable, args: tuple, kwargs: dict) -> Any:
        """A call this guard answers itself (its result), or :data:`PASS_ON`."""
        return PASS_ON

    @classmethod
    def _guard_error(cls, name: str, func: Callable, args: tuple,
                     kwargs: dict) -> DedicatedParamError:
        """The error for a refused call (the subclass names the param and the fix)."""
        return DedicatedParamError(f"dmuon: torch's {name!r} was applied to a dedicated tensor "
                                   f"({cls.__name__}) whose values are not on this rank.")
