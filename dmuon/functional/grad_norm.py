"""The arithmetic of global gradient-norm clipping over gradient pieces held by several ranks (pure).

Each rank holds pieces of the model's gradients, each with its *replication* ``k``: how many ranks
hold the same piece (a replicated DTensor's, or a matrix every TP index's grid owns). A p-norm sums
``|g|_p^p / k`` over a rank's pieces; the ranks' sums add up (one SUM all-reduce, the caller's) to
``total^p``, each piece counted once. ``p = inf`` takes maxima instead (a MAX all-reduce). The
gradients are then scaled by ``min(1, max_norm / (total + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does. One foreach norm per (replication, device, dtype) bucket.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import Tensor

__all__ = ["check_norm_type", "check_clip_value", "replication", "norm_buckets", "local_norm_term",
           "total_norm", "scale_buckets_"]

Buckets = dict[tuple[int, torch.device, torch.dtype], list[Tensor]]


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float: a p-norm's ``p > 0`` or ``inf``.

    Raises:
      ValueError: ``-inf`` (torch: the smallest entry), ``0`` (torch: a count), NaN, ``p < 0``."""
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"dmuon.clip_grad_norm_: norm_type must be > 0 (a p-norm) or inf, got "
                         f"{norm_type!r}")
    return p


def check_clip_value(clip_value: float) -> float:
    """``dmuon.clip_grad_value_``'s bound as a float.

    Raises:
      ValueError: not > 0 (NaN included)."""
    v = float(clip_value)
    if not v > 0:
        raise ValueError(f"dmuon.clip_grad_value_: clip_value must be > 0, got {clip_value!r}")
    return v


def replication(t: Any, world_size: int) -> int:
    """How many of the ``world_size`` ranks hold the same local piece of gradient ``t`` (so that
    it is counted once): every rank for a plain tensor; for a DTensor (read by its ``placements``
    and ``device_mesh``) the sizes of its replicated mesh dims, times the copies of its mesh in
    the world (ranks outside the DTensor's mesh hold nothing of it; the mesh covers the world)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return world_size
    mesh = t.device_mesh
    k = 1
    for i, pl in enumerate(placements):
        if pl.is_replicate():
            k *= mesh.size(i)
    return k * (world_size // mesh.size())


def norm_buckets(pieces: Iterable[tuple[Tensor, int]]) -> Buckets:
    """The non-empty ``(gradient, replication)`` pieces, detached, bucketed by (replication,
    device, dtype): a handful of foreach kernels, not one per tensor."""
    buckets: Buckets = {}
    for g, k in pieces:
        if g.numel() > 0:
            buckets.setdefault((k, g.device, g.dtype), []).append(g.detach())
    return buckets


def local_norm_term(buckets: Buckets, p: float, device: torch.device) -> Tensor:
    """This rank's share of ``total^p`` (``p = inf``: its max), fp64 on ``device``."""
    acc = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for (k, _, _), ts in buckets.items():
            norms = torch.stack(torch._foreach_norm(ts, p)).to(torch.float64).to(device)
            if math.isinf(p):
                acc = torch.maximum(acc, norms.max())
            else:
                acc = acc + (norms ** p).sum() / k
    return acc


def total_norm(term: Tensor, p: float) -> Tensor:
    """The total norm from the ranks' summed terms (``p = inf``: the max itself)."""
    return term if math.isinf(p) else term ** (1.0 / p)


def scale_buckets_(buckets: Buckets, max_norm: float, total: Tensor) -> None:
    """Multiply every bucketed gradient in place by ``min(1, max_norm / (total + 1e-6))``."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for (_, dev, dt), ts in buckets.items():
            torch._foreach_mul_(ts, coef.to(device=dev, dtype=dt))
