"""Composable optimizer transforms over pytrees, in optax's manner.

A :class:`Transform` is a pair of pure functions::

    state = t.init(params)
    updates, state = t.update(updates, state, params)

``updates`` enter as the gradients and leave as the quantity to add to the params
(:func:`apply_updates`: ``W ← W + u``). States are NamedTuples (plain pytrees any tree tool can
save). Inputs are never modified. A leaf whose update is ``None`` (a param without a gradient)
passes through every stage as ``None`` and keeps its state, as in :func:`dmuon.functional.muon.update`.

Stages (the conventions of :mod:`dmuon.functional.muon` and :mod:`dmuon.functional.adamw`, named):

* :func:`trace_momentum` — ``b ← μ·b + g`` (sum form); output ``g + μ·b`` (Nesterov) or ``b``.
* :func:`orthogonalize` — ``U = NS(x)`` of every matrix of each param's view (``view`` /
  ``batch_dims``), batched per shape;
  the orthogonalizer is swappable.
* :func:`scale_by_shape` — ``u·s(m, n)`` by the ``lr_scale`` rule.
* :func:`scale_by_adam` — Adam's bias-corrected ``m̂ / (sqrt(v̂) + ε)`` (torch's arithmetic).
* :func:`add_decayed_weights` — ``u + λ·W`` (decoupled weight decay, once scaled by ``−lr``).
* :func:`scale_by_learning_rate` — ``−lr·u``.
* :func:`chain` — stages in sequence; :func:`partition` — a transform per route label.

:func:`dmuon.functional.muon.transform` and :func:`dmuon.functional.adamw.transform` are Muon and
AdamW as chains of these stages; :func:`dmuon.functional.muon.update` is the fused, donating form of
the same math that the distributed optimizer runs (equal to the chain up to rounding:
``W·(1 − lr·λ) − lr·s·U`` there, ``W + (−lr)·(s·U + λ·W)`` here; ``tests/test_transforms.py``).

References:
    M. Hessel et al. "Optax: composable gradient transformation and optimisation, in JAX", 2020
    (the ``init`` / ``update`` protocol, ``chain``, ``partition``).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from dmuon.functional.lr_scale import lr_scale_factor, lr_scale_factors
from dmuon.functional.matrix_view import refuse_plain_ns, views_per_leaf
from dmuon.newton_schulz.batched import orthogonalize_batched
from dmuon.newton_schulz.config import NSConfig
from dmuon.functional.tree import PyTree, flatten, flatten_like, leaf_paths

__all__ = [
    "Transform", "EmptyState", "MomentumState", "AdamState", "ChainState", "PartitionState",
    "Orthogonalizer", "apply_updates", "chain", "partition", "trace_momentum", "orthogonalize",
    "scale_by_shape", "scale_by_adam", "add_decayed_weights", "scale_by_learning_rate",
]


class Transform(NamedTuple):
    """A gradient transformation: ``init(params) -> state``;
    ``update(updates, state, params) -> (updates, state)``."""

    init: Callable[[PyTree], Any]
    update: Callable[[PyTree, Any, PyTree], tuple[PyTree, Any]]


def _transform(init: Callable[[PyTree], Any], update: Callable[..., tuple[PyTree, Any]]) -> Transform:
    """A :class:`Transform` whose ``update`` runs under ``torch.no_grad()`` (params may be
    ``nn.Parameter`` s)."""
    return Transform(init, torch.no_grad()(update))


class EmptyState(NamedTuple):
    """State of a stateless stage."""


class MomentumState(NamedTuple):
    """State of :func:`trace_momentum`: the buffers ``b`` (params' structure, shapes, dtypes)."""

    momentum: PyTree


class AdamState(NamedTuple):
    """State of :func:`scale_by_adam`: ``step`` (one global count) and the moments ``mu``, ``nu``."""

    step: int
    mu: PyTree
    nu: PyTree


class ChainState(NamedTuple):
    """State of :func:`chain`: one state per stage, in order."""

    states: tuple


class PartitionState(NamedTuple):
    """State of :func:`partition`: ``{label: inner state}`` (each over its label's params)."""

    inner: dict


#: ``(xs) -> us``: the NS results of ``(B, m, n)`` inputs, one per input, of the same shapes.
Orthogonalizer = Callable[[list[Tensor]], Sequence[Tensor]]


def _leaves(updates: PyTree, params: PyTree) -> tuple[list[Any], list[Tensor], Any]:
    p_leaves, treedef = flatten(params)
    return flatten_like(treedef, updates, "updates"), p_leaves, treedef


def _float_like(u: Tensor, p: Tensor) -> Tensor:
    return u.to(dtype=p.dtype)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``W ← W + u`` per leaf (``None`` updates leave the param itself); new tensors, in the
    params' dtypes."""
    u_leaves, p_leaves, treedef = _leaves(updates, params)
    with torch.no_grad():
        out = [p if u is None else p + u.to(dtype=p.dtype) for p, u in zip(p_leaves, u_leaves)]
    return treedef.unflatten(out)


def chain(*stages: Transform) -> Transform:
    """The stages applied in order; the state is :class:`ChainState` of theirs."""
    for k, t in enumerate(stages):
        if not isinstance(t, Transform):
            raise TypeError(f"chain stage {k} must be a Transform, got {type(t).__name__}")

    def init(params: PyTree) -> ChainState:
        return ChainState(tuple(t.init(params) for t in stages))

    def update(updates: PyTree, state: ChainState, params: PyTree) -> tuple[PyTree, ChainState]:
        if not isinstance(state, ChainState) or len(state.states) != len(stages):
            raise ValueError(f"chain of {len(stages)} stages needs its ChainState (from its init)")
        new = []
        for t, s in zip(stages, state.states):
            updates, s = t.update(updates, s, params)
            new.append(s)
        return updates, ChainState(tuple(new))

    return _transform(init, update)


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

    return _transform(init, update)


def trace_momentum(momentum: float = 0.95, nesterov: bool = True) -> Transform:
    """``b ← μ·b + g`` (sum form, ``b₀ = 0``); output ``g + μ·b`` if ``nesterov`` else ``b``.

    Gradients are first cast to the param's dtype (the math runs there)."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")

    def init(params: PyTree) -> MomentumState:
        leaves, treedef = flatten(params)
        return MomentumState(treedef.unflatten([torch.zeros_like(p) for p in leaves]))

    def update(updates: PyTree, state: MomentumState, params: PyTree):
        u_leaves, p_leaves, treedef = _leaves(updates, params)
        b_leaves = flatten_like(treedef, state.momentum, "momentum")
        out, new_b = [], []
        for u, p, b in zip(u_leaves, p_leaves, b_leaves):
            if u is None:
                out.append(None)
                new_b.append(b)
                continue
            g = _float_like(u, p)
            b = b * momentum + g
            new_b.append(b)
            out.append(g + momentum * b if nesterov else b)
        return treedef.unflatten(out), MomentumState(treedef.unflatten(new_b))

    return _transform(init, update)


def _stateless(fn: Callable[[list[Any], list[Tensor], Any, PyTree], list[Any]]) -> Transform:
    def update(updates: PyTree, state: EmptyState, params: PyTree):
        u_leaves, p_leaves, treedef = _leaves(updates, params)
        return treedef.unflatten(fn(u_leaves, p_leaves, treedef, params)), state

    return _transform(lambda params: EmptyState(), update)


def orthogonalize(orthogonalizer: Any = None, *, batch_dims: Any = None,
                  view: Any = None) -> Transform:
    """``U = NS(x)`` of every matrix of every update, seen through its matrix view (``view=``, or
    ``batch_dims=k`` for ``Batch(k)``; :mod:`dmuon.functional.matrix_view`).

    Args:
        orthogonalizer: an :class:`~dmuon.newton_schulz.NSConfig` (default ``NSConfig()``: what
            :func:`dmuon.newton_schulz.batched.orthogonalize_batched` computes), or any
            :data:`Orthogonalizer` ``xs -> us`` (one call per step with every active input).
        batch_dims, view: as :func:`dmuon.functional.muon.update`'s (one of the two).
    """
    plain = orthogonalizer is None or isinstance(orthogonalizer, NSConfig)
    if plain:
        config = orthogonalizer or NSConfig()

        def run(xs: list[Tensor]) -> Sequence[Tensor]:
            return orthogonalize_batched(xs, config)
    elif callable(orthogonalizer):
        run = orthogonalizer
    else:
        raise TypeError(f"orthogonalizer must be an NSConfig or a callable, got {orthogonalizer!r}")

    def fn(u_leaves, p_leaves, treedef, params):
        vs = views_per_leaf(view, batch_dims, params, treedef)
        act = [i for i, u in enumerate(u_leaves) if u is not None]
        if plain:
            refuse_plain_ns([vs[i] for i in act], [str(i) for i in act])
        blocks = [vs[i].to_blocks(u_leaves[i]) for i in act]
        xs = [x for blk in blocks for x in blk]
        us = list(run(xs)) if xs else []
        if len(us) != len(xs) or any(tuple(u.shape) != tuple(x.shape) for u, x in zip(us, xs)):
            raise ValueError("the orthogonalizer must return one tensor per input, of its shape")
        out = list(u_leaves)
        at = 0
        for i, blk in zip(act, blocks):
            shape = tuple(p_leaves[i].shape)
            out[i] = vs[i].from_blocks(us[at:at + len(blk)], shape).to(dtype=p_leaves[i].dtype)
            at += len(blk)
        return out

    return _stateless(fn)


def scale_by_shape(rule: str = "moonlight", *, batch_dims: Any = None,
                   view: Any = None) -> Transform:
    """``u·s(m, n)`` with :func:`dmuon.functional.lr_scale.lr_scale_factor`'s rule per block of
    each param's matrix view (``view=`` or ``batch_dims=``, as :func:`orthogonalize`)."""
    lr_scale_factor((1, 1), rule)  # validates the rule

    def scaled(u: Tensor, shape: tuple[int, ...], vw: Any) -> Tensor:
        scales = lr_scale_factors(shape, rule, vw)
        if len(set(scales)) == 1:
            return u * scales[0]
        return vw.from_blocks([b * s for b, s in zip(vw.to_blocks(u), scales)], shape)

    def fn(u_leaves, p_leaves, treedef, params):
        vs = views_per_leaf(view, batch_dims, params, treedef)
        return [None if u is None else scaled(u, tuple(p.shape), vs[i])
                for i, (u, p) in enumerate(zip(u_leaves, p_leaves))]

    return _stateless(fn)


def add_decayed_weights(weight_decay: float) -> Transform:
    """``u + λ·W`` (after :func:`scale_by_learning_rate`: decoupled decay ``W ← W − lr·λ·W``)."""
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")

    def fn(u_leaves, p_leaves, treedef, params):
        if weight_decay == 0:
            return u_leaves
        return [None if u is None else u + weight_decay * p for u, p in zip(u_leaves, p_leaves)]

    return _stateless(fn)


def scale_by_learning_rate(lr: float) -> Transform:
    """``−lr·u`` (descent)."""
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr!r}")
    return _stateless(lambda u_leaves, p, t, params: [None if u is None else -lr * u for u in u_leaves])


def scale_by_adam(betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> Transform:
    """Adam's direction with ``t = step + 1`` (torch's ``_single_tensor_adam`` arithmetic)::

        m ← lerp(m, g, 1 − β1);   v ← β2·v + (1 − β2)·g²
        u = m / (1 − β1^t) / (sqrt(v) / sqrt(1 − β2^t) + ε)
    """
    beta1, beta2 = (float(b) for b in betas)
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"betas must be in [0, 1), got {betas!r}")

    def init(params: PyTree) -> AdamState:
        leaves, treedef = flatten(params)
        return AdamState(0, treedef.unflatten([torch.zeros_like(p) for p in leaves]),
                         treedef.unflatten([torch.zeros_like(p) for p in leaves]))

    def update(updates: PyTree, state: AdamState, params: PyTree):
        u_leaves, p_leaves, treedef = _leaves(updates, params)
        m_leaves = flatten_like(treedef, state.mu, "mu")
        v_leaves = flatten_like(treedef, state.nu, "nu")
        t = int(state.step) + 1
        bc1, bc2_sqrt = 1 - beta1**t, (1 - beta2**t) ** 0.5
        out, new_m, new_v = [], [], []
        for u, p, m, v in zip(u_leaves, p_leaves, m_leaves, v_leaves):
            if u is None:
                out.append(None)
                new_m.append(m)
                new_v.append(v)
                continue
            g = _float_like(u, p)
            m = m.lerp(g, 1 - beta1)
            v = v.mul(beta2).addcmul_(g, g, value=1 - beta2)
            out.append((m / bc1) / ((v.sqrt() / bc2_sqrt).add_(eps)))
            new_m.append(m)
            new_v.append(v)
        return treedef.unflatten(out), AdamState(t, treedef.unflatten(new_m), treedef.unflatten(new_v))

    return _transform(init, update)
