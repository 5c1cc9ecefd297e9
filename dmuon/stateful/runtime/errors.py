"""Exceptions the stateful layer raises where torch code meets a dedicated param, and tensor
parallelism's (:mod:`dmuon.stateful.modes.tensor_parallel`): the exception, the fix every message
names, and the checks that raise it (here, so the placeholder guards and every wing can raise them
without importing the TP machinery)."""
from __future__ import annotations

import sys
from typing import Any

__all__ = ["DedicatedParamError", "TensorParallelUnsupported", "TP_FIX", "from_dtensor_api",
           "tp_error", "refuse_tp"]


class DedicatedParamError(RuntimeError):
    """A torch operation touched the values of a dedicated param (or of its gradient) where they
    are not: they live whole on the owner rank, in dmuon's storage."""


_DTENSOR_PKG = "torch.distributed.tensor"

#: what to do instead (named by every TP error)
TP_FIX = ("apply tensor parallelism first (parallelize_module with ColwiseParallel / "
          "RowwiseParallel on a 1-D TP mesh), then dmuon.dedicate_params(model, mesh['dp'], "
          "predicate), then fully_shard(..., mesh=mesh['dp']); or train with tp = 1")


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
    return TensorParallelUnsupported(
        f"dmuon: tensor parallelism (DTensor distribute_tensor / parallelize_module) was applied "
        f"to the dedicated param {name!r} (owner rank {owner}) after dedicate_params. {TP_FIX}.")


def refuse_tp(rt: Any, what: str) -> None:
    """Raise :class:`TensorParallelUnsupported` if the model has TP-sliced dedicated params and
    ``what`` does not handle slices yet (every rank holds the same layouts: raises on all)."""
    if getattr(rt, "tp_layouts", None):
        raise TensorParallelUnsupported(
            f"dmuon: {what} does not support tensor-parallel dedicated matrices yet (this model "
            f"has {len(rt.tp_layouts)}, e.g. {sorted(rt.tp_layouts)[:3]}). Nothing was changed. "
            "Supported with TP: forward, backward, dmuon.Muon.step, dmuon.clip_grad_norm_, and "
            "checkpoints as full tensors: dmuon.get_model_state_dict / set_model_state_dict and "
            "dmuon.get_optimizer_state_dict / set_optimizer_state_dict.")
