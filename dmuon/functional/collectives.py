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
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Union

from dmuon.functional.buckets import BucketLayout, dtype_itemsize
from dmuon.functional.schedule import (STYLES, Op, Schedule, op_bytes, reduce_schedule,
                                       unshard_schedule)

__all__ = ["CHOICES", "LinkCost", "StyleChoice", "wire_bytes", "coalesced_units", "unit_seconds",
           "choose_style", "resolve_styles", "check_choice"]

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
    machine for a better choice. ``hop`` counts one per member (a ring).
    """

    alpha_s: float = 20e-6
    alpha_hop_s: float = 3e-6
    busbw_bytes_per_s: float = 40e9

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
    """

    style: str
    reason: str
    seconds: Mapping[str, float]
    collectives: Mapping[str, int]
    wire: Mapping[str, int]


def _phase_cost(scheds: list[Schedule], G: int, seconds: OpSeconds) -> tuple[float, int, int]:
    t = c = w = 0
    for sched in scheds:
        for unit in coalesced_units(op for op in sched if op.axis == "shard"):
            t += unit_seconds(unit, seconds, G)
            c += 1
            w += sum(wire_bytes(op, G) for op in unit)
    return t, c, w


def choose_style(unshard: BucketLayout, reduce: BucketLayout, group: str, choice: str, *,
                 z3: bool = False, cost: Union[LinkCost, OpSeconds, None] = None) -> StyleChoice:
    """The style of hook group ``group`` (module docstring).

    Args:
      unshard, reduce: the gather and reduce layouts.  group: the hook-group key.
      choice: one of :data:`CHOICES`.
      z3: the group is re-gathered in backward (its gather counts twice).
      cost: a :class:`LinkCost` or ``seconds(op, n)`` (the projector passes its machine model);
        default ``LinkCost()``.

    Raises:
      ValueError: ``choice`` is not one of :data:`CHOICES`.
    """
    if choice not in CHOICES:
        raise ValueError(f"collectives must be one of {CHOICES}, got {choice!r}")
    if choice != "auto":  # nothing to weigh (and nothing built)
        return StyleChoice(choice, f"{choice}: asked for", {}, {}, {})
    G = unshard.shard_size
    fn: OpSeconds = (cost.seconds if isinstance(cost, LinkCost) else cost if cost is not None
                     else LinkCost().seconds)
    secs, colls, wire = {}, {}, {}
    for style in STYLES:
        u = unshard_schedule(unshard, group, style=style)
        r = reduce_schedule(reduce, group, style=style)
        secs[style], colls[style], wire[style] = _phase_cost([u, u, r] if z3 else [u, r], G, fn)
    if G <= 1:
        return StyleChoice("per_owner", "auto: G = 1, nothing moves on the shard axis", secs,
                           colls, wire)
    order = ("per_owner", "grouped", "per_bucket")  # ties go to the earlier style
    best = min(order, key=lambda st: (secs[st], order.index(st)))
    what = lambda st: (f"{st} {colls[st]} collectives, {wire[st]} wire bytes, "  # noqa: E731
                       f"{secs[st] * 1e3:.3f} ms")
    why = f"auto: {what(best)} " + "; ".join(
        f"{'<' if secs[best] < secs[o] else '<='} {what(o)}" for o in order if o != best)
    return StyleChoice(best, why, secs, colls, wire)


def resolve_styles(unshard: BucketLayout, reduce: BucketLayout,
                   choice: Union[str, Mapping[str, str]], *, z3: Mapping[str, bool],
                   cost: Union[LinkCost, OpSeconds, None] = None) -> dict[str, StyleChoice]:
    """:func:`choose_style` of every group of ``unshard`` (``choice``: one value for all, or
    ``{group: value}`` with ``"per_owner"`` for groups it does not name)."""
    out = {}
    for g in unshard.groups:
        c = choice if isinstance(choice, str) else choice.get(g, "per_owner")
        out[g] = choose_style(unshard, reduce, g, c, z3=bool(z3.get(g, False)), cost=cost)
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
                         "group call; \"auto\": chosen per group by the cost model), got "
                         f"{choice!r}")
    if choice == "per_bucket" and data_parallel == "ddp":
        raise ValueError("dedicate_params(collectives='per_bucket') moves a hook group over the "
                         "shard axis in one all-gather / reduce-scatter; data_parallel='ddp' has no "
                         "shard axis (each gradient is reduced to its owner over the replicas). "
                         "Use collectives='per_owner' (or 'auto') with data_parallel='ddp'.")
    if choice == "per_bucket" and tp:
        raise NotImplementedError(
            "dedicate_params(collectives='per_bucket') is not supported with tensor parallelism "
            "(TP-sliced matrices); use 'per_owner' or 'auto' (which stays per owner there)")
    return str(choice)
