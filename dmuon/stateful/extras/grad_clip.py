"""Global gradient-norm clipping over FSDP2 gradients and the owners' reduced matrix gradients."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.functional.grad_norm import (check_clip_value, check_norm_type, local_norm_term,
                                         norm_buckets, replication, scale_buckets_, total_norm)
from dmuon.stateful.runtime.agree import max_over_ranks
from dmuon.stateful.runtime.state import get_state, local_tensor
from dmuon.compat.wrappers import unwrapping_model


def _grads(rt: Any, model: nn.Module) -> list[tuple[torch.Tensor, int]]:
    """Every trainable param's gradient held here, once, with its replication
    (:mod:`dmuon.functional.grad_norm`): the owners' reduced matrix gradients, then FSDP2's."""
    # with TP, a matrix TP does not shard is owned once in every TP index's grid: count it once
    tp = rt.mesh_groups.tp_size
    out = [(g, tp if tp > 1 and n not in rt.tp_layouts else 1)
           for n, g in rt.reduced_grads().items() if g is not None]
    dedicated = set(rt.params.values())
    world = dist.get_world_size()
    return out + [(local_tensor(p.grad), replication(p.grad, world)) for p in model.parameters()
                  if p not in dedicated and p.grad is not None]


@unwrapping_model
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the global gradient norm of ``model`` in place; collective.

    The norm covers every trainable param's gradient once: FSDP2's sharded gradients (each shard
    counted once, replicas not double-counted) and the dedicated matrices' reduced gradients held by
    their owners (call after ``backward``, before ``step``). All gradients are multiplied by
    ``min(1, max_norm / (total_norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_`` does.

    Args:
      model: a model prepared by ``dedicate_params``.
      max_norm: the maximum norm.  norm_type: 2.0 (or any p > 0) or ``inf`` (a NaN in any
        rank's gradients makes the total NaN on every rank, as in torch).
      error_if_nonfinite: raise ``RuntimeError`` when the total norm is NaN or Inf.

    Returns:
      the total norm (a 0-d tensor, the same on every rank), before clipping.

    Raises:
      ValueError: ``norm_type`` is not > 0 (torch's ``-inf`` and ``0`` orders are not computed).
      RuntimeError: ``error_if_nonfinite`` and the total norm is NaN or Inf (on every rank).
    """
    rt = get_state(model, "dmuon.clip_grad_norm_(model, ...)")
    p = check_norm_type(norm_type)
    buckets = norm_buckets(_grads(rt, model))
    acc = local_norm_term(buckets, p, rt.device)
    if math.isinf(p):
        # NaN-safe (a MAX all-reduce alone may drop a NaN): every rank sees the NaN that one
        # rank's gradients hold
        acc = max_over_ranks(acc, what="clip_grad_norm_ all-reduce", via=rt.mesh_groups)
    else:
        rt.mesh_groups.control_collective("clip_grad_norm_ all-reduce", lambda g: dist.all_reduce(
            acc, op=dist.ReduceOp.SUM, group=g))
    total = total_norm(acc, p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total gradient norm of order {norm_type} is non-finite ({total}); "
                           "check the loss and inputs, or pass error_if_nonfinite=False")
    scale_buckets_(buckets, max_norm, total)
    return total


@unwrapping_model
def clip_grad_value_(model: nn.Module, clip_value: float) -> None:
    """Clamp every gradient of ``model`` to ``[-clip_value, clip_value]`` in place (as
    ``torch.nn.utils.clip_grad_value_``): FSDP2's gradient shards and the owners' reduced matrix
    gradients. Elementwise, so it equals the single-device clamp of the full (averaged) gradient.
    Local: no collective. Call after ``backward``, before ``step``.

    Args:
      model: a model prepared by ``dedicate_params``.  clip_value: the bound (> 0).
    """
    rt = get_state(model, "dmuon.clip_grad_value_(model, ...)")
    v = check_clip_value(clip_value)
    with torch.no_grad():
        for g, _ in _grads(rt, model):
            g.clamp_(-v, v)
