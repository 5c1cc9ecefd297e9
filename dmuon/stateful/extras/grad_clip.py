"""Global gradient-norm clipping over FSDP2 gradients and the owners' reduced matrix gradients."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.stateful.runtime.state import unwrapping_model
from dmuon.stateful.runtime.agree import max_over_ranks
from dmuon.stateful.runtime.state import get_state, local_tensor


def _replication(t: torch.Tensor) -> int:
    """How many ranks hold the same local piece of ``t`` (so that it is counted once)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return dist.get_world_size()
    mesh = t.device_mesh
    k = 1
    for i, pl in enumerate(placements):
        if pl.is_replicate():
            k *= mesh.size(i)
    # ranks outside the DTensor's mesh hold nothing of it; the mesh covers the world here
    return k * (dist.get_world_size() // mesh.size())


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
    p = float(norm_type)
    if not p > 0:  # -inf (torch: the smallest entry), 0 (torch: a count), NaN
        raise ValueError(f"dmuon.clip_grad_norm_: norm_type must be > 0 (a p-norm) or inf, got "
                         f"{norm_type!r}")
    reduced = rt.reduced_grads()
    dedicated = set(rt.params.values())
    pieces: list[tuple[torch.Tensor, int]] = []
    # with TP, a matrix TP does not shard is owned once in every TP index's grid: count it once
    tp = rt.mesh_groups.tp_size
    for n, g in reduced.items():
        if g is not None:
            pieces.append((g, tp if tp > 1 and n not in rt.tp_layouts else 1))
    for prm in model.parameters():
        if prm in dedicated or prm.grad is None:
            continue
        g = prm.grad
        pieces.append((local_tensor(g), _replication(g)))
    # one foreach norm per (replication, device, dtype) bucket: a handful of kernels, not one
    # per tensor (a model of many small matrices spent milliseconds here)
    buckets: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g, k in pieces:
        if g.numel() > 0:
            buckets.setdefault((k, g.device, g.dtype), []).append(g.detach())
    acc = torch.zeros((), dtype=torch.float64, device=rt.device)
    with torch.no_grad():
        for (k, _, _), ts in buckets.items():
            norms = torch.stack(torch._foreach_norm(ts, p)).to(torch.float64).to(rt.device)
            if math.isinf(p):
                acc = torch.maximum(acc, norms.max())
            else:
                acc = acc + (norms ** p).sum() / k
    if math.isinf(p):
        # NaN-safe (a MAX all-reduce alone may drop a NaN): every rank sees the NaN that one
        # rank's gradients hold
        total = max_over_ranks(acc, what="clip_grad_norm_ all-reduce", via=rt.mesh_groups)
    else:
        rt.mesh_groups.control_collective(
            "clip_grad_norm_ all-reduce",
            lambda g: dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=g))
        total = acc ** (1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total gradient norm of order {norm_type} is non-finite ({total}); "
                           "check the loss and inputs, or pass error_if_nonfinite=False")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for (_, dev, dt), ts in buckets.items():
            torch._foreach_mul_(ts, coef.to(device=dev, dtype=dt))
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
    v = float(clip_value)
    if not v > 0:
        raise ValueError(f"dmuon.clip_grad_value_: clip_value must be > 0, got {clip_value!r}")
    dedicated = set(rt.params.values())
    with torch.no_grad():
        for g in rt.reduced_grads().values():
            if g is not None:
                g.clamp_(-v, v)
        for prm in model.parameters():
            if prm not in dedicated and prm.grad is not None:
                local_tensor(prm.grad).clamp_(-v, v)
