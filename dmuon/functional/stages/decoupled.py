"""Decoupled weight decay and the learning rate: the last stage of Muon and AdamW.

The step, for an update ``u = (c/d)·N[/D]`` (pending scalars and denominator of
:class:`~dmuon.functional.stages.leaves.Leaves`)::

    W ← W·(1 − lr·λ) + α·N[/D],      α = −lr·c/d

applied in place by :func:`decoupled_apply_` (``torch.optim``'s rounding: the decay multiply
first, then one fused ``add`` / ``addcdiv``). The optax form of the same stage returns the additive
update ``−lr·(u + λ·W)`` (:func:`add_decayed_weights` then :func:`scale_by_learning_rate`) for
:func:`~dmuon.functional.transforms.apply_updates`: the same math, rounded per op, so
``W + (−lr)·(u + λ·W)`` differs from the applied step by a few ulps of ``|W| + lr·|u|`` per step.
No additive ``u`` can reproduce the one-pass rounding in general (``W + (W' − W)`` is ``W'`` only
when ``W'`` is within a factor 2 of ``W``), and stages chained after Muon need additive updates;
so the two forms keep their own roundings (``tests/test_transforms.py`` bounds the difference).

References:
    I. Loshchilov, F. Hutter. "Decoupled Weight Decay Regularization". ICLR 2019.
    arXiv:1711.05101.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from dmuon.functional.stages.base import EmptyState, Transform, hyper_stage
from dmuon.functional.stages.hparams import Hyper, check_hyper, is_one, traced
from dmuon.functional.stages.leaves import FOREACH, PER_TENSOR, Leaves
from dmuon.functional.tree import PyTree

__all__ = ["ApplyImpl", "decoupled_apply_", "foreach_apply_", "decoupled_apply",
           "add_decayed_weights", "scale_by_learning_rate"]

#: ``impl(ps, us, decay, alphas)``: the contract of :func:`foreach_apply_`.
ApplyImpl = Callable[[list[Tensor], list[Tensor], float, Sequence[float]], None]


def decoupled_apply_(ps: list[Tensor], us: list[Tensor], decay: float, alphas: Sequence[float],
                     dens: Optional[Sequence[Optional[Tensor]]] = None, ops: Any = FOREACH) -> None:
    """The applying stage's arithmetic, in place: ``p ← p·decay`` (skipped when ``decay == 1``),
    then ``p ← p + alpha_k·u_k`` (``p ← p + alpha_k·u_k / dens[k]`` where a denominator is
    given); one list op per distinct ``(alpha, denominator or not)``.

    Args:
        ps: params (updated in place).
        us: update numerators, each of its param's shape (any float dtype).
        decay: ``1 − lr·λ``.
        alphas: per param, ``−lr·c/d``.
        dens: per param, a denominator tensor or ``None``.
        ops: :data:`~dmuon.functional.stages.leaves.FOREACH` or ``PER_TENSOR``.
    """
    if not ps:
        return
    # Traced, a float may be a symbol (torch.compile's dynamic float, for a value that changes
    # between calls): it is never a dict key, a foreach scalar nor an ``alpha=`` / ``value=``
    # argument, each of which fixes its value (a recompile per value); each leaf is its own group
    # and the scalar a per-tensor factor there (the same arithmetic per element; the compiler
    # fuses the ops).
    symbolic = traced()
    if symbolic or isinstance(decay, Tensor) or any(isinstance(a, Tensor) for a in alphas):
        ops = PER_TENSOR  # tensor hyper-parameters (traced, batched): per-tensor ops
    if not is_one(decay):
        ops.mul_(ps, decay)
    groups: dict[tuple[Any, bool], list[int]] = {}
    for k, a in enumerate(alphas):
        groups.setdefault((k if symbolic else a, dens is not None and dens[k] is not None),
                          []).append(k)
    for (_, divided), ks in groups.items():
        alpha = alphas[ks[0]]
        if symbolic or isinstance(alpha, Tensor):  # a tensor lr (batched), or traced: a factor
            us_a = ops.mul([us[k] for k in ks], alpha)
            if divided:
                us_a = [u / dens[k] for u, k in zip(us_a, ks)]
            ops.add_([ps[k] for k in ks], us_a)
        elif divided:
            ops.addcdiv_([ps[k] for k in ks], [us[k] for k in ks], [dens[k] for k in ks],
                         value=alpha)
        else:
            ops.add_([ps[k] for k in ks], [us[k] for k in ks], alpha=alpha)


def foreach_apply_(ps: list[Tensor], us: list[Tensor], decay: float,
                   alphas: Sequence[float]) -> None:
    """``p ← p·decay + alpha_k·u_k`` with ``torch._foreach_*`` ops (:func:`decoupled_apply_`
    without denominators): the default implementation of :func:`decoupled_apply`.

    Args:
        ps: params (updated in place).
        us: the updates (e.g. Newton–Schulz results), each of its param's shape (any float dtype).
        decay: ``1 − lr·wd``.
        alphas: per param, ``−lr·s``.
    """
    decoupled_apply_(ps, us, decay, alphas)


def decoupled_apply(lr: Hyper, weight_decay: Hyper = 0.0, *,
                    impl: Optional[ApplyImpl] = None) -> Transform:
    """``W ← W·(1 − lr·λ) − lr·u``: applied in place by ``update_``; ``update`` (optax form)
    returns ``−lr·(u + λ·W)`` (see the module docstring for the rounding of each).

    Args:
        lr: learning rate ``≥ 0``; weight_decay: ``λ ≥ 0``. Each a float, a 0-d tensor or a
            function of the step (:mod:`~dmuon.functional.stages.hparams`).
        impl: the implementation of updates without a denominator (default
            :func:`foreach_apply_` with the leaves' ops); another one (a fused kernel) must keep
            that contract (it is used with float hyper-parameters only).
    """
    lr = check_hyper("lr", lr, where="decoupled_apply")
    wd = check_hyper("weight_decay", weight_decay, where="decoupled_apply")

    def update_(leaves: Leaves, state: Any, lr: Any, wd: Any) -> Any:
        decay = 1.0 if _is_zero(wd) else (1 - lr * wd)
        alphas = [(-lr * c) / d for c, d in zip(leaves.scale, leaves.divisor)]
        ps = leaves.written_params()
        fused = impl if impl is not None else getattr(leaves.elementwise, "apply", None)
        if fused not in (None, foreach_apply_) and all(d is None for d in leaves.denom) \
                and not any(isinstance(a, Tensor) for a in [decay] + alphas):
            fused(ps, leaves.updates, decay, alphas)
        else:
            decoupled_apply_(ps, leaves.updates, decay, alphas, leaves.denom, leaves.ops)
        leaves.params, leaves.applied = ps, True
        return state

    applied = hyper_stage(update_, applies=True, lr=lr, wd=wd)
    optax = chain_of(add_decayed_weights(wd), scale_by_learning_rate(lr))

    def update(updates: PyTree, state: Any, params: PyTree) -> tuple[PyTree, Any]:
        # the optax form: the same two stages' arithmetic (their counts are this stage's)
        return optax(updates, state, params)

    return Transform(applied.init, torch.no_grad()(update), applied.update_, applies=True)


def chain_of(decay_stage: Transform, lr_stage: Transform):
    """The optax form of :func:`decoupled_apply`: ``−lr·(u + λ·W)``, with the state of the
    applying stage (``EmptyState``, or its :class:`ScheduleState` count for both schedules)."""
    from dmuon.functional.stages.hparams import ScheduleState, next_step

    def run(updates: PyTree, state: Any, params: PyTree) -> tuple[PyTree, Any]:
        if isinstance(state, ScheduleState):
            s1 = _same_count(decay_stage, state)
            s2 = _same_count(lr_stage, state)
            updates, _ = decay_stage.update(updates, s1, params)
            out, _ = lr_stage.update(updates, s2, params)
            return out, ScheduleState(next_step(state.count), state.inner)
        updates, _ = decay_stage.update(updates, EmptyState(), params)
        return lr_stage.update(updates, EmptyState(), params)[0], state
    return run


def _same_count(t: Transform, state: Any) -> Any:
    """``t``'s state at the count of ``state`` (``t`` stateless, or scheduled)."""
    from dmuon.functional.stages.hparams import ScheduleState
    own = t.init({})
    return ScheduleState(state.count, own.inner) if isinstance(own, ScheduleState) else own


def _is_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == 0


def add_decayed_weights(weight_decay: Hyper) -> Transform:
    """``u + λ·W`` (after :func:`scale_by_learning_rate`: decoupled decay ``W ← W − lr·λ·W``);
    ``λ``: a float, a 0-d tensor or a function of the step."""
    wd = check_hyper("weight_decay", weight_decay, where="add_decayed_weights")

    def update_(leaves: Leaves, state: Any, wd: Any) -> Any:
        if not _is_zero(wd):
            leaves.materialize()
            leaves.updates = [u + wd * p for u, p in zip(leaves.updates, leaves.params)]
            leaves.scratch = [True] * len(leaves)
        return state

    return hyper_stage(update_, wd=wd)


def scale_by_learning_rate(lr: Hyper) -> Transform:
    """``−lr·u`` (descent); ``lr``: a float, a 0-d tensor or a function of the step (its state
    then counts the updates)."""
    lr = check_hyper("lr", lr, where="scale_by_learning_rate")

    def update_(leaves: Leaves, state: Any, lr: Any) -> Any:
        leaves.materialize()
        leaves.updates = [-lr * u for u in leaves.updates]
        leaves.scratch = [True] * len(leaves)
        return state

    return hyper_stage(update_, lr=lr)
