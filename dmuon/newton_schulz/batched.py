"""Newton–Schulz over many matrix stacks, batched per shape (pure): :func:`orthogonalize_batched`,
and :class:`BatchedNS`, the same as an orthogonalizer object that times its calls on request."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from dmuon.newton_schulz.config import NSConfig
from dmuon.newton_schulz.iteration import ns_plan, ns_run
from dmuon.newton_schulz.timing import NSTimer

__all__ = ["orthogonalize_batched", "BatchedNS"]


def orthogonalize_batched(matrices: Sequence[Tensor], config: NSConfig = NSConfig(),
                          plans: Optional[dict] = None) -> list[Tensor]:
    """Newton–Schulz on many ``(B_i, m_i, n_i)`` tensors, one batched call per (m, n, dtype, device).

    Tensors whose matrices have the same shape, dtype and device are concatenated along the batch dim,
    orthogonalized by a single :func:`~dmuon.newton_schulz.iteration.newton_schulz` call, and split
    back. Each matrix is treated independently, so the result equals orthogonalizing one at a time.

    Args:
        matrices: 3-D tensors ``(B_i, m_i, n_i)``; never modified.
        config: what Newton–Schulz computes (:class:`dmuon.newton_schulz.NSConfig`).
        plans: ``{(m, n, device): NSPlan}`` of ``config``, kept by a caller that runs it again
            (:class:`BatchedNS`): each shape's decisions are made once (``None``: at this call).

    Returns:
        A list aligned with ``matrices``; entry ``i`` has the shape and dtype of ``matrices[i]``.

    References:
        K. Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024.
    """
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, x in enumerate(matrices):
        if x.ndim != 3:
            raise ValueError(f"orthogonalize_batched expects (B, m, n) tensors, got shape {tuple(x.shape)}")
        groups[(x.shape[1], x.shape[2], x.dtype, x.device)].append(i)
    out: list[Tensor | None] = [None] * len(matrices)
    for (m, n, _, _), idx in groups.items():
        if m * n == 0:
            for i in idx:
                out[i] = torch.zeros_like(matrices[i])
            continue
        stacked = matrices[idx[0]] if len(idx) == 1 else torch.cat([matrices[i] for i in idx], dim=0)
        if stacked.shape[0] == 0:
            for i in idx:
                out[i] = torch.zeros_like(matrices[i])
            continue
        key = (m, n, stacked.device)
        plan = None if plans is None else plans.get(key)
        if plan is None:
            plan = ns_plan(m, n, stacked.device, **config.iteration_kwargs())
            if plans is not None:
                plans[key] = plan
        u = ns_run(stacked, plan)
        for i, piece in zip(idx, torch.split(u, [matrices[i].shape[0] for i in idx], dim=0)):
            out[i] = piece
    return out  # type: ignore[return-value]


class BatchedNS:
    """:func:`orthogonalize_batched` with a fixed ``config``, as the orthogonalizer
    ``xs -> us`` of :func:`dmuon.functional.muon.update` (``orthogonalize=``) and of the
    ``orthogonalize`` stage; never writes its inputs.

    Args:
        config: what Newton–Schulz computes.
        timer: where to record each call's span (:class:`~dmuon.newton_schulz.timing.NSTimer`;
            ``None``: untimed).
    """

    mode = "functional"

    def __init__(self, config: NSConfig = NSConfig(), timer: Optional[NSTimer] = None):
        self.config = config
        self.timer = timer
        self._plans: tuple[NSConfig, dict] = (config, {})  # each shape's NSPlan of config

    def __call__(self, xs: Sequence[Tensor]) -> list[Tensor]:
        if self._plans[0] is not self.config:
            self._plans = (self.config, {})
        # (traced by torch.compile: decided in the graph's tracing, not kept, as a kept one
        # would change what the graph's guards saw and compile it again)
        plans = None if torch.compiler.is_compiling() else self._plans[1]
        if self.timer is None or not xs:
            return orthogonalize_batched(xs, self.config, plans)
        out = self.timer.run(xs[0].device, orthogonalize_batched, xs, self.config, plans)
        self.timer.mode = self.mode
        return out
