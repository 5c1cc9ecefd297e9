"""NorMuon's neuron-wise normalization: each row of the orthogonalized update divided by the root
of its own second moment, then the whole matrix rescaled to its norm before (pure, in place).

For each matrix ``O`` (``m x n``, a block of the param's view) of the update after Newton–Schulz,
with ``ρ_i = Σ_j O_ij²`` (the row sums)::

    v ← β2·v + (1 − β2)·ρ / n            (v: one value per row, zero at the start; no bias
                                           correction)
    s_i = 1 / (sqrt(v_i) + ε)
    O ← O ⊙ s · ‖O‖_F / (‖O ⊙ s‖_F + ε)   (rows scaled by s, the Frobenius norm kept)

with ``‖O‖_F² = Σ_i ρ_i`` and ``‖O ⊙ s‖_F² = Σ_i ρ_i·s_i²`` (the same quantities in exact arithmetic as
the norms of the matrices; summed from the row sums here, so one pass over ``O`` gives every
statistic). Defaults ``β2 = 0.95``, ``ε = 1e-10`` (the paper's reference implementation). The
shape scale and the learning rate follow (:func:`~dmuon.functional.stages.shape_scale.scale_by_shape`,
:func:`~dmuon.functional.stages.decoupled.decoupled_apply`): with ``lr_scale="moonlight"`` the
update's Frobenius norm is ``0.2·lr·sqrt(max(m, n))·‖O‖_F`` — the paper's
``η̂ = 0.2·η·sqrt(mn) / ‖Ô‖_F`` where ``O`` is orthogonal (``‖O‖_F = sqrt(min(m, n))``); the
reference implementation uses ``lr_scale="jordan"``.

"Rows" are the rows of each matrix of the view: output neurons of an ``nn.Linear`` weight
``(out, in)``; one matrix per expert or head with ``Batch(1)`` / ``Heads``; GPT-2's ``Conv1D`` is
``Transposed``, so its rows are its output columns. modded-nanogpt's variant normalizes along the
shorter side instead (rows of a tall matrix, columns of a wide one); this stage is the paper's.

State: :class:`RowNormState` ``second_moment``, per param a 1-D tensor of the rows of each block of
its view, in block order (``Σ B·m`` values; its layout ``"rows"``: one value per row). Statistics
run in the param's dtype (the master's, on an owner).

Distributed: the sums go through :meth:`~dmuon.functional.stages.leaves.Leaves.sum_partials`, so
an owner of a tensor-parallel slice gets them exact: a row slice holds whole rows (the row sums are
local; the Frobenius sums add over the TP group), a column slice holds part of every row (the row
sums add over the TP group).

References:
    Z. Li, L. Liu, C. Liang, W. Chen, T. Zhao. "NorMuon: Making Muon more efficient and scalable",
    2025. arXiv:2510.05491 (Algorithm 1; reference implementation ``normuon.py``).
    Microsoft dion's ``NorMuon``; modded-nanogpt's optimizer track (the short-axis variant).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from dmuon.functional.stages.base import Transform, hyper_stage
from dmuon.functional.stages.hparams import Hyper, check_hyper, register_state
from dmuon.functional.stages.leaves import Leaves, init_views
from dmuon.functional.tree import PyTree, flatten

__all__ = ["RowNormState", "scale_by_row_norm", "view_rows"]


@register_state
class RowNormState(NamedTuple):
    """State of :func:`scale_by_row_norm`: per param, the second moment of each row of each block
    of its view (1-D, block order)."""

    second_moment: PyTree
    per_param = ("second_moment",)
    layouts = {"second_moment": "rows"}


def view_rows(view: Any, p: Tensor) -> int:
    """The rows of the blocks ``view`` makes of ``p`` (this holder's part of each matrix)."""
    meta = torch.empty(tuple(p.shape), device="meta", dtype=p.dtype)
    return sum(b.shape[0] * b.shape[1] for b in view.to_blocks(meta))


def scale_by_row_norm(beta2: Hyper = 0.95, eps: float = 1e-10, *, view: Any = None,
                      batch_dims: Any = None) -> Transform:
    """NorMuon's normalization of the orthogonalized update (see the module docstring).

    Args:
        beta2: ``β2`` in ``[0, 1)``, the decay of the per-row second moment: a float, a 0-d
            tensor or a function of the step.
        eps: ``ε >= 0``.
        view, batch_dims: the matrix views, as :func:`~dmuon.functional.stages.orthogonalize.
            orthogonalize`'s (default: the caller's default views, else ``Batch(0)``).
    """
    beta2 = check_hyper("beta2", beta2, hi=1.0, where="scale_by_row_norm")
    eps = float(check_hyper("eps", float(eps), where="scale_by_row_norm"))

    def init(params: PyTree) -> RowNormState:
        leaves, treedef = flatten(params)
        vs = init_views(view, batch_dims, params)
        return RowNormState(treedef.unflatten(
            [torch.zeros(view_rows(vw, p), dtype=p.dtype, device=p.device)
             for vw, p in zip(vs, leaves)]))

    def update_(leaves: Leaves, state: Any, beta2: Any) -> Any:
        leaves.materialize()
        vs = leaves.views(view, batch_dims)
        blocks, rows, cols = [], [], []
        for k, u in enumerate(leaves.updates):
            v = state.second_moment[k]
            blk = [b.to(dtype=v.dtype) for b in vs[k].to_blocks(u)]
            blocks.append(blk)
            rows.append(torch.cat([(b * b).sum(-1).reshape(-1) for b in blk]) if blk
                        else v.new_zeros(0))
            # n of each row: the full matrix's (a column slice holds a part of each row)
            ns = [n for (_, _, n) in vs[k].blocks(tuple(leaves.params[k].shape))]
            cols.append(torch.cat([torch.full((b.shape[0] * b.shape[1],), float(n),
                                              dtype=v.dtype, device=v.device)
                                   for b, n in zip(blk, ns)]) if blk else v.new_zeros(0))
        rows = leaves.sum_partials(rows, (-1,))
        totals, scales = [], []
        for k, rho in enumerate(rows):
            v = state.second_moment[k]
            w = (1 - beta2) if not isinstance(beta2, Tensor) else (1 - beta2).to(v.dtype)
            v.lerp_(rho / cols[k], w)
            s = 1 / (v.sqrt() + eps)
            scales.append(s)
            per_block, at = [], 0
            for b in blocks[k]:
                nb, m = b.shape[0], b.shape[1]
                r = rho[at:at + nb * m].view(nb, m)
                sb = s[at:at + nb * m].view(nb, m)
                per_block.append(torch.stack([r.sum(-1), (r * sb * sb).sum(-1)]))
                at += nb * m
            totals.append(torch.cat(per_block, dim=1) if per_block else v.new_zeros(2, 0))
        totals = leaves.sum_partials(totals, (-2,))
        for k, blk in enumerate(blocks):
            norm, norm_s = totals[k][0].sqrt(), totals[k][1].sqrt()
            ratio = norm / (norm_s + eps)
            out, at, j = [], 0, 0
            for b in blk:
                nb, m = b.shape[0], b.shape[1]
                f = scales[k][at:at + nb * m].view(nb, m) * ratio[j:j + nb].view(nb, 1)
                out.append(b * f.unsqueeze(-1))
                at, j = at + nb * m, j + nb
            leaves.updates[k] = vs[k].from_blocks(out, tuple(leaves.params[k].shape))
            leaves.scratch[k] = True
        return state

    return hyper_stage(update_, init, needs=("row_sums", "matrix_sums"), beta2=beta2)
