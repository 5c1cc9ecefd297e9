"""The shape scale of Muon's update: ``u ← s(m, n)·u`` per block of each param's matrix view.

``s`` by :func:`dmuon.functional.lr_scale.lr_scale_factor`'s rule (``"moonlight"``
``0.2·sqrt(max(m, n))``, ``"jordan"`` ``sqrt(max(1, m/n))``, ``"none"`` ``1``). Where all blocks
of a param share one ``s`` the stage leaves it *pending* (a scalar of the update,
:class:`~dmuon.functional.stages.leaves.Leaves`), so the applying stage folds it into its step,
``W ← W − (lr·s)·U`` in one pass; otherwise each block is scaled here.

References:
    J. Liu et al. "Muon is Scalable for LLM Training" (Moonlight), 2025. arXiv:2502.16982.
    K. Jordan et al. "Muon: An optimizer for hidden layers in neural networks", 2024.
"""
from __future__ import annotations

from typing import Any

import torch

from dmuon.functional.lr_scale import lr_scale_factor, lr_scale_factors
from dmuon.functional.stages.base import Transform, stage
from dmuon.functional.stages.leaves import Leaves

__all__ = ["scale_by_shape"]


def scale_by_shape(rule: str = "moonlight", *, batch_dims: Any = None,
                   view: Any = None) -> Transform:
    """``u·s(m, n)`` with :func:`dmuon.functional.lr_scale.lr_scale_factor`'s rule per block of
    each param's matrix view (``view=`` or ``batch_dims=``, as
    :func:`~dmuon.functional.stages.orthogonalize.orthogonalize`)."""
    lr_scale_factor((1, 1), rule)  # validates the rule
    known: dict = {}  # {(shape, view): its blocks' scales}: each shape's decided once

    def update_(leaves: Leaves, state: Any) -> Any:
        vs = leaves.views(view, batch_dims)
        keep = not torch.compiler.is_compiling()  # (traced: a kept one would change the guards)
        for k, (p, vw) in enumerate(zip(leaves.params, vs)):
            shape = tuple(p.shape)
            key = (shape, vw) if keep and type(vw).__hash__ is not None else None
            scales = None if key is None else known.get(key)
            if scales is None:
                scales = lr_scale_factors(shape, rule, vw)
                if key is not None:
                    known[key] = scales
            if len(set(scales)) == 1:
                leaves.scale[k] *= scales[0]
                continue
            leaves.materialize([k])
            leaves.updates[k] = vw.from_blocks(
                [b * s for b, s in zip(vw.to_blocks(leaves.updates[k]), scales)], shape)
            leaves.scratch[k] = True
        return state

    return stage(update_)
