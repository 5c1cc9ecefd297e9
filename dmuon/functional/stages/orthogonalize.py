"""Orthogonalization: ``U = NS(x)`` of every matrix of every update (pure; the NS is swappable).

Each update is seen through its param's matrix view (:mod:`dmuon.functional.matrix_view`) as
blocks ``(B, m, n)``; the orthogonalizer gets every active block of the step in one call (so it can
batch same-shape matrices: :func:`dmuon.newton_schulz.batched.orthogonalize_batched`, or the CUDA
engine :class:`dmuon.kernels.ns_engine.NSEngine` handed in by the caller) and returns one result
per block, of its shape; the view's exact inverse writes them back in the param's shape.

The caller running a chain may hand the leaves an ``orthogonalizer_for(spec, names)``
(:class:`~dmuon.functional.stages.leaves.Leaves`): the stage then runs what it returns for its own
``spec`` (the ``NSConfig`` or callable it was built with) and the matrix name of each input — an
owner's NS engine, or tensor parallelism's gathers around it.

A plain :class:`~dmuon.newton_schulz.NSConfig` never writes its inputs, so it reads the momentum
buffers directly. Any other orthogonalizer may overwrite its inputs (an in-place engine does):
inputs that are not scratch are first copied, into a spare buffer when one is free (a donated
gradient) or a new tensor; so the inputs are never params or state.

References:
    K. Jordan et al. "Muon: An optimizer for hidden layers in neural networks", 2024.
    N. Higham, "Functions of Matrices", SIAM 2008, ch. 8 (the polar factor, Newton–Schulz).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from torch import Tensor

from dmuon.functional.matrix_view import refuse_plain_ns
from dmuon.functional.stages.base import Transform, stage
from dmuon.functional.stages.leaves import Leaves
from dmuon.newton_schulz.batched import BatchedNS
from dmuon.newton_schulz.config import NSConfig

__all__ = ["Orthogonalizer", "OrthogonalizerFor", "orthogonalize"]

#: ``(xs) -> us``: the NS results of ``(B, m, n)`` inputs, one per input, of the same shapes.
Orthogonalizer = Callable[[list[Tensor]], Sequence[Tensor]]


class OrthogonalizerFor:
    """An ``orthogonalizer_for(spec, names)`` decided once by the code that runs the chains (the
    optimizer, when it is built): a stage's ``NSConfig`` runs ``ns`` — a class built per config
    (:class:`~dmuon.newton_schulz.batched.BatchedNS`, or the CUDA engine; kept while the config
    stays the same) or one given object, which must compute that config — timed by ``timer``;
    a stage's own callable runs itself; ``wrap(inner, names)``, where given, puts either behind
    the caller's collectives (tensor parallelism's gathers, split NS's units)."""

    def __init__(self, ns: Any, *, timer: Any = None, wrap: Optional[Callable] = None):
        self.ns, self.timer, self.wrap = ns, timer, wrap
        self._made: Any = None if isinstance(ns, type) else ns

    def twin(self) -> "OrthogonalizerFor":
        """The same NS with engines of its own (a given engine's ``twin()``; a class builds its
        own), untimed: for a caller whose calls must neither evict this one's programs nor count
        in its timer (the NS overlap's per-group updates). Not for a wrapped one (TP, split NS:
        the overlap refuses them)."""
        if self.wrap is not None:
            raise ValueError("OrthogonalizerFor.twin: a wrapped orthogonalizer has no twin")
        return OrthogonalizerFor(self.ns if isinstance(self.ns, type) else self.ns.twin())

    def __call__(self, spec: Any, names: Sequence[str]) -> Orthogonalizer:
        run = self._for_config(spec) if isinstance(spec, NSConfig) else spec
        return run if self.wrap is None else self.wrap(run, names)

    def _for_config(self, config: NSConfig) -> Orthogonalizer:
        if not isinstance(self.ns, type):  # the fields MuonHParams sets must agree
            if tuple(self.ns.config[:4]) != tuple(config[:4]):
                raise ValueError(
                    f"dmuon.Muon.step: the NSEngine given as ns_engine computes {self.ns.config} "
                    f"but this optimizer's NS hyper-parameters are {config}; build the engine "
                    "with NSEngine(dmuon.newton_schulz.NSConfig.from_hparams(opt.muon_hparams()), "
                    "...) or leave ns_engine='auto'")
        elif self._made is None or self._made.config != config:
            self._made = self.ns(config)
        self._made.timer = self.timer
        return self._made


def orthogonalize(orthogonalizer: Any = None, *, batch_dims: Any = None,
                  view: Any = None) -> Transform:
    """``U = NS(x)`` of every matrix of every update, seen through its matrix view (``view=``, or
    ``batch_dims=k`` for ``Batch(k)``; :mod:`dmuon.functional.matrix_view`).

    Args:
        orthogonalizer: an :class:`~dmuon.newton_schulz.NSConfig` (default ``NSConfig()``: what
            :func:`dmuon.newton_schulz.batched.orthogonalize_batched` computes), or any
            :data:`Orthogonalizer` ``xs -> us`` (one call per step with every active input, in
            the params' leaf order; it may overwrite the ``xs`` and return them).
        batch_dims, view: as :func:`dmuon.functional.muon.update`'s (one of the two).
    """
    plain = orthogonalizer is None or isinstance(orthogonalizer, NSConfig)
    spec = (orthogonalizer or NSConfig()) if plain else orthogonalizer
    if plain:
        run: Orthogonalizer = BatchedNS(spec)
    elif callable(orthogonalizer):
        run = orthogonalizer
    else:
        raise TypeError(f"orthogonalizer must be an NSConfig or a callable, got {orthogonalizer!r}")

    def update_(leaves: Leaves, state: Any) -> Any:
        leaves.materialize()
        vs = leaves.views(view, batch_dims)
        hook = leaves.orthogonalizer_for
        reads_only = plain and hook is None  # else the inputs are the orthogonalizer's scratch
        if reads_only:
            refuse_plain_ns(vs, leaves.names)
        blocks = []
        for k, x in enumerate(leaves.updates):
            if not (reads_only or leaves.scratch[k]):  # the orthogonalizer's inputs are scratch
                spare = leaves.spare[k]
                x = x.clone() if spare is None else spare.copy_(x)
            blocks.append(vs[k].to_blocks(x))
        xs = [x for blk in blocks for x in blk]
        runner = run
        if hook is not None:
            names = leaves.names
            runner = hook(spec, [names[k] for k, blk in enumerate(blocks) for _ in blk])
        us = list(runner(xs)) if xs else []
        if len(us) != len(xs) or any(not isinstance(u, Tensor) or tuple(u.shape) != tuple(x.shape)
                                     for u, x in zip(us, xs)):
            raise ValueError("orthogonalize(xs) must return one tensor per input with the input's "
                             f"shape; got {len(us)} results for {len(xs)} inputs")
        at = 0
        for k, blk in enumerate(blocks):
            shape = tuple(leaves.params[k].shape)
            leaves.updates[k] = vs[k].from_blocks(us[at:at + len(blk)], shape)
            at += len(blk)
        n = len(leaves)
        leaves.scratch, leaves.spare = [True] * n, [None] * n
        return state

    return stage(update_)
