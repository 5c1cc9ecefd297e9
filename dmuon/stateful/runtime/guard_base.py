"""One dispatch for dmuon's ``__torch_function__`` guards (:class:`TorchGuard`), on their one
allow-list (:data:`ALLOWED`, with the other pure rules in :mod:`dmuon.functional.guard_rules`).
Order: the subclass's special cases, the allow-list, a conversion that changes nothing, else
:class:`~dmuon.stateful.runtime.errors.DedicatedParamError`.

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.guard_base".
"""
from __future__ import annotations

import functools
from typing import Any, Callable, ClassVar

import torch

from dmuon.compat.torch_api import torch_function_disabled
from dmuon.functional.guard_rules import (ALLOWED, ATTRIBUTE_CALLS, CONVERSIONS, DATA,
                                          LOCAL_METADATA, PASS_ON, full_shape_query, func_name)
from dmuon.stateful.runtime.errors import DedicatedParamError

__all__ = ["TorchGuard", "PASS_ON", "ALLOWED", "ATTRIBUTE_CALLS", "LOCAL_METADATA", "DATA",
           "call_plain", "plain_access", "full_shape_query", "no_op_conversion",
           "DedicatedParamError"]


def call_plain(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` as on plain tensors (no subclass's ``__torch_function__``)."""
    with torch_function_disabled():
        return func(*args, **kwargs)


def plain_access(method: Callable) -> Callable:
    """``method`` with the guards off: for dmuon's own reads and writes of its placeholders' and
    markers' ``.grad``, ``.data``, ``.dtype`` and ``.device``, which the guards would pass on
    unchanged after a Python dispatch each (about 5 us on CPU; 2.5 k of them per step for 154
    matrices before: ``benchmarks/host_overhead.py``). Only for code that reads no shape of a
    placeholder (a guard answers those with the matrix's) and runs no user code."""
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch_function_disabled():
            return method(*args, **kwargs)
    return run


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
