"""Momentum with the Nesterov input: Muon's first stage (pure math, in place on lists).

::

    b ← μ·b + g                  (sum form; b₀ = 0, so the first step gives b = g)
    x ← g + μ·b  if nesterov  else  b

:func:`foreach_momentum_` is the arithmetic (``torch._foreach_*``); :func:`trace_momentum` is the
stage that runs it, or any implementation of the same contract (``impl=``, e.g. the fused Triton
pass of :mod:`dmuon.kernels.muon_elementwise`). With the Nesterov input the stage forms ``x`` in
the gradient's own storage where that storage is scratch (a converted copy or a donated
gradient), else in a new tensor; without it the output is ``b`` itself and the gradient's
storage, if scratch, is left to later stages as a spare.

References:
    K. Jordan et al. "Muon: An optimizer for hidden layers in neural networks", 2024 (the Nesterov
    form). Y. Nesterov, "A method for solving the convex programming problem with convergence rate
    O(1/k²)", 1983.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import torch
from torch import Tensor

from dmuon.functional.stages.base import Transform, hyper_stage
from dmuon.functional.stages.hparams import (Hyper, check_hyper, is_batched, register_state,
                                             traced)
from dmuon.functional.stages.leaves import FOREACH, PER_TENSOR, Leaves
from dmuon.functional.state_dtype import absmax, check_state_dtype, round_trip
from dmuon.functional.tree import PyTree, flatten, zeros_like_tree

__all__ = ["MomentumState", "MomentumImpl", "MomentumIO", "RoundingIO", "foreach_momentum_",
           "momentum_", "trace_momentum"]

#: ``impl(bs, gs, xs, mu)``: the contract of :func:`foreach_momentum_`.
MomentumImpl = Callable[[list[Tensor], list[Tensor], Optional[list[Tensor]], float], None]


class MomentumIO(Protocol):
    """Where the momentum buffers live when they are not the working tensors (``io=`` of
    :func:`trace_momentum`): the state's buffers are then *stored* tensors (a narrower dtype, host
    memory) that only this object reads and writes. The stage runs in chunks of leaves: per chunk
    ``load`` the working buffers, run the arithmetic, ``store`` them back; the working buffers of
    a chunk are dropped before the next chunk is loaded. The momentum stage is elementwise, so the
    chunking changes no bit; the later stages (Newton–Schulz) never see the buffers.
    """

    def chunks(self, names: Sequence[str]) -> list[list[int]]:
        """The active leaves (``names``) as chunks of positions, in the order to run them."""

    def load(self, names: Sequence[str], stored: Sequence[Tensor]) -> list[Tensor]:
        """The working buffers (the params' dtype and device) of ``stored``."""

    def store(self, names: Sequence[str], stored: Sequence[Tensor], work: Sequence[Tensor]) -> None:
        """Write the updated working buffers ``work`` back into the storage of ``stored``."""

    def holds(self, names: Sequence[str], buffers: Sequence[Tensor]) -> bool:
        """Whether ``buffers`` are the stored tensors of ``names`` (an io handed to the leaves,
        ``Leaves(momentum_io=...)``, serves the momentum stage whose state they are)."""

    # Optional (an io without them has no shared scales):
    # ``shared(names) -> list[int]``: the positions of the leaves whose stored scale is shared
    # with other processes (a tensor-parallel slice takes its whole matrix's scale); the stage
    # then runs a first pass over them, chunk by chunk, that forms the updated momentum without
    # writing anything and hands its absmaxes to ``share_absmax(names, amaxes)`` (one call, a
    # list of 0-d fp32 tensors in ``names``' order), before the pass that stores.


@register_state
class MomentumState(NamedTuple):
    """State of :func:`trace_momentum`: the buffers ``b`` (params' structure, shapes, dtypes)."""

    momentum: PyTree
    per_param = ("momentum",)


def foreach_momentum_(bs: list[Tensor], gs: list[Tensor], xs: Optional[list[Tensor]],
                      mu: float) -> None:
    """The momentum stage's arithmetic, in place: ``b ← μ·b + g``; then ``x ← g + μ·b`` if ``xs``
    is given.

    Args:
        bs: momentum buffers (updated in place).
        gs: gradients, each with its ``b``'s shape and dtype.
        xs: Nesterov outputs (``None``: no Nesterov input). ``xs[k]`` is either ``gs[k]`` itself
            (formed in the gradient's storage) or a tensor of ``gs[k]``'s shape that receives it.
        mu: momentum coefficient ``μ``.
    """
    if not bs:
        return
    torch._foreach_mul_(bs, mu)
    torch._foreach_add_(bs, gs)
    if xs is None:
        return
    same = [k for k in range(len(bs)) if xs[k] is gs[k]]
    if same:
        torch._foreach_add_([gs[k] for k in same], [bs[k] for k in same], alpha=mu)
    for k in range(len(bs)):
        if xs[k] is not gs[k]:
            torch.add(gs[k], bs[k], alpha=mu, out=xs[k])


def momentum_(bs: list[Tensor], gs: list[Tensor], xs: Optional[list[Tensor]], mu: Any,
              ops: Any) -> None:
    """:func:`foreach_momentum_`'s arithmetic with the list ops ``ops`` and ``μ`` a float or a 0-d
    tensor (``x ← g + b·μ`` then: a tensor is no ``alpha``, nor is a float ``torch.compile``
    traces, which may be a symbol): the path of per-tensor ops (inside ``torch.vmap``), of tensor
    or scheduled ``μ`` and of traced code."""
    if not bs:
        return
    ops.mul_(bs, mu)
    ops.add_(bs, gs)
    if xs is None:
        return
    factor = isinstance(mu, Tensor) or traced()
    for k in range(len(bs)):
        if factor:
            x = gs[k] + bs[k] * mu
        elif xs[k] is gs[k]:
            gs[k].add_(bs[k], alpha=mu)
            continue
        else:
            x = torch.add(gs[k], bs[k], alpha=mu)
        if xs[k] is gs[k]:
            gs[k].copy_(x)
        else:
            xs[k].copy_(x)


class RoundingIO:
    """The :class:`MomentumIO` of a stage that keeps its momentum in ``dtype`` in one process
    (:func:`trace_momentum`'s ``dtype=``): the buffers stay in the param's dtype and, after each
    update, hold what storing them in ``dtype`` leaves of them
    (:func:`~dmuon.functional.state_dtype.round_trip`: bf16, or an 8-bit float with a per-matrix
    scale), exactly what a distributed owner's stored momentum decodes to."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def chunks(self, names: Sequence[str]) -> list[list[int]]:
        return [list(range(len(names)))] if names else []

    def load(self, names: Sequence[str], stored: Sequence[Tensor]) -> list[Tensor]:
        return list(stored)

    def store(self, names: Sequence[str], stored: Sequence[Tensor], work: Sequence[Tensor]) -> None:
        for s in stored:
            s.copy_(round_trip(s, self.dtype))

    def holds(self, names: Sequence[str], buffers: Sequence[Tensor]) -> bool:
        return False


def trace_momentum(momentum: Hyper = 0.95, nesterov: bool = True, *,
                   impl: Optional[MomentumImpl] = None, io: Optional[MomentumIO] = None,
                   dtype: Optional[torch.dtype] = None) -> Transform:
    """``b ← μ·b + g`` (sum form, ``b₀ = 0``); output ``g + μ·b`` if ``nesterov`` else ``b``.

    Args:
        momentum: ``μ`` in ``[0, 1)``: a float, a 0-d tensor or a function of the step
            (:mod:`~dmuon.functional.stages.hparams`).
        nesterov: output the Nesterov input ``g + μ·b`` (else ``b``).
        impl: the implementation (default :func:`foreach_momentum_`); another one (a fused
            kernel) must keep that contract.
        io: the state's buffers are stored tensors read and written chunk by chunk through this
            :class:`MomentumIO` (bitwise the same arithmetic; the output is then never the buffer
            itself: without Nesterov ``b`` is copied into the gradient's storage where that is
            scratch, else into a new tensor).
        dtype: the dtype the momentum is kept in between updates (optax's ``mu_dtype``):
            ``None`` / fp32 (the param's), ``torch.bfloat16``, or an 8-bit float
            (``float8_e4m3fn`` / ``float8_e5m2``, with a per-matrix scale). In one process the
            buffers are rounded to it after each update (:class:`RoundingIO`); a distributed
            owner (``dmuon.Muon(transform=...)``) stores them in it (and may offload them),
            bitwise the same values.

    Gradients are first cast to the param's dtype (the math runs there).
    """
    momentum = check_hyper("momentum", momentum, hi=1.0, where="trace_momentum")
    dtype = check_state_dtype(dtype)
    rounding = None if dtype == torch.float32 else RoundingIO(dtype)

    def init(params: PyTree) -> MomentumState:
        leaves, treedef = flatten(params)
        return MomentumState(zeros_like_tree(leaves, treedef))

    def update_(leaves: Leaves, state: Any, momentum: Any) -> Any:
        leaves.materialize()
        mu = momentum
        fused = impl if impl is not None else getattr(leaves.elementwise, "momentum", None)
        factor = isinstance(mu, Tensor) or traced()  # traced, a float μ may be a symbol
        if fused not in (None, foreach_momentum_) and not factor:
            run = fused
        elif leaves.ops is FOREACH and not factor:
            run = foreach_momentum_
        else:  # per-tensor ops (inside vmap), or a tensor μ (batched), or traced
            def run(b, g, x, m):
                momentum_(b, g, x, m, PER_TENSOR if factor else leaves.ops)
        bs, gs, n = state.momentum, leaves.updates, len(leaves)
        stored = io if io is not None else (leaves.momentum_io_of(bs) or rounding)
        if stored is not None:
            _run_chunked(stored, leaves.names, run, bs, gs, leaves, mu, nesterov)
            return state
        if nesterov:
            xs = [g if leaves.scratch[k] else _output_like(g, b)
                  for k, (g, b) in enumerate(zip(gs, bs))]
            run(bs, gs, xs, mu)
            leaves.updates, leaves.scratch = xs, [True] * n
        else:
            run(bs, gs, None, mu)
            leaves.spare = [g if s else None for g, s in zip(gs, leaves.scratch)]
            leaves.updates, leaves.scratch = list(bs), [False] * n
        return state

    stage_ = hyper_stage(update_, init, momentum=momentum)
    return stage_._replace(momentum_dtype=None if rounding is None else dtype)


def _output_like(g: Tensor, b: Tensor) -> Tensor:
    """A new tensor for the Nesterov output ``g + μ·b``: like ``g``, but batched where only ``b``
    is (``torch.vmap`` over params and state with one gradient for all: the output is batched,
    and an unbatched tensor cannot receive it)."""
    if is_batched(b) and not is_batched(g):
        return torch.empty_like(b, dtype=g.dtype)
    return torch.empty_like(g)


def _run_chunked(io: MomentumIO, names: list[str], run: Callable, bs: list[Tensor],
                 gs: list[Tensor], leaves: Leaves, mu: Any, nesterov: bool) -> None:
    """:func:`trace_momentum`'s arithmetic on stored buffers, one :meth:`MomentumIO.chunks` chunk
    at a time (load, run, store; the chunk's working buffers dropped before the next). Leaves
    whose scale is shared (``io.shared``) get a first pass that only measures their updated
    momentum's absmax (``b`` only: ``run`` computes ``b`` the same with or without the Nesterov
    output), so one exchange per step precedes the storing pass and a chunk stays the bound."""
    n = len(leaves)
    shared = list(io.shared(names)) if hasattr(io, "shared") else []
    if shared:  # a first pass: the updated momentum's absmax of leaves with a shared scale
        sub = [names[k] for k in shared]
        amax: dict[str, Tensor] = {}
        for js in io.chunks(sub):
            ks = [shared[j] for j in js]
            work = io.load([names[k] for k in ks], [bs[k] for k in ks])
            run(work, [gs[k] for k in ks], None, mu)  # the same b as the storing pass, bitwise
            amax.update((names[k], absmax(w)) for k, w in zip(ks, work))
            del work
        io.share_absmax(sub, [amax[x] for x in sub])
    xs = [g if leaves.scratch[k] else torch.empty_like(g) for k, g in enumerate(gs)]
    for ks in io.chunks(names):
        sub, stored = [names[k] for k in ks], [bs[k] for k in ks]
        work = io.load(sub, stored)
        run(work, [gs[k] for k in ks], [xs[k] for k in ks] if nesterov else None, mu)
        if not nesterov:  # the output is b: a copy (the working buffer goes back to storage)
            for k, w in zip(ks, work):
                xs[k].copy_(w)
        io.store(sub, stored, work)
        del work
    leaves.updates, leaves.scratch = xs, [True] * n
