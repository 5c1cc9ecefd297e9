"""Which collectives move a hook group: one per owner column, or one per bucket (pure).

A hook group's dedicated matrices sit in one flat bucket per owner column ``s`` (and dtype,
:mod:`dmuon.functional.buckets`). Two styles move them over the shard axis
(:data:`dmuon.functional.schedule.STYLES`):

``"per_owner"`` (the default, dmuon's original schedule)
    forward (and Z3 backward) gather: one ``Broadcast`` per bucket from its column; gradient
    reduce: one ``Reduce`` per bucket to its column. ``k`` owner columns in the group → ``k``
    collectives per phase, each moving exactly its bucket.
``"per_bucket"`` (MatrixFSDP's pattern)
    one ``ShardAllGather`` / ``ShardReduceScatter`` per group and dtype over all ``G`` shard
    indices, each index's part padded to the largest bucket (a column without a bucket sends
    zeros). One collective per phase, but ``G * max`` elements instead of ``sum``.

``"auto"`` chooses per group with an α–β cost model of one collective on the shard group:
``seconds = alpha + hops * alpha_hop + wire_bytes / busbw``, where ``wire_bytes`` is what a
pipelined ring / tree moves through its busiest member: from the one byte count
(:func:`~dmuon.functional.schedule.op_bytes`), the smallest over members of ``max(sent,
received)`` (``P`` for a broadcast or reduce of ``P`` bytes, ``(n-1) * padded P`` for the
per-bucket ops). A group's cost is its gather (twice under Z3: forward and backward re-gather)
plus its reduce; ``"per_bucket"`` is chosen when it is strictly cheaper, so latency-bound groups
(many small owners, large ``G``) go per bucket and groups where padding dominates (a few owners
of a large ``G``, very unequal buckets) stay per owner. Every choice carries its reason
(:class:`StyleChoice`), which the step program records per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

from dmuon.functional.buckets import BucketLayout
from dmuon.functional.schedule import (STYLES, Op, Schedule, op_bytes, reduce_schedule,
                                       unshard_schedule)

__all__ = ["CHOICES", "LinkCost", "StyleChoice", "wire_bytes", "choose_style", "resolve_styles",
           "check_choice"]

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
      style: ``"per_owner"`` or ``"per_bucket"``.  reason: one readable line.
      seconds: ``{style: projected seconds of the group's gathers + reduce}``.
      collectives: ``{style: shard-axis collectives per step}``.
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
        for op in sched:
            if op.axis != "shard":
                continue
            t += seconds(op, G)
            c += 1
            w += wire_bytes(op, G)
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
    best = "per_bucket" if secs["per_bucket"] < secs["per_owner"] else "per_owner"
    other = "per_owner" if best == "per_bucket" else "per_bucket"
    why = (f"auto: {best} {colls[best]} collectives, {wire[best]} wire bytes, "
           f"{secs[best] * 1e3:.3f} ms {'<' if secs[best] < secs[other] else '<='} {other} "
           f"{colls[other]} collectives, {wire[other]} wire bytes, {secs[other] * 1e3:.3f} ms")
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
                         f"\"auto\": chosen per group by the cost model), got {choice!r}")
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
