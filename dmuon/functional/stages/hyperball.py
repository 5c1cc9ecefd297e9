"""The hyperball step (Muon-Hyperball, MuonH): fixed weight norm and fixed update norm instead of
weight decay — an applying stage (pure, in place on the written params).

For each matrix ``W`` (a block of the param's view) with update ``u`` and radius ``R``::

    û = u / max(‖u‖_F, ε)
    W ← R · normalize(W − lr·R·û),      normalize(x) = x / max(‖x‖_F, ε)

so every step moves ``W`` by a fixed fraction ``lr`` of its norm (before the projection) and keeps
``‖W‖_F = R``. ``R`` is the matrix's Frobenius norm at its first step (the paper's ``‖W₀‖_F``; a
matrix that is zero then stays zero), or the fixed ``radius`` given (every matrix is projected to
it at its first step). ``ε = 1e-8``. The norms of ``W − lr·R·û`` come from the closed form
``‖W‖² − 2 s⟨W, u⟩ + s²‖u‖²`` with ``s = lr·R/max(‖u‖, ε)`` (one pass over ``W`` and ``u``
for all three sums, as dion's MuonH computes it), then ``W ← (R/‖·‖)·W − (R/‖·‖)·s·u`` in one
update: in exact arithmetic the two-pass form above. The shape scale and weight decay do not
apply (``û`` removes every scale of ``u``; the projection replaces decay).

State: :class:`HyperballState` ``radius``, per param one value per matrix of its view (1-D, zero
until the first step sets it; layout ``"matrices"``).

Distributed: the three sums go through
:meth:`~dmuon.functional.stages.leaves.Leaves.sum_partials` (a tensor-parallel slice's owners add
theirs over the TP group), so the step is exact on a slice.

References:
    K. Wen, X. Dang, K. Lyu, T. Ma, P. Liang. "Fantastic Pretraining Optimizers and Where to Find
    Them 2.1: Hyperball Optimization", 2025 (``W_{t+1} = Norm(W_t − η·Norm(u_t)·‖W₀‖)·‖W₀‖``).
    NVIDIA NeMo Emerging-Optimizers 0.5, ``MuonHyperball`` (its pre / post weight-update hooks:
    the update scaled to ``R/‖u‖``, the weight projected back to ``R``; ``hyperball_eps=1e-8``,
    ``hyperball_radius``). Microsoft dion's ``MuonH`` (the closed form of the projected norm).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from dmuon.functional.stages.base import Transform, hyper_stage
from dmuon.functional.stages.hparams import Hyper, check_hyper, register_state
from dmuon.functional.stages.leaves import Leaves, init_views
from dmuon.functional.tree import PyTree, flatten

__all__ = ["HyperballState", "hyperball_apply"]


@register_state
class HyperballState(NamedTuple):
    """State of :func:`hyperball_apply`: per param, the radius of each matrix of its view (1-D;
    zero until the first step)."""

    radius: PyTree
    per_param = ("radius",)
    layouts = {"radius": "matrices"}


def hyperball_apply(lr: Hyper, radius: Optional[float] = None, eps: float = 1e-8, *,
                    view: Any = None, batch_dims: Any = None) -> Transform:
    """The hyperball step, applied in place (see the module docstring).

    Args:
        lr: the relative step ``lr >= 0``: a float, a 0-d tensor or a function of the step.
        radius: a fixed ``R > 0`` for every matrix, or ``None`` (each matrix keeps the norm it has
            at its first step).
        eps: ``ε > 0`` of both normalizations.
        view, batch_dims: the matrix views (default: the caller's default views, else
            ``Batch(0)``).
    """
    lr = check_hyper("lr", lr, where="hyperball_apply")
    if radius is not None and not (isinstance(radius, (int, float)) and radius > 0):
        raise ValueError(f"hyperball_apply: radius must be None or a float > 0, got {radius!r}")
    eps = float(eps)
    if not eps > 0:
        raise ValueError(f"hyperball_apply: eps must be > 0, got {eps!r}")

    def init(params: PyTree) -> HyperballState:
        leaves, treedef = flatten(params)
        vs = init_views(view, batch_dims, params)
        return HyperballState(treedef.unflatten(
            [torch.zeros(sum(b[0] for b in vw.blocks(tuple(p.shape))), dtype=p.dtype,
                         device=p.device) for vw, p in zip(vs, leaves)]))

    def update_(leaves: Leaves, state: Any, lr: Any) -> Any:
        leaves.materialize()
        vs = leaves.views(view, batch_dims)
        ps = leaves.written_params()
        ws, us, sums = [], [], []
        for k, (p, u) in enumerate(zip(ps, leaves.updates)):
            r = state.radius[k]
            wb = [b.to(dtype=r.dtype) for b in vs[k].to_blocks(p)]
            ub = [b.to(dtype=r.dtype) for b in vs[k].to_blocks(u)]
            ws.append(wb)
            us.append(ub)
            sums.append(torch.cat([torch.stack([(b * b).sum((-2, -1)), (w * w).sum((-2, -1)),
                                                (w * b).sum((-2, -1))])
                                   for w, b in zip(wb, ub)], dim=1) if wb else r.new_zeros(3, 0))
        sums = leaves.sum_partials(sums, (-2, -1))
        for k, (p, wb, ub) in enumerate(zip(ps, ws, us)):
            uu, ww, wu = sums[k]
            r = state.radius[k]
            if radius is None:  # the norm at the first step (0: not set yet)
                r.copy_(torch.where(r > 0, r, ww.sqrt()))
            else:
                r.fill_(float(radius))
            s = lr * r / uu.sqrt().clamp_min(eps)
            cc = (ww - 2 * s * wu + s * s * uu).clamp_min(eps * eps)
            a = r / cc.sqrt()
            b = a * s
            out, j = [], 0
            for w, u in zip(wb, ub):
                n = w.shape[0]
                out.append(w * a[j:j + n].view(n, 1, 1) - u * b[j:j + n].view(n, 1, 1))
                j += n
            p.copy_(vs[k].from_blocks(out, tuple(p.shape)))
        leaves.params, leaves.applied = ps, True
        return state

    return hyper_stage(update_, init, needs=("params", "matrix_sums"), applies=True, lr=lr)
