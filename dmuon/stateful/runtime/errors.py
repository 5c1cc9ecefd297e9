"""Exceptions the stateful layer raises where torch code meets a dedicated param, and tensor
parallelism's (:mod:`dmuon.stateful.modes.tensor_parallel`): the exception, the fix every message
names, and the checks that raise it (here, so the placeholder guards and every wing can raise them
without importing the TP machinery)."""
from __future__ import annotations

import sys
from typing import Any

from dmuon.functional.tp_setup import TP_FIX, tp_after_dedicate, tp_not_supported

__all__ = ["DedicatedParamError", "TensorParallelUnsupported", "TP_FIX", "from_dtensor_api",
           "tp_error", "refuse_tp"]


class DedicatedParamError(RuntimeError):
    """A torch operation touched the values of a dedicated param (or of its gradient) where they
    are not: they live whole on the owner rank, in dmuon's storage."""


_DTENSOR_PKG = "torch.distributed.tensor"


class TensorParallelUnsupported(DedicatedParamError, NotImplementedError):
    """Tensor parallelism met a dedicated param in a way dmuon does not support
    (:mod:`dmuon.stateful.modes.tensor_parallel`)."""


def from_dtensor_api(max_depth: int = 40) -> bool:
    """Whether the current call comes from DTensor's API (``distribute_tensor``,
    ``parallelize_module``'s styles): a frame of a ``torch.distributed.tensor`` module."""
    f = sys._getframe(1)
    for _ in range(max_depth):
        if f is None:
            return False
        if f.f_globals.get("__name__", "").startswith(_DTENSOR_PKG):
            return True
        f = f.f_back
    return False


def tp_error(name: str, owner: object) -> TensorParallelUnsupported:
    """The error for DTensor's API touching dedicated param ``name`` after ``dedicate_params``."""
    return TensorParallelUnsupported(tp_after_dedicate(name, owner))


def refuse_tp(rt: Any, what: str) -> None:
    """Raise :class:`TensorParallelUnsupported` if the model has TP-sliced dedicated params and
    ``what`` does not handle slices yet (every rank holds the same layouts: raises on all)."""
    if getattr(rt, "tp_layouts", None):
        raise TensorParallelUnsupported(tp_not_supported(what, list(rt.tp_layouts)))
