"""The pure distributed step: one owner's update, one rank's step through a runner, and the whole
world's step in the simulator, each returning the updated pytrees (and the schedule it ran).

The card's function, three ways, all over flat ``{name: tensor}`` trees of the dedicated matrices:

* :func:`~dmuon.functional.owner_step.owner_step` — what an owner does with the averaged
  gradients of the matrices it owns (its own module: the optimizer imports it without the
  simulator); ``dmuon.Muon.step`` and ``verify_step``'s reference call exactly this function.
* :func:`rank_step` — one rank's step: pack its local gradients into the program's reduce buckets,
  run the reduces (in the program's fixed order) and the publish through ``run(schedule,
  buffers)`` (the runtime's executor on a real mesh, or anything with the simulator's semantics),
  update what it owns with :func:`owner_step`.
* :func:`world_step` — every rank at once in the in-process simulator
  (:func:`dmuon.functional.simulate.simulate`): ``(per-rank params, per-rank grads, program,
  per-rank states) -> (per-rank params, per-rank states, schedule)``, at any world size, no
  process group. Tests compare the runtime against it and against one process.

Params of a rank are the masters it holds: every matrix whose owner is in its shard column
(``owners[name][0] == s``; DDP mode, ``G = 1``: every matrix). Grads of a rank are its local
gradients of any dedicated matrix (``None`` or absent: it had none; the reduce counts it as zero,
and a matrix no rank had a gradient for is skipped, as a single-device optimizer skips ``grad is
None``). Tensor parallelism's NS gathers are not simulated here (the runtime runs them).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from dmuon.functional import muon as fmuon
from dmuon.functional.owner_step import Update, owner_step
from dmuon.functional.packing import pack, pack_, presence, unpack, zero_buffers
from dmuon.functional.program import StepProgram
from dmuon.functional.schedule import Schedule
from dmuon.functional.simulate import simulate

__all__ = ["owner_step", "rank_step", "world_step", "Runner"]

#: ``run(schedule, buffers)``: execute ``schedule`` on this rank's ``{bucket key: 1-D tensor}``
#: buffers in place and return when done (the runtime's ``Executor.run``).
Runner = Callable[[Schedule, dict], None]


def _reduced(program: StepProgram, coord: tuple[int, int], bufs: Mapping) -> dict:
    """``{owned name: averaged gradient, or None where no rank had one}`` after the reduces."""
    mine = lambda b, e: tuple(e.owner) == coord  # noqa: E731
    buckets = program.reduce_layout.buckets
    views, flags = unpack(buckets, bufs, where=mine), presence(buckets, bufs, where=mine)
    if not flags:
        return views
    names = list(flags)
    present = torch.stack([flags[n] for n in names]).tolist()
    return {n: (views[n] if p > 0 else None) for n, p in zip(names, present)}


def _column(program: StepProgram, s: int):
    return lambda b, e: b.key.column == s  # noqa: E731


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


def rank_step(coord: Sequence[int], params: Mapping[str, Tensor],
              grads: Mapping[str, Optional[Tensor]], state: Any, program: StepProgram,
              update: Update, run: Runner, **kw: Any) -> tuple[dict[str, Tensor], Any, Schedule]:
    """One rank's distributed step (see the module docstring).

    Args:
      coord: this rank's ``(s, r)``.  params: the masters it holds (its column's).
      grads: its local gradients.  state: its owner state (``None``: fresh).
      program: the model's :class:`~dmuon.functional.program.StepProgram`.
      update, **kw: as :func:`owner_step` (``views``, ``mults``, ``update_kwargs``).
      run: executes a schedule on this rank's buffers (collective: every rank calls it with the
        same schedules in the same order).

    Returns:
      ``(new params of its column, new state, the schedule it ran)``.
    """
    s, r = (int(x) for x in coord)
    _check_trees(program, (s, r), params, grads, "rank_step")
    dev = next(iter(params.values())).device if params else torch.device("cpu")
    bufs = zero_buffers(program.reduce_layout.buckets, dev)
    pack_(program.reduce_layout.buckets, bufs, grads)
    ran = []
    for key in program.reduce_order:
        run(program.groups[key].reduce, bufs)
        ran += program.groups[key].reduce.ops
    owned = program.owned((s, r))
    new, state = owner_step(_reduced(program, (s, r), bufs), state,
                            {n: params[n] for n in owned}, update, **kw)
    masters = {**dict(params), **new}
    col = _column(program, s)
    mbufs = pack(program.master_layout.buckets, masters, where=col, device=dev)
    publish = program.publish_all()
    if len(publish):
        run(publish, mbufs)
        ran += publish.ops
        masters = {n: v.clone() for n, v in
                   unpack(program.master_layout.buckets, mbufs, where=col).items()}
    return masters, state, Schedule(tuple(ran), program.shard_size, program.replicate_size)


def world_step(params: Sequence[Mapping[str, Tensor]],
               grads: Sequence[Mapping[str, Optional[Tensor]]], program: StepProgram,
               states: Optional[Sequence[Any]] = None, update: Update = fmuon.MuonHParams(),
               **kw: Any) -> tuple[list[dict[str, Tensor]], list[Any], Schedule]:
    """Every rank's step at once, in the in-process simulator (see the module docstring).

    Args:
      params, grads: per global rank ``r * G + s`` (lists of ``G * R`` trees).
      program: the :class:`~dmuon.functional.program.StepProgram` (without TP).
      states: per rank (``None``: fresh states).
      update, **kw: as :func:`owner_step`.

    Returns:
      ``(per-rank params, per-rank states, the schedule of the step)``: the reduces in the fixed
      order, then the publish.
    """
    G, W = program.shard_size, program.world_size
    if len(params) != W or len(grads) != W:
        raise ValueError(f"world_step: the program is for {W} ranks; got {len(params)} params "
                         f"and {len(grads)} grads trees")
    if program.tp is not None:
        raise NotImplementedError("world_step does not simulate tensor parallelism's NS gathers")
    for i in range(W):
        _check_trees(program, (i % G, i // G), params[i], grads[i], "world_step")
    states = list(states) if states is not None else [None] * W
    red = Schedule(tuple(op for k in program.reduce_order for op in program.groups[k].reduce),
                   G, program.replicate_size)
    dev = lambda i: next(iter(params[i].values())).device if params[i] else "cpu"  # noqa: E731
    bufs = [pack(program.reduce_layout.buckets, grads[i], device=dev(i)) for i in range(W)]
    bufs = simulate(red, bufs, donate=True)
    masters, new_states = [], []
    for i in range(W):
        coord = (i % G, i // G)
        owned = program.owned(coord)
        new, st = owner_step(_reduced(program, coord, bufs[i]), states[i],
                             {n: params[i][n] for n in owned}, update, **kw)
        masters.append({**dict(params[i]), **new})
        new_states.append(st)
    publish = program.publish_all()
    cols = [_column(program, i % G) for i in range(W)]
    mbufs = [pack(program.master_layout.buckets, masters[i], where=cols[i], device=dev(i))
             for i in range(W)]
    mbufs = simulate(publish, mbufs, donate=True)
    out = [{n: v.clone() for n, v in
            unpack(program.master_layout.buckets, mbufs[i], where=cols[i]).items()}
           for i in range(W)]
    return out, new_states, red + publish
