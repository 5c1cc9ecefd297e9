"""Adam's direction: bias-corrected first moment over root second moment (pure, in place on lists).

With ``t = step + 1``, per leaf (the arithmetic of ``torch.optim``'s ``_single_tensor_adam``, op
for op)::

    m ← lerp(m, g, 1 − β1)               (= β1·m + (1 − β1)·g)
    v ← β2·v + (1 − β2)·g²
    D = sqrt(v) / sqrt(1 − β2^t) + ε
    u = m / (1 − β1^t) / D

The stage leaves ``u`` as the numerator ``m`` with the pending divisor ``1 − β1^t`` and
denominator ``D`` (:class:`~dmuon.functional.stages.leaves.Leaves`), so the applying stage
(:mod:`dmuon.functional.stages.decoupled`) steps ``W ← W − (lr / (1 − β1^t))·m / D`` in one
``addcdiv``, as torch does; list ops run as ``leaves.ops`` says (per tensor, or ``torch._foreach_*``).

References:
    D. P. Kingma, J. Ba. "Adam: A Method for Stochastic Optimization". ICLR 2015. arXiv:1412.6980.
    PyTorch ``torch.optim.Adam`` / ``AdamW`` (the op order).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from dmuon.functional.stages.base import Transform, stage
from dmuon.functional.stages.hparams import concrete_count, new_step, next_step, register_state
from dmuon.functional.stages.leaves import Leaves
from dmuon.functional.tree import PyTree, flatten, zeros_like_tree

__all__ = ["AdamState", "scale_by_adam", "adam_scalars"]


@register_state
class AdamState(NamedTuple):
    """State of :func:`scale_by_adam`: ``step`` (one global count, a 0-d tensor) and the moments
    ``mu``, ``nu``."""

    step: Any
    mu: PyTree
    nu: PyTree
    per_param = ("mu", "nu")


def adam_scalars(betas: tuple[float, float], step: Any) -> tuple[Any, Any]:
    """``(1 − β1^t, sqrt(1 − β2^t))`` for the step ``t``: Python floats for an int ``t`` (torch's
    arithmetic), 0-d fp64 tensors for a tensor ``t`` (traced or batched: torch's capturable
    path's formula)."""
    beta1, beta2 = betas
    if isinstance(step, int):
        return 1 - beta1**step, (1 - beta2**step) ** 0.5
    t = step.to(torch.float64)
    return 1 - torch.pow(beta1, t), (1 - torch.pow(beta2, t)).sqrt()


def scale_by_adam(betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> Transform:
    """Adam's direction with ``t = step + 1`` (see the module docstring).

    Args:
        betas: ``(β1, β2)`` in ``[0, 1)``.
        eps: ``ε``, added to the bias-corrected root second moment.
    """
    beta1, beta2 = (float(b) for b in betas)
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"betas must be in [0, 1), got {betas!r}")
    eps = float(eps)

    def init(params: PyTree) -> AdamState:
        leaves, treedef = flatten(params)
        return AdamState(new_step(), zeros_like_tree(leaves, treedef),
                         zeros_like_tree(leaves, treedef))

    def update_(leaves: Leaves, state: Any) -> Any:
        t_next = next_step(state.step)
        if not len(leaves):
            return state._replace(step=t_next)
        known = concrete_count(state.step)
        bc1, bc2_sqrt = adam_scalars((beta1, beta2), t_next if known is None else known + 1)
        leaves.materialize()
        ops, ms, vs, gs = leaves.ops, state.mu, state.nu, leaves.updates
        ops.lerp_(ms, gs, 1 - beta1)
        ops.mul_(vs, beta2)
        ops.addcmul_(vs, gs, gs, value=1 - beta2)
        den = ops.sqrt(vs)
        ops.div_(den, bc2_sqrt)
        ops.add_(den, eps)
        n = len(leaves)
        leaves.updates, leaves.scratch, leaves.denom = list(ms), [False] * n, list(den)
        leaves.divisor = [d * bc1 for d in leaves.divisor]
        return state._replace(step=t_next)

    return stage(update_, init)
