"""Which collectives move a hook group: one per owner column, one per bucket, or one group call
of the per-owner ones (pure).

A hook group's dedicated matrices sit in one flat bucket per owner column ``s`` (and dtype,
:mod:`dmuon.functional.buckets`). Three styles move them over the shard axis
(:data:`dmuon.functional.schedule.STYLES`):

``"per_owner"`` (the default, dmuon's original schedule)
    forward (and Z3 backward) gather: one ``Broadcast`` per bucket from its column; gradient
    reduce: one ``Reduce`` per bucket to its column. ``k`` owner columns in the group → ``k``
    collectives per phase, each moving exactly its bucket.
``"per_bucket"`` (MatrixFSDP's pattern)
    one ``ShardAllGather`` / ``ShardReduceScatter`` per group and dtype over all ``G`` shard
    indices, each index's part padded to the largest bucket (a column without a bucket sends
    zeros). One collective per phase, but ``G * max`` elements instead of ``sum``.
``"grouped"`` (all-gather-v / reduce-v semantics)
    the per-owner ops, each phase's (gather, Z3 re-gather, stage-1 reduce, stage-2 reduce,
    publish) as one group call (``coalesce``: one ``ncclGroupStart`` / ``End`` on NCCL; gloo runs
    the parts one after another). The same ops, bytes and reduction order as per owner: exact
    and bitwise equal to it; one launch per phase, nothing padded.

``"auto"`` chooses per group with an α–β cost model of one collective on the shard group:
``seconds = alpha + hops * alpha_hop + wire_bytes / busbw``, where ``wire_bytes`` is what a
pipelined ring / tree moves through its busiest member: from the one byte count
(:func:`~dmuon.functional.schedule.op_bytes`), the smallest over members of ``max(sent,
received)`` (``P`` for a broadcast or reduce of ``P`` bytes, ``(n-1) * padded P`` for the
per-bucket ops). A group call costs one latency plus the sum of its parts' bytes
(:func:`unit_seconds`). A group's cost is its gather (twice under Z3: forward and backward
re-gather) plus its reduce; a style is chosen over the ones before it in
``("per_owner", "grouped", "per_bucket")`` only when strictly cheaper, so a group with one bucket
stays per owner, groups of several owners go grouped, and latency-bound groups whose buckets are
about equal (many small owners, large ``G``) go per bucket, whose all-gather moves ``(n-1)/n`` of
the bytes through each link where ``n`` broadcasts move all of them. Every choice carries its
reason (:class:`StyleChoice`), which the step program records per group.

The replicate axis (HSDP, ``R > 1``): per owner, a column's stage-2 reduce starts when its own
stage-1 reduce ends and its broadcast when its own publish has landed; grouped, every stage-2
reduce waits for the whole group call, and the call for every column's publish. Between layers
the next layer's compute hides that; at the step's boundary it does not: the first group of the
forward order (:func:`resolve_styles`) opens the forward after its publish and its reduce closes
the backward. For that group ``"auto"`` adds the replicate-axis wait (:func:`replicate_wait`):
its launches timed as a flow (the shard link one launch after another, each column's replicate
link beside it, each launch after what it waits for), the slowest column counting, less the same
launches on the shard axis alone. Shard-link work that follows the last reduce outside the
program (FSDP2's reduce-scatter of the root's params: :attr:`LinkCost.shard_tail_s`) hides that
much of the wait. The term weighs per owner against grouped (the same ops and bytes: only when
stage 2 and the gathers may start differs); per bucket is weighed on the shard axis alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Union

from dmuon.functional.buckets import BucketLayout, dtype_itemsize
from dmuon.functional.schedule import (STYLES, Op, Schedule, ShardBuckets, op_bytes,
                                       publish_schedule, reduce_schedule, unshard_schedule)

__all__ = ["CHOICES", "LinkCost", "StyleChoice", "wire_bytes", "coalesced_units", "unit_seconds",
           "replicate_wait", "choose_style", "resolve_styles", "check_choice", "mode_collectives"]

#: The values of ``dedicate_params(collectives=...)`` / ``step_program(collectives=...)``.
CHOICES = STYLES + ("auto",)

OpSeconds = Callable[[Op, int], float]


def wire_bytes(op: Op, n: int) -> int:
    """Bytes a pipelined implementation of ``op`` moves through its busiest member's link in a
    group of ``n`` ranks: ``min`` over members of ``max(sent, received)`` of
    :func:`~dmuon.functional.schedule.op_bytes` (0 in a group of one)."""
    if n <= 1:
        return 0
    return min(max(op_bytes(op, i, n)) for i in range(n))


def coalesced_units(ops: Iterable[Op]) -> list[tuple[Op, ...]]:
    """The launches of ``ops``: the ops of one ``coalesce`` key on one lane and replicate column
    (``at``) form one group call, in first-use order; every other op is a launch of its own."""
    units: dict = {}
    for i, op in enumerate(ops):
        units.setdefault((op.coalesce, op.lane, op.at) if op.coalesce else i, []).append(op)
    return [tuple(u) for u in units.values()]


def unit_seconds(unit: tuple[Op, ...], seconds: "OpSeconds", n: int) -> float:
    """Seconds of one launch of :func:`coalesced_units` in a group of ``n`` ranks: its op's, or,
    for a group call, one latency plus the parts' bytes on the bus: ``seconds`` of the first part
    carrying the parts' summed payload."""
    if len(unit) == 1:
        return seconds(unit[0], n)
    head = unit[0]
    numel = -(-sum(op.nbytes for op in unit) // dtype_itemsize(head.dtype))
    return seconds(dataclasses.replace(head, offset=0, numel=numel, waits=(), coalesce=""), n)


@dataclass(frozen=True)
class LinkCost:
    """α–β model of one collective on the shard group (``"auto"``'s default cost).

    Defaults: the H200 InfiniBand figures of :mod:`dmuon.tools.machine` (start-up 20 µs, 3 µs per
    hop, 40 GB/s bus bandwidth per GPU; assumed, not measured); pass the link of the job's
    machine for a better choice. ``hop`` counts one per member (a ring). Replicate-axis ops are
    timed on the same link with ``n = R``. ``shard_tail_s``: seconds of shard-link work after the
    step's last gradient reduce that is not dmuon's (FSDP2's reduce-scatter of the root's
    params; 0: none known), which hides that much of the replicate axis' wait (module docstring).
    An object with ``seconds(op, n)`` and ``shard_tail_s`` may stand for it (the projector's).
    """

    alpha_s: float = 20e-6
    alpha_hop_s: float = 3e-6
    busbw_bytes_per_s: float = 40e9
    shard_tail_s: float = 0.0

    def seconds(self, op: Op, n: int) -> float:
        """Seconds of ``op`` in a group of ``n`` ranks (0 in a group of one)."""
        if n <= 1:
            return 0.0
        return self.alpha_s + n * self.alpha_hop_s + wire_bytes(op, n) / self.busbw_bytes_per_s


@dataclass(frozen=True)
class StyleChoice:
    """A group's style and why.

    Attributes:
      style: one of :data:`~dmuon.functional.schedule.STYLES`.  reason: one readable line.
      seconds: ``{style: projected seconds of the group's gathers + reduce}``.
      collectives: ``{style: shard-axis launches per step}`` (a group call counts once).
      wire: ``{style: wire bytes per step}`` (:func:`wire_bytes`).
      (The three are filled for ``"auto"`` only; an explicit style weighs nothing.)
      replicate_wait: ``{style: seconds}`` of :func:`replicate_wait` added to ``seconds`` where it
        was weighed (the boundary group of an HSDP program, per owner and grouped); else empty.
    """

    style: str
    reason: str
    seconds: Mapping[str, float]
    collectives: Mapping[str, int]
    wire: Mapping[str, int]
    replicate_wait: Mapping[str, float] = dataclasses.field(default_factory=dict)


def _phase_cost(scheds: list[Schedule], G: int, seconds: OpSeconds) -> tuple[float, int, int]:
    t = c = w = 0
    for sched in scheds:
        for unit in coalesced_units(op for op in sched if op.axis == "shard"):
            t += unit_seconds(unit, seconds, G)
            c += 1
            w += sum(wire_bytes(op, G) for op in unit)
    return t, c, w


def _flow_end(ops: Iterable[Op], G: int, R: int, seconds: OpSeconds, *,
              ready: Optional[Mapping[int, float]] = None, tail: float = 0.0) -> float:
    """When ``ops``, started together, are done: shard-axis launches one after another on the
    shard link, each column's replicate-axis launches (``op.at``) on its own link beside it,
    a launch after the launches holding what it waits for (a group call ends as a whole) and a
    shard-axis one after ``ready[column]`` of every column it moves; the shard link ends ``tail``
    seconds later, the slowest column's link counts."""
    end: dict[str, float] = {}
    shard = 0.0
    col: dict[int, float] = {}
    for unit in coalesced_units(ops):
        start = max([0.0] + [end[w] for op in unit for w in op.waits if w in end])
        if unit[0].axis == "shard":
            cols = [k.column for op in unit for k in (
                op.keys if isinstance(op, ShardBuckets) else (op.bucket,)) if k is not None]
            start = max([start, shard] + [(ready or {}).get(c, 0.0) for c in cols])
            t = shard = start + unit_seconds(unit, seconds, G)
        else:
            start = max(start, col.get(unit[0].at, 0.0))
            t = col[unit[0].at] = start + unit_seconds(unit, seconds, R)
        for op in unit:
            end[op.id] = t
    return max([shard + tail] + list(col.values()))


def replicate_wait(unshard: BucketLayout, reduce: BucketLayout, master: BucketLayout, group: str,
                   style: str, seconds: OpSeconds, *, shard_tail_s: float = 0.0) -> float:
    """Seconds the replicate axis (HSDP) adds to ``group``'s gather and reduce in ``style`` when
    nothing computes beside them (module docstring): the forward gather after the group's
    publish (each column's on its own link, in turn) plus the reduce with its stage-2 reduces
    and ``shard_tail_s`` of other shard-link work after it, less the same gather and stage-1
    reduce on the shard axis alone (then ``shard_tail_s``). 0 when ``R == 1``."""
    G, R = unshard.shard_size, unshard.replicate_size
    if R <= 1 or G <= 1:
        return 0.0
    ready: dict[int, float] = {}
    for unit in coalesced_units(publish_schedule(master, group, style=style)):
        ready[unit[0].at] = ready.get(unit[0].at, 0.0) + unit_seconds(unit, seconds, R)
    u = unshard_schedule(unshard, group, style=style)
    r = reduce_schedule(reduce, group, style=style)
    alone = (_flow_end(u, G, R, seconds)
             + _flow_end([op for op in r if op.axis == "shard"], G, R, seconds, tail=shard_tail_s))
    return (_flow_end(u, G, R, seconds, ready=ready)
            + _flow_end(r, G, R, seconds, tail=shard_tail_s) - alone)


def choose_style(unshard: BucketLayout, reduce: BucketLayout, group: str, choice: str, *,
                 z3: bool = False, cost: Union[LinkCost, OpSeconds, None] = None,
                 boundary: bool = False, master: Optional[BucketLayout] = None) -> StyleChoice:
    """The style of hook group ``group`` (module docstring).

    Args:
      unshard, reduce: the gather and reduce layouts.  group: the hook-group key.
      choice: one of :data:`CHOICES`.
      z3: the group is re-gathered in backward (its gather counts twice).
      cost: a :class:`LinkCost`, an object with ``seconds(op, n)`` and ``shard_tail_s`` (the
        projector passes its machine model), or ``seconds(op, n)``; replicate-axis ops are timed
        with ``n = R``. Default ``LinkCost()``.
      boundary: the group opens the forward and closes the backward (the first of the forward
        order, :func:`resolve_styles`): with ``R > 1`` its :func:`replicate_wait` counts.
      master: the publish's layout (default ``unshard``).

    Raises:
      ValueError: ``choice`` is not one of :data:`CHOICES`.
    """
    if choice not in CHOICES:
        raise ValueError(f"collectives must be one of {CHOICES}, got {choice!r}")
    if choice == "sharded" and unshard.shard_size <= 1:  # a copy of the whole group: no gain
        return StyleChoice("per_owner", "sharded asked for: G = 1, nothing to shard", {}, {}, {})
    if choice != "auto":  # nothing to weigh (and nothing built)
        return StyleChoice(choice, f"{choice}: asked for", {}, {}, {})
    G, R = unshard.shard_size, unshard.replicate_size
    cost = LinkCost() if cost is None else cost
    fn: OpSeconds = cost if callable(cost) and not hasattr(cost, "seconds") else cost.seconds
    tail = float(getattr(cost, "shard_tail_s", 0.0))
    secs, colls, wire = {}, {}, {}
    for style in ("per_owner", "grouped", "per_bucket"):  # "sharded" is asked for (memory)
        u = unshard_schedule(unshard, group, style=style)
        r = reduce_schedule(reduce, group, style=style)
        secs[style], colls[style], wire[style] = _phase_cost([u, u, r] if z3 else [u, r], G, fn)
    if G <= 1:
        return StyleChoice("per_owner", "auto: G = 1, nothing moves on the shard axis", secs,
                           colls, wire)
    order = ("per_owner", "grouped", "per_bucket")  # ties go to the earlier style
    best = min(order, key=lambda st: (secs[st], order.index(st)))
    waits: dict[str, float] = {}
    if boundary and R > 1 and best != "per_bucket":
        waits = {st: replicate_wait(unshard, reduce, master or unshard, group, st, fn,
                                    shard_tail_s=tail) for st in ("per_owner", "grouped")}
        for st, w in waits.items():
            secs[st] += w
        best = min(waits, key=lambda st: (secs[st], order.index(st)))
    what = lambda st: (f"{st} {colls[st]} collectives, {wire[st]} wire bytes, "  # noqa: E731
                       f"{secs[st] * 1e3:.3f} ms")
    why = f"auto: {what(best)} " + "; ".join(
        f"{'<' if secs[best] < secs[o] else '<='} {what(o)}" for o in order if o != best)
    if waits:
        why += (" (the step's first group: with the replicate axis' waits, " + ", ".join(
            f"{st} {w * 1e3:.3f} ms" for st, w in waits.items()) + ")")
    return StyleChoice(best, why, secs, colls, wire, waits)


def resolve_styles(unshard: BucketLayout, reduce: BucketLayout,
                   choice: Union[str, Mapping[str, str]], *, z3: Mapping[str, bool],
                   cost: Union[LinkCost, OpSeconds, None] = None,
                   master: Optional[BucketLayout] = None) -> dict[str, StyleChoice]:
    """:func:`choose_style` of every group of ``unshard`` (``choice``: one value for all, or
    ``{group: value}`` with ``"per_owner"`` for groups it does not name). The first group of the
    forward order is the ``boundary`` one; ``master``: the publish's layout."""
    out = {}
    for i, g in enumerate(unshard.groups):
        c = choice if isinstance(choice, str) else choice.get(g, "per_owner")
        out[g] = choose_style(unshard, reduce, g, c, z3=bool(z3.get(g, False)), cost=cost,
                              boundary=i == 0, master=master)
    return out


def check_choice(choice: Optional[object], data_parallel: str = "fsdp", *,
                 tp: bool = False, split: bool = False) -> str:
    """Validate ``dedicate_params(collectives=...)`` (and ``split``: ``split_ns > 1``) against the
    mode; returns the collectives.

    Raises:
      ValueError: not one of :data:`CHOICES`; ``"per_bucket"`` with ``data_parallel="ddp"`` (no
        shard axis).  NotImplementedError: ``"per_bucket"`` with tensor parallelism (``tp``);
        split Newton–Schulz with tensor parallelism or ``data_parallel="ddp"``."""
    if split and (tp or data_parallel == "ddp"):
        raise NotImplementedError(
            "dedicate_params(split_ns=...): split Newton–Schulz runs with FSDP2 / HSDP only, not "
            "with tensor parallelism or data_parallel='ddp'; leave split_ns at 1 there")
    if choice not in CHOICES:
        raise ValueError(f"dedicate_params: collectives must be one of {CHOICES} (\"per_owner\": "
                         "one broadcast / reduce per owner column of a hook group; "
                         "\"per_bucket\": one padded all-gather / reduce-scatter per hook group; "
                         "\"grouped\": the per-owner broadcasts / reduces of each phase as one "
                         "group call; \"sharded\": each rank keeps 1/G of a hook group's "
                         "gathered copy, gathered with one all-gather; \"auto\": chosen per group "
                         "by the cost model), got "
                         f"{choice!r}")
    if choice in ("per_bucket", "sharded") and data_parallel == "ddp":
        raise ValueError(f"dedicate_params(collectives={choice!r}) moves a hook group over the "
                         "shard axis in one all-gather; data_parallel='ddp' has no "
                         "shard axis (each gradient is reduced to its owner over the replicas). "
                         "Use collectives='per_owner' (or 'auto') with data_parallel='ddp'.")
    if choice in ("per_bucket", "sharded") and tp:
        raise NotImplementedError(
            f"dedicate_params(collectives={choice!r}) is not supported with tensor parallelism "
            "(TP-sliced matrices); use 'per_owner' or 'auto' (which stays per owner there)")
    return str(choice)


def mode_collectives(choice: str, data_parallel: str = "fsdp", *, tp: bool = False) -> str:
    """The collective style the step program is built with for a checked ``choice``
    (:func:`check_choice`): ``"per_owner"`` with tensor parallelism or ``data_parallel="ddp"``
    (their schedules move per owner), else ``choice`` itself."""
    return "per_owner" if (tp or data_parallel == "ddp") else choice
