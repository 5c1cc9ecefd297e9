"""The pure distributed step: compositions of the step's phases (:mod:`dmuon.functional.phases`)
over one rank's pytrees through a runner, or over every rank's in the simulator, each returning the
updated pytrees and the schedule it ran.

The card's function, three ways, all over flat ``{name: tensor}`` trees of the dedicated matrices:

* :func:`~dmuon.functional.owner_step.owner_step` — what an owner does with the averaged
  gradients of the matrices it owns (its own module: the optimizer imports it without the
  simulator); ``dmuon.Muon.step`` runs exactly this function.
* :func:`rank_step` — one rank's step: ``gather ∘ reduce ∘ owner update ∘ publish`` of the phase
  functions the runtime's hooks call, each phase's schedule run through ``run(schedule,
  buffers)`` (the runtime's executor on a real mesh, ``dmuon.mesh_executor(G, R).run``, or
  anything with the simulator's semantics). Given ``grads`` as a function of the full params, it
  runs the forward gather first (:func:`forward_gather`): a research loop at any shard size
  gathers with the runtime's own phase.
* :func:`world_step` — every rank at once in the in-process simulator
  (:func:`dmuon.functional.simulate.simulate`): ``(per-rank params, per-rank grads, program,
  per-rank states) -> (per-rank params, per-rank states, schedule)``, at any world size, no
  process group. Tests and ``dmuon.verify_step`` compare the runtime against it.

The schedule a step returns is what it ran, in issue order: the forward gathers (forward order;
only when it computed the gradients itself), the reduces (the program's fixed reduce order), the
publish (static order). A functional step holds the full params through its gradient function, so
it runs no Z3 re-gather (the runtime does, after freeing the gathered copy: the program's
:meth:`~dmuon.functional.program.StepProgram.step_schedule` lists it).

Params of a rank are the masters it holds: every matrix whose owner is in its shard column
(``program.column(s)``; DDP mode, ``G = 1``: every matrix). Grads of a rank are its local
gradients of any dedicated matrix (``None`` or absent: it had none; the reduce counts it as zero,
and a matrix no rank had a gradient for is skipped, as a single-device optimizer skips ``grad is
None``). Tensor parallelism's NS gathers are not simulated here (the runtime runs them). Vector
params (biases, norms) take the replicated path: :mod:`dmuon.functional.replicated`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from dmuon.functional import muon as fmuon
from dmuon.functional import phases
from dmuon.functional.owner_step import Update, owner_step
from dmuon.functional.packing import zero_buffers
from dmuon.functional.phases import Runner
from dmuon.functional.program import StepProgram
from dmuon.functional.schedule import Schedule
from dmuon.functional.simulate import simulate

__all__ = ["owner_step", "forward_gather", "rank_step", "world_step", "Runner"]

#: the gradients of a step: ``{name: local gradient}``, or (the step gathers first) a function of
#: the full params: ``grads_fn(full) -> {name: local gradient}`` (:func:`rank_step`) or
#: ``grads_fn(rank, full)`` (:func:`world_step`)
Grads = Union[Mapping[str, Optional[Tensor]], Callable[..., Mapping[str, Optional[Tensor]]]]


def _device(tree: Mapping[str, Tensor]) -> torch.device:
    return next(iter(tree.values())).device if tree else torch.device("cpu")


def _owner_grads(program: StepProgram, coord: tuple[int, int], bufs: Mapping,
                 owned_here: Mapping[str, Mapping[str, bool]]) -> dict:
    """After the reduces: ``{owned name: averaged gradient, or None}`` (the phases' accounting)."""
    held: dict = {}
    for key in program.reduce_order:
        for rg in phases.reduced(program, key, coord, bufs, owned_here[key]):
            held[rg.name] = phases.accumulate(held.get(rg.name), rg)
    return phases.resolve(held, program.owned(coord))


def _check_trees(program: StepProgram, coord: tuple[int, int], params: Mapping[str, Tensor],
                 grads: Mapping[str, Optional[Tensor]], who: str) -> None:
    """A tree that does not fit the program raises (never a silently skipped matrix)."""
    known = set(program.owners)
    stray = sorted(n for n, g in grads.items() if g is not None and n not in known)
    column = {n for n in known if program.owners[n][0] == coord[0]}
    missing = sorted(column - set(params))
    if stray or missing:
        raise ValueError(
            f"{who}: the trees of rank {coord} do not fit the step program: "
            + (f"gradients of {stray[:4]} (no such matrix in the program: was it planned? "
               "specs_from_named_shapes skips tensors with requires_grad=False unless "
               "skip_frozen=False)" if stray else "")
            + ("; " if stray and missing else "")
            + (f"params lack {missing[:4]} (a rank holds every matrix of its shard column)"
               if missing else ""))


def forward_gather(program: StepProgram, coord: Sequence[int], params: Mapping[str, Tensor],
                   run: Runner) -> tuple[dict[str, Tensor], Schedule]:
    """The forward gather of every hook group on rank ``coord`` (collective), with the phase the
    runtime's hooks run (:func:`dmuon.functional.phases.gather`).

    Args:
      program: the :class:`~dmuon.functional.program.StepProgram`.  coord: this rank's ``(s, r)``.
      params: the masters it holds (``program.column(s)``).  run: as :func:`rank_step`.

    Returns:
      tuple: ``({name: full matrix in its compute dtype}, the schedule it ran)``; the full
      matrices are views of buffers of their own.
    """
    c = (int(coord[0]), int(coord[1]))
    _check_trees(program, c, params, {}, "forward_gather")
    bufs = _gather_buffers(program, _device(params))
    full: dict[str, Tensor] = {}
    ops: list = []
    for key in program.forward_order:
        sched = phases.gather(program, key, c, params, bufs)
        run(sched, bufs)
        ops += sched.ops
        full.update(phases.gathered(program, key, bufs))
    return full, Schedule(tuple(ops), program.shard_size, program.replicate_size)


def rank_step(coord: Sequence[int], params: Mapping[str, Tensor], grads: Grads, state: Any,
              program: StepProgram, update: Update, run: Runner, **kw: Any
              ) -> tuple[dict[str, Tensor], Any, Schedule]:
    """One rank's distributed step (see the module docstring).

    Args:
      coord: this rank's ``(s, r)``.  params: the masters it holds (its column's).
      grads: its local gradients, or a function ``grads_fn(full) -> local gradients`` of the full
        matrices (``{name: tensor}`` in their compute dtypes): the step then runs the forward
        gather first (:func:`forward_gather`) and calls it (at G > 1 a rank's params are only its
        column's masters).
      state: its owner state (``None``: fresh).
      program: the model's :class:`~dmuon.functional.program.StepProgram`.
      update, **kw: as :func:`owner_step` (``views``, ``mults``, ``update_kwargs``).
      run: executes a schedule on this rank's buffers (collective: every rank calls it with the
        same schedules in the same order).

    Returns:
      tuple: ``(new params of its column, new state, the schedule it ran)``; the schedule holds
      the forward gather (when ``grads`` is a function), the reduces, the publish.
    """
    s, r = (int(x) for x in coord)
    c = (s, r)
    G, R = program.shard_size, program.replicate_size
    ran = Schedule((), G, R)
    if callable(grads):
        full, ran = forward_gather(program, c, params, run)
        grads = grads(full)
    _check_trees(program, c, params, grads, "rank_step")
    dev = _device(params)
    bufs = zero_buffers(program.reduce_layout.buckets, dev)
    here = {}
    for key in program.reduce_order:
        sched, here[key] = phases.reduce(program, key, c, grads, bufs)
        run(sched, bufs)
        ran = ran + sched
    owned = program.owned(c)
    new, state = owner_step(_owner_grads(program, c, bufs, here), state,
                            {n: params[n] for n in owned}, update, **kw)
    masters = {**dict(params), **new}
    mbufs = zero_buffers(program.master_layout.buckets, dev)
    publish = phases.publish(program, c, mbufs, masters)
    if len(publish):
        run(publish, mbufs)
        ran = ran + publish
        masters = {n: v.clone() for n, v in phases.published(program, c, mbufs).items()}
    return masters, state, ran


def world_step(params: Sequence[Mapping[str, Tensor]], grads: Union[Sequence[Grads], Grads],
               program: StepProgram, states: Optional[Sequence[Any]] = None,
               update: Update = fmuon.MuonHParams(),
               **kw: Any) -> tuple[list[dict[str, Tensor]], list[Any], Schedule]:
    """Every rank's step at once, in the in-process simulator (see the module docstring).

    Args:
      params: per global rank ``r * G + s`` (a list of ``G * R`` trees: each its column's masters).
      grads: per rank, its local gradients; or a function ``grads_fn(rank, full) -> local
        gradients of that rank`` of the full matrices: the forward gather is simulated first.
      program: the :class:`~dmuon.functional.program.StepProgram` (without TP).
      states: per rank (``None``: fresh states).
      update, **kw: as :func:`owner_step`.

    Returns:
      tuple: ``(per-rank params, per-rank states, the schedule of the step)``; the schedule
      holds the forward gather (when ``grads`` is a function), the reduces in the fixed order,
      then the publish.
    """
    G, R, W = program.shard_size, program.replicate_size, program.world_size
    coords = [(i % G, i // G) for i in range(W)]
    if len(params) != W or (not callable(grads) and len(grads) != W):
        raise ValueError(f"world_step: the program is for {W} ranks; got {len(params)} params "
                         f"and {'a function' if callable(grads) else len(grads)} grads trees")
    if program.tp is not None:
        raise NotImplementedError("world_step does not simulate tensor parallelism's NS gathers")
    ran = Schedule((), G, R)
    if callable(grads):
        for i in range(W):
            _check_trees(program, coords[i], params[i], {}, "world_step")
        full, ran = _world_gather(program, params)
        grads = [grads(i, full[i]) for i in range(W)]
    for i in range(W):
        _check_trees(program, coords[i], params[i], grads[i], "world_step")
    states = list(states) if states is not None else [None] * W
    bufs = [zero_buffers(program.reduce_layout.buckets, _device(params[i])) for i in range(W)]
    here: list[dict] = [{} for _ in range(W)]
    ops: list = []
    for key in program.reduce_order:
        for i in range(W):
            sched, here[i][key] = phases.reduce(program, key, coords[i], grads[i], bufs[i])
        ops += sched.ops
    red = Schedule(tuple(ops), G, R)
    bufs = simulate(red, bufs, donate=True)
    masters, new_states = [], []
    for i in range(W):
        owned = program.owned(coords[i])
        new, st = owner_step(_owner_grads(program, coords[i], bufs[i], here[i]), states[i],
                             {n: params[i][n] for n in owned}, update, **kw)
        masters.append({**dict(params[i]), **new})
        new_states.append(st)
    mbufs = [zero_buffers(program.master_layout.buckets, _device(params[i])) for i in range(W)]
    for i in range(W):
        publish = phases.publish(program, coords[i], mbufs[i], masters[i])
    mbufs = simulate(publish, mbufs, donate=True)
    out = [{n: v.clone() for n, v in phases.published(program, coords[i], mbufs[i]).items()}
           for i in range(W)]
    return out, new_states, ran + red + publish


def _gather_buffers(program: StepProgram, device: Any) -> dict:
    """Every group's :func:`~dmuon.functional.phases.gather_buffers`."""
    return {k: v for key in program.forward_order
            for k, v in phases.gather_buffers(program, key, device).items()}


def _world_gather(program: StepProgram, params: Sequence[Mapping[str, Tensor]]
                  ) -> tuple[list[dict[str, Tensor]], Schedule]:
    """The forward gather of every group on every simulated rank: ``(per-rank full matrices, the
    schedule)`` (the phases of :func:`forward_gather`)."""
    G, R, W = program.shard_size, program.replicate_size, program.world_size
    bufs = [_gather_buffers(program, _device(params[i])) for i in range(W)]
    ops: list = []
    for key in program.forward_order:
        for i in range(W):
            sched = phases.gather(program, key, (i % G, i // G), params[i], bufs[i])
        ops += sched.ops
    fwd = Schedule(tuple(ops), G, R)
    bufs = simulate(fwd, bufs, donate=True)
    full = [{n: v for key in program.forward_order
             for n, v in phases.gathered(program, key, bufs[i]).items()} for i in range(W)]
    return full, fwd
