"""The optimizer stages: the math of Muon and AdamW, each formula written once (pure).

Each stage is a :class:`~dmuon.functional.stages.base.Transform` whose arithmetic is an in-place
operation over the active leaves of a step (:mod:`.leaves`); its optax form is derived from it.
:mod:`dmuon.functional.transforms` composes them (``chain``, ``partition``, ``apply_updates``);
:func:`dmuon.functional.muon.update` and :func:`dmuon.functional.adamw.update` run the same
stages on donated buffers, with fused kernels (Triton, ``torch._fused_adamw_``) as alternative
implementations of a stage, handed in by the caller.

* :mod:`.momentum` — ``b ← μ·b + g``; the Nesterov input ``g + μ·b``.
* :mod:`.orthogonalize` — ``U = NS(x)`` per matrix of each param's view; swappable NS.
* :mod:`.shape_scale` — ``s(m, n)·U``.
* :mod:`.adam` — ``m̂ / (sqrt(v̂) + ε)``.
* :mod:`.decoupled` — ``W ← W·(1 − lr·λ) − lr·u`` (and its optax form ``−lr·(u + λ·W)``).
* :mod:`.row_norm` — NorMuon's per-row second-moment normalization after NS.
* :mod:`.hyperball` — the hyperball step ``W ← R·normalize(W − lr·R·û)`` (MuonH).
* :mod:`.hparams` — hyper-parameters as floats, 0-d tensors or schedules; step counts.
"""
from dmuon.functional.stages.adam import AdamState, scale_by_adam
from dmuon.functional.stages.base import NEEDS, EmptyState, Transform, stage
from dmuon.functional.stages.decoupled import (add_decayed_weights, decoupled_apply,
                                               decoupled_apply_, foreach_apply_,
                                               scale_by_learning_rate)
from dmuon.functional.stages.leaves import FOREACH, PER_TENSOR, Leaves, run_inplace
from dmuon.functional.stages.momentum import MomentumState, foreach_momentum_, trace_momentum
from dmuon.functional.stages.orthogonalize import Orthogonalizer, orthogonalize
from dmuon.functional.stages.shape_scale import scale_by_shape
from dmuon.functional.stages.hparams import Hyper, ScheduleState, register_state
from dmuon.functional.stages.hyperball import HyperballState, hyperball_apply
from dmuon.functional.stages.row_norm import RowNormState, scale_by_row_norm

__all__ = [
    "Transform", "EmptyState", "MomentumState", "AdamState", "Orthogonalizer", "Leaves",
    "FOREACH", "PER_TENSOR", "stage", "run_inplace", "trace_momentum", "foreach_momentum_",
    "orthogonalize", "scale_by_shape", "scale_by_adam", "decoupled_apply", "decoupled_apply_",
    "foreach_apply_", "add_decayed_weights", "scale_by_learning_rate", "NEEDS", "Hyper",
    "ScheduleState", "register_state", "RowNormState", "scale_by_row_norm", "HyperballState",
    "hyperball_apply",
]
