"""Composable optimizer transforms over pytrees, in optax's manner.

A :class:`Transform` is a pair of pure functions::

    state = t.init(params)
    updates, state = t.update(updates, state, params)

``updates`` enter as the gradients and leave as the quantity to add to the params
(:func:`apply_updates`: ``W ← W + u``). States are NamedTuples (plain pytrees any tree tool can
save). Inputs are never modified. A leaf whose update is ``None`` (a param without a gradient)
passes through every stage as ``None`` and keeps its state, as in :func:`dmuon.functional.muon.update`.

The stages are the math (:mod:`dmuon.functional.stages`, re-exported here; conventions named):

* :func:`trace_momentum` — ``b ← μ·b + g`` (sum form); output ``g + μ·b`` (Nesterov) or ``b``.
* :func:`orthogonalize` — ``U = NS(x)`` of every matrix of each param's view (``view`` /
  ``batch_dims``), batched per shape; the orthogonalizer is swappable.
* :func:`scale_by_shape` — ``u·s(m, n)`` by the ``lr_scale`` rule.
* :func:`scale_by_adam` — Adam's bias-corrected ``m̂ / (sqrt(v̂) + ε)`` (torch's arithmetic).
* :func:`decoupled_apply` — ``W ← W·(1 − lr·λ) − lr·u``; as an optax stage, ``−lr·(u + λ·W)``.
* :func:`add_decayed_weights` — ``u + λ·W``; :func:`scale_by_learning_rate` — ``−lr·u``.
* :func:`scale_by_row_norm` — NorMuon's per-row normalization; :func:`hyperball_apply` — the
  hyperball step (MuonH).
* :func:`chain` — stages in sequence; :func:`partition` — a transform per route label.

Hyper-parameters (``lr``, ``weight_decay``, ``momentum``, and the variants' ``beta2``) are
floats, 0-d tensors or functions of the step (:mod:`dmuon.functional.stages.hparams`: a stage
with a schedule counts its updates in a :class:`ScheduleState`); every state type loads with
``torch.load(weights_only=True)``. Muon's variants (NorMuon, Muon-Hyperball) are chains of these
stages and two more (:mod:`dmuon.functional.variants`).

Each stage also has its arithmetic in place, ``update_`` (its ``update`` is derived from it);
:func:`dmuon.functional.muon.update` and :func:`dmuon.functional.adamw.update` run
:func:`dmuon.functional.muon.transform` / :func:`dmuon.functional.adamw.transform`, these very chains,
in place on donated buffers (:func:`update_params` for any chain of stages; a stage written in the
optax form only, ``Transform(init, update)``, runs out of place within it:
:func:`~dmuon.functional.stages.leaves.derive_update_`). The optax form
``apply_updates(W, transform.update(...))`` equals that bitwise up to the last stage, whose
additive form ``W + (−lr)·(u + λ·W)`` rounds differently from the applied
``W·(1 − lr·λ) − lr·u`` (a few ulps per step; :mod:`dmuon.functional.stages.decoupled` says why
both are kept; ``tests/test_transforms.py``).

References:
    M. Hessel et al. "Optax: composable gradient transformation and optimisation, in JAX", 2020
    (the ``init`` / ``update`` protocol, ``chain``, ``partition``).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import optree
import torch

from dmuon.functional.stages import (AdamState, EmptyState, HyperballState, MomentumState,
                                     Orthogonalizer, RowNormState, Transform,
                                     add_decayed_weights, decoupled_apply, hyperball_apply,
                                     orthogonalize, scale_by_adam, scale_by_learning_rate,
                                     scale_by_row_norm, scale_by_shape, trace_momentum)
from dmuon.functional.stages.hparams import ScheduleState, register_state
from dmuon.functional.stages.leaves import (AFTER_APPLYING, Leaves, in_place_form, in_place_refusal,
                                            refused_update_, run_inplace)
from dmuon.functional.tree import PyTree, flatten, flatten_like, leaf_paths

__all__ = [
    "Transform", "EmptyState", "MomentumState", "AdamState", "ChainState", "PartitionState",
    "ScheduleState", "RowNormState", "HyperballState", "scale_by_row_norm", "hyperball_apply",
    "Orthogonalizer", "apply_updates", "update_params", "chain", "partition", "trace_momentum",
    "orthogonalize", "scale_by_shape", "scale_by_adam", "decoupled_apply", "add_decayed_weights",
    "scale_by_learning_rate",
]


@register_state
class ChainState(NamedTuple):
    """State of :func:`chain`: one state per stage, in order."""

    states: tuple


@register_state
class PartitionState(NamedTuple):
    """State of :func:`partition`: ``{label: inner state}`` (each over its label's params)."""

    inner: dict


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``W ← W + u`` per leaf (``None`` updates leave the param itself); new tensors, in the
    params' dtypes."""
    with torch.no_grad():
        return optree.tree_map(lambda p, u: p if u is None else p + u.to(dtype=p.dtype),
                               params, updates, none_is_leaf=True)


def update_params(transform: Transform, grads: PyTree, state: Any, params: PyTree, *,
                  donate: bool = False) -> tuple[PyTree, Any]:
    """One step of a chain of stages, run in place: ``(new_params, new_state)``.

    The same as ``apply_updates(params, transform.update(grads, state, params)[0])`` but each
    stage runs its in-place form (``update_``) and a final :func:`decoupled_apply` applies its step
    directly (so :func:`dmuon.functional.muon.transform` run here is :func:`dmuon.functional.muon.update`
    bitwise). ``donate=True`` writes params and state buffers in place (the returned leaves are
    the same objects); otherwise no input is modified. ``None`` gradients skip their leaf.
    """
    with torch.no_grad():
        leaves = Leaves(params, grads, donate=donate, what="grads")
        state = run_inplace(transform, leaves, state)
    return leaves.params_tree(), state


def chain(*stages: Transform) -> Transform:
    """The stages applied in order; the state is :class:`ChainState` of theirs. In place
    (``update_``), every stage runs on the same leaves; a stage written in the optax form only
    runs out of place there (:func:`~dmuon.functional.stages.leaves.derive_update_`)."""
    for k, t in enumerate(stages):
        if not isinstance(t, Transform):
            raise TypeError(f"chain stage {k} must be a Transform, got {type(t).__name__}")
    in_place = tuple(in_place_form(t) for t in stages)
    applying = next((k for k, t in enumerate(stages) if t.applies), None)
    refusal = next((r for r in map(in_place_refusal, in_place) if r is not None), None) or (
        AFTER_APPLYING if applying is not None
        and any(t.update_ is None for t in stages[applying + 1:]) else None)

    def init(params: PyTree) -> ChainState:
        return ChainState(tuple(t.init(params) for t in stages))

    def check(state: Any) -> None:
        if not isinstance(state, ChainState) or len(state.states) != len(stages):
            raise ValueError(f"chain of {len(stages)} stages needs its ChainState (from its init)")

    def update(updates: PyTree, state: ChainState, params: PyTree) -> tuple[PyTree, ChainState]:
        check(state)
        new = []
        for t, s in zip(stages, state.states):
            updates, s = t.update(updates, s, params)
            new.append(s)
        return updates, ChainState(tuple(new))

    def update_(leaves: Leaves, state: ChainState) -> ChainState:
        check(state)
        return ChainState(tuple(t.update_(leaves, s) for t, s in zip(in_place, state.states)))

    needs = tuple(dict.fromkeys(n for t in in_place for n in t.needs))
    mu_dtype = next((t.momentum_dtype for t in stages if t.momentum_dtype is not None), None)
    return Transform(init, torch.no_grad()(update),
                     update_ if refusal is None else refused_update_(refusal), needs, mu_dtype,
                     applying is not None)


def _labels_of(labels: Any, params: PyTree) -> list[Any]:
    p_leaves, treedef = flatten(params)
    if callable(labels):
        return [labels(name, p) for name, p in zip(leaf_paths(params), p_leaves)]
    return flatten_like(treedef, labels, "labels")


def partition(transforms: Mapping[Any, Transform], labels: Any) -> Transform:
    """Route each param to the transform of its label (e.g. ``{"muon": ..., "adamw": ...}``).

    Args:
        transforms: ``{label: Transform}``.
        labels: a pytree of labels with the params' structure, or ``labels(path_name, param)``.

    Every param must have a label of ``transforms`` (else ``ValueError`` naming it); each inner
    transform sees a flat ``{path_name: leaf}`` dict of its params.
    """
    transforms = dict(transforms)

    def split(tree: PyTree, params: PyTree) -> dict[Any, dict[str, Any]]:
        leaves = flatten_like(flatten(params)[1], tree, "updates")
        names = leaf_paths(params)
        out: dict[Any, dict[str, Any]] = {k: {} for k in transforms}
        for name, lab, leaf in zip(names, _labels_of(labels, params), leaves):
            if lab not in transforms:
                raise ValueError(f"param {name!r} has label {lab!r}; partition has transforms for "
                                 f"{sorted(map(str, transforms))}")
            out[lab][name] = leaf
        return out

    def init(params: PyTree) -> PartitionState:
        parts = split(params, params)
        return PartitionState({k: t.init(parts[k]) for k, t in transforms.items()})

    def update(updates: PyTree, state: PartitionState, params: PyTree):
        p_parts, u_parts = split(params, params), split(updates, params)
        merged: dict[str, Any] = {}
        new: dict[Any, Any] = {}
        for k, t in transforms.items():
            merged_k, new[k] = t.update(u_parts[k], state.inner[k], p_parts[k])
            merged.update(merged_k)
        treedef = flatten(params)[1]
        return treedef.unflatten([merged[n] for n in leaf_paths(params)]), PartitionState(new)

    return Transform(init, torch.no_grad()(update))
