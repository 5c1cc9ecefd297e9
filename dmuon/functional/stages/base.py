"""The transform protocol (optax's, plus an in-place form) and the helper that builds a stage.

A :class:`Transform` is a pair of pure functions::

    state = t.init(params)
    updates, state = t.update(updates, state, params)

plus, for the stages of :mod:`dmuon.functional.stages`, their arithmetic in place,
``state = t.update_(leaves, state)`` over a :class:`~dmuon.functional.stages.leaves.Leaves`
(opened state; see that module). ``update`` is derived from ``update_`` (:func:`stage`), so a
stage's formula exists once; ``dmuon.functional.muon.update`` and ``adamw.update`` run the
``update_`` of the same stages on donated buffers.

References:
    M. Hessel et al. "Optax: composable gradient transformation and optimisation, in JAX", 2020
    (the ``init`` / ``update`` protocol).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from dmuon.functional.stages.hparams import (ScheduleState, is_schedule, new_step, next_step,
                                             register_state, value_at)
from dmuon.functional.stages.leaves import Leaves, derive_update
from dmuon.functional.tree import PyTree

__all__ = ["Transform", "EmptyState", "stage", "hyper_stage", "NEEDS"]

#: What a stage may need of each matrix beyond its own update (``Transform.needs``), and whether
#: an owner holding a slice of the matrix (tensor parallelism) can provide it:
#:
#: * ``"params"`` — the current weights ``W`` (every owner holds its matrices' masters);
#: * ``"row_sums"`` / ``"matrix_sums"`` — sums over each row / over each whole matrix of the
#:   view's blocks, taken through :meth:`Leaves.sum_partials` (exact on a slice: the owners of a
#:   sliced matrix add their partial sums over the TP group);
#: * ``"whole_rows"`` / ``"whole_matrix"`` — elementwise access to whole rows / to the whole
#:   matrix (e.g. a spectral norm by power iteration): an owner of a column slice lacks whole
#:   rows, an owner of any slice lacks the whole matrix; ``dmuon.Muon`` raises at construction.
NEEDS = ("params", "row_sums", "matrix_sums", "whole_rows", "whole_matrix")


class Transform(NamedTuple):
    """A gradient transformation: ``init(params) -> state``;
    ``update(updates, state, params) -> (updates, state)``; optionally ``update_(leaves, state)
    -> state``, the same arithmetic in place (``None``: a stage written in the optax form only;
    dmuon runs it out of place where it runs chains in place,
    :func:`~dmuon.functional.stages.leaves.in_place_form`),
    ``needs``: the quantities of :data:`NEEDS` its arithmetic uses (a chain: its stages'), and
    ``momentum_dtype``: the dtype its momentum stage keeps the buffers in between updates
    (optax's ``mu_dtype``; ``None``: the param's; a chain: its first momentum stage's), and
    ``applies``: its in-place form writes the step into the weights (``decoupled_apply``,
    ``hyperball_apply``; a chain: any of its stages), so a stage without an in-place form cannot
    follow it there (:func:`~dmuon.functional.transforms.chain` refuses such a chain's in-place
    form before any stage runs)."""

    init: Callable[[PyTree], Any]
    update: Callable[[PyTree, Any, PyTree], tuple[PyTree, Any]]
    update_: Optional[Callable[[Leaves, Any], Any]] = None
    needs: tuple = ()
    momentum_dtype: Any = None
    applies: bool = False


@register_state
class EmptyState(NamedTuple):
    """State of a stateless stage."""


def _empty(params: PyTree) -> EmptyState:
    return EmptyState()


def stage(update_: Callable[[Leaves, Any], Any], init: Callable[[PyTree], Any] = _empty,
          update: Optional[Callable[..., tuple[PyTree, Any]]] = None,
          needs: tuple = (), applies: bool = False) -> Transform:
    """A :class:`Transform` from its in-place arithmetic ``update_``; its ``update`` (run under
    ``torch.no_grad()``: params may be ``nn.Parameter`` s) is derived from ``update_`` unless
    given. ``needs``: see :data:`NEEDS`; ``applies``: ``update_`` writes the step into the
    weights (see :class:`Transform`)."""
    bad = [n for n in needs if n not in NEEDS]
    if bad:
        raise ValueError(f"stage needs {bad}: not quantities dmuon knows; one of {NEEDS}")
    pure = derive_update(update_) if update is None else update
    return Transform(init, torch.no_grad()(pure), update_, tuple(needs), applies=applies)


def hyper_stage(fn: Callable[..., Any], init: Optional[Callable[[Any], Any]] = None,
                needs: tuple = (), applies: bool = False, **hparams: Any):
    """A stage whose in-place arithmetic ``fn(leaves, state, **values)`` takes hyper-parameter
    values: with only floats / tensors it is ``stage(lambda l, s: fn(l, s, **hparams), init)``;
    with any schedule its state is :class:`ScheduleState` ``(count, inner)`` and each update
    evaluates the schedules at ``count`` first."""
    init = init or (lambda params: EmptyState())
    scheduled = {k for k, v in hparams.items() if is_schedule(v)}
    if not scheduled:
        return stage(lambda leaves, state: fn(leaves, state, **hparams), init, needs=needs,
                     applies=applies)

    def init_s(params: Any) -> ScheduleState:
        return ScheduleState(new_step(), init(params))

    def update_(leaves: Any, state: ScheduleState) -> ScheduleState:
        values = {k: value_at(v, state.count) for k, v in hparams.items()}
        return ScheduleState(next_step(state.count), fn(leaves, state.inner, **values))

    return stage(update_, init_s, needs=needs, applies=applies)
