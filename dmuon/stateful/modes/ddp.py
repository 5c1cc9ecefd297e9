"""DDP mode (``dedicate_params(..., data_parallel="ddp")``, then ``DistributedDataParallel``):
``R = world`` replicas of one shard, DDP skips the dedicated matrices, their owners step them and
publish the new values. A mode mismatch (FSDP-mode dedication under DDP, DDP mode under
``fully_shard``, composable ``replicate``) raises with the fix.

Design notes: docs/design/modes.md, "dmuon.stateful.modes.ddp".
"""
from __future__ import annotations

import logging
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

from dmuon.compat.torch_api import DDP_IGNORE_ATTR, composable_replicate_applied, in_backward
from dmuon.functional.ddp_sync import (COPY_REFUSED, DDP_IN_FSDP_MODE, FORWARD_OUTSIDE_DDP,
                                       follow_ddp_sync, replicate_refused, sharded_in_ddp_mode)
from dmuon.compat.wrappers import unwrap_model

logger = logging.getLogger(__name__)

__all__ = ["install_ddp_mode", "guard_fsdp_mode", "check_backend"]


class _NotForDDP(list):
    """DDP's ignore list of an FSDP-mode model: iterating it (DDP's constructor) or pickling it
    (``copy.deepcopy`` of the model) raises with the fix."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(COPY_REFUSED)

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError(DDP_IN_FSDP_MODE)


def guard_fsdp_mode(model: nn.Module) -> None:
    """FSDP mode: make a later ``DistributedDataParallel(model)`` raise (unless the model already
    names params for DDP to ignore)."""
    if not hasattr(model, DDP_IGNORE_ATTR):
        object.__setattr__(model, DDP_IGNORE_ATTR, _NotForDDP())


def check_backend(model: nn.Module, st: Any, what: str) -> None:
    """Raise if the data parallelism applied to ``model`` does not fit its dedication mode (the
    same verdict on every rank).

    Raises:
      RuntimeError: DDP mode and a ``fully_shard`` that shards params; composable ``replicate``.
    """
    if composable_replicate_applied(model):
        raise RuntimeError(replicate_refused(what))
    if getattr(st, "data_parallel", "fsdp") != "ddp":
        return
    sharded = [n for n, p in model.named_parameters()
               if any(pl.is_shard() for pl in getattr(p, "placements", None) or ())]
    if sharded:
        raise RuntimeError(sharded_in_ddp_mode(what, sharded))


def _active_ddp(model: nn.Module) -> Optional[Any]:
    """The ``DistributedDataParallel`` whose forward is running ``model``, if any."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None or unwrap_model(ddp) is not model:
        return None
    return ddp


def install_ddp_mode(model: nn.Module, st: Any) -> None:
    """The model side of DDP mode: DDP's ignore list, and a root pre-forward hook that follows the
    wrapping DDP's ``no_sync`` (and refuses a training forward outside it)."""
    names = list(st.params)
    prev = getattr(model, DDP_IGNORE_ATTR, None)
    prev = [] if prev is None or isinstance(prev, _NotForDDP) else list(prev)
    object.__setattr__(model, DDP_IGNORE_ATTR, prev + [n for n in names if n not in prev])
    paused = {"by_ddp": False}

    def follow_ddp_no_sync(module: nn.Module, args: Any) -> None:
        if in_backward():
            return
        st.lazy_init()
        if paused.get("checked") is None:
            check_backend(model, st, "dmuon (first forward)")
            paused["checked"] = True
        ddp = _active_ddp(model)
        if ddp is None and torch.is_grad_enabled() and st.R > 1:
            raise RuntimeError(FORWARD_OUTSIDE_DDP)
        want = True if ddp is None else bool(ddp.require_backward_grad_sync)
        st.require_grad_sync, paused["by_ddp"] = follow_ddp_sync(want, st.require_grad_sync,
                                                                 paused["by_ddp"])

    st.hook_handles.append(model.register_forward_pre_hook(  # dmuon.release removes it
        torch.compiler.disable(follow_ddp_no_sync, recursive=True)))
