"""Vector params (biases, norms, anything not owned by one rank) in a functional loop at any
shard size: every rank holds them whole, their gradients are averaged over the data-parallel
world by a schedule of the step program's own ops and builders, run by the same runner, and every
rank runs the same update (AdamW or any chain) on the same means.

The mean is the matrices' reduce, read back on every rank: the vector params form one hook group
``"replicated"`` of a layout (with presence elements) whose every entry is "owned" by rank
``(0, 0)``; :func:`replicated_program` builds, once,

1. the group's gradient reduce (:func:`~dmuon.functional.schedule.reduce_schedule`: shard-axis
   mean to column 0 in every replica, then, R > 1, replicate-axis mean to ``(0, 0)``: the mean
   over the ``G * R`` ranks, exactly as a matrix's owner gets it),
2. its publish (:func:`~dmuon.functional.schedule.publish_schedule`: ``(0, 0)`` to column 0's
   replicas), then
3. its gather (:func:`~dmuon.functional.schedule.unshard_schedule`: column 0 to every column),

each op waiting for the earlier ones on its bucket. :func:`mean` / :func:`means` are the phase
(pack the local gradients, zeros and presence 0 where a rank has none; read the means, ``None``
where no rank had a gradient); :func:`replicated_step` composes them with the update, as
:func:`dmuon.functional.step.rank_step` does for the matrices. The runtime has no such path:
there FSDP2 owns the vector params.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from torch import Tensor

from dmuon.functional import adamw as fadamw
from dmuon.functional import transforms as T
from dmuon.functional.buckets import BucketLayout, bucket_layout
from dmuon.functional.packing import pack_, presence, unpack, zero_buffers
from dmuon.functional.phases import ReducedGrad, Runner, accumulate, resolve
from dmuon.functional.schedule import (Schedule, publish_schedule, reduce_schedule,
                                       unshard_schedule)

__all__ = ["REPLICATED_GROUP", "ReplicatedProgram", "replicated_program", "mean", "means",
           "replicated_step"]

#: the hook-group key of the vector params' buckets (it names them in schedules and errors)
REPLICATED_GROUP = "replicated"


@dataclass(frozen=True)
class ReplicatedProgram:
    """The vector params' layout and their gradient mean (see the module docstring).

    Attributes:
      layout: one bucket per dtype, presence elements included, every entry at ``(0, 0)``.
      mean: the schedule that leaves every rank with the mean over the ``G * R`` ranks.
      names: the vector params, in the order given.
    """

    layout: BucketLayout
    mean: Schedule
    names: tuple[str, ...]


def _after(ops: tuple, earlier: list) -> tuple:
    """``ops``, each waiting for every earlier op on its bucket."""
    return tuple(dataclasses.replace(op, waits=tuple(e.id for e in earlier if e.bucket == op.bucket))
                 for op in ops)


def replicated_program(params: Mapping[str, Tensor], *, shard_size: int,
                       replicate_size: int = 1) -> ReplicatedProgram:
    """The :class:`ReplicatedProgram` of ``params`` (``{name: tensor}``; their shapes and dtypes
    are what moves) on a mesh of ``replicate_size`` replicas of ``shard_size`` ranks (pure, built
    once)."""
    names = tuple(params)
    if not names:
        raise ValueError("replicated_program: no params given (pass the vector params, e.g. "
                         "{n: p for n, p in params.items() if p.ndim < 2})")
    G, R = int(shard_size), int(replicate_size)
    layout = bucket_layout({n: (0, 0) for n in names}, {n: tuple(params[n].shape) for n in names},
                           {n: params[n].dtype for n in names},
                           {n: REPLICATED_GROUP for n in names}, G, R, presence=True)
    ops = list(reduce_schedule(layout, REPLICATED_GROUP).ops)
    ops += _after(publish_schedule(layout, REPLICATED_GROUP).ops, ops)
    ops += _after(unshard_schedule(layout, REPLICATED_GROUP).ops, ops)
    return ReplicatedProgram(layout, Schedule(tuple(ops), G, R), names)


def mean(program: ReplicatedProgram, grads: Mapping[str, Optional[Tensor]],
         buffers: Mapping) -> tuple[Schedule, dict[str, bool]]:
    """The phase: write this rank's local gradients into ``buffers`` (donated, one per bucket of
    ``program.layout``; absent or ``None``: zeros and presence 0) and return ``(the schedule to
    run, {name: this rank had a gradient})``."""
    return program.mean, pack_(program.layout.buckets, buffers, grads)


def means(program: ReplicatedProgram, buffers: Mapping, here: Mapping[str, bool]
          ) -> dict[str, Optional[Tensor]]:
    """After the mean ran: ``{name: mean gradient (a view of buffers), or None where no rank had
    one}`` (the matrices' presence resolution, :func:`dmuon.functional.phases.resolve`)."""
    flags = presence(program.layout.buckets, buffers)
    held = {n: accumulate(None, ReducedGrad(n, v, here[n], flags[n]))
            for n, v in unpack(program.layout.buckets, buffers).items()}
    return resolve(held, program.names)


def replicated_step(params: Mapping[str, Tensor], grads: Mapping[str, Optional[Tensor]],
                    state: Any, program: ReplicatedProgram, update: Any, run: Runner
                    ) -> tuple[dict[str, Tensor], Any, Schedule]:
    """One rank's step of the vector params (collective: every rank calls it).

    Args:
      params: ``{name: tensor}``, the same on every rank.  grads: this rank's local gradients
        (other names are ignored, so a whole gradient tree may be passed).
      state: the update's state (``None``: fresh).  program: :func:`replicated_program`'s.
      update: :class:`dmuon.functional.adamw.AdamWHParams` (:func:`dmuon.functional.adamw.update`)
        or a :class:`~dmuon.functional.transforms.Transform` chain
        (:func:`~dmuon.functional.transforms.update_params`).
      run: the runner of the matrices' step (``dmuon.mesh_executor(G, R).run``).

    Returns:
      ``(new params, new state, the schedule it ran)``; a param no rank had a gradient for keeps
      its value.
    """
    missing = [n for n in program.names if n not in params]
    if missing:
        raise ValueError(f"replicated_step: params lack {missing[:4]} of the replicated program")
    dev = next(iter(params.values())).device
    bufs = zero_buffers(program.layout.buckets, dev)
    sched, here = mean(program, {n: grads.get(n) for n in program.names}, bufs)
    run(sched, bufs)
    g = means(program, bufs, here)
    p = {n: params[n] for n in program.names}
    if isinstance(update, fadamw.AdamWHParams):
        new, state = fadamw.update(g, fadamw.init(p) if state is None else state, p, update)
    elif isinstance(update, T.Transform):
        new, state = T.update_params(update, g, update.init(p) if state is None else state, p)
    else:
        raise TypeError(f"replicated_step: update must be an adamw.AdamWHParams or a "
                        f"transforms.Transform, got {type(update).__name__}")
    return dict(new), state, sched

