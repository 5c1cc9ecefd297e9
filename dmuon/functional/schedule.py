"""Explicit communication schedules of dedicated params: ops as data, builders, byte accounting.

A schedule is an ordered tuple of collective ops over a mesh ``(R, G)`` (see :mod:`buckets`):

``Broadcast``
    over one axis from index ``src`` along it. ``axis="shard"``: runs in every replica ``r``
    (``at=None``), i.e. in each of the R shard groups ``{(s', r) : s'}``; ``axis="replicate"``: runs
    in the replicate group of column ``at`` only, ``{(at, r') : r'}``.
``Reduce``
    same addressing, destination ``dst``, reduction ``op`` (``"avg"`` or ``"sum"``). Only the
    destination's buffer holds a defined result afterwards (a gloo reduce overwrites the others).

``AllReduce`` / ``AllGather`` (split Newton–Schulz, :mod:`dmuon.functional.split_ns`)
    over an explicit group (``axis="group"``, ``at=None``, ``members``: global ranks in block
    order) on lane ``"split"``. ``AllReduce``: every member's range becomes the sum (``"sum"``) or
    mean (``"avg"``) of all members' ranges. ``AllGather``: member ``j`` contributes
    ``parts[j] = (offset, numel)`` (disjoint sub-ranges of ``[offset, offset + numel)``); afterwards
    every member holds every part. Shard/replicate ops may also run on an explicit group (``axis=
    "group"``, lane ``"split"``): a ``Broadcast`` / ``Reduce`` whose ``src`` / ``dst`` indexes
    ``members``.

Every op reads/writes the 1-D sub-range ``[offset, offset + numel)`` of bucket ``bucket`` on each
participating rank, runs on a ``lane`` (``"unshard"``, ``"reduce"``: shard axis; ``"replicate"``:
replicate axis; each lane has its own process groups and, on CUDA, its own stream; ``"split"``:
explicit groups, not run by the stateful executor) and starts after the ops listed in ``waits``
(ids of earlier ops of the same schedule) have completed.

Builders (all pure, built once at setup):

* :func:`unshard_schedule` — forward (and Z3 backward re-) unshard of one hook group: one shard-axis
  Broadcast per bucket from its owner column ``s``, in every replica (``style="per_bucket"``: one
  ``ShardAllGather`` of the group's buckets per dtype, :mod:`dmuon.functional.collectives`).
* :func:`reduce_schedule` — backward gradient reduce of one hook group. Stage 1: shard-axis Reduce
  (average) of the whole bucket to column ``s`` in every replica. Stage 2 (R > 1): for each owner
  replica ``r``'s contiguous range, a replicate-axis Reduce (average) inside column ``s`` to ``r``,
  waiting on stage 1. Net: ``mean over all G*R ranks`` at the global owner ``(s, r)``, because the
  mean over R of means over G equals the mean over G*R. ``style="per_bucket"``: stage 1 is one
  ``ShardReduceScatter`` per dtype.
* :func:`publish_schedule` — post-step HSDP publish: for each range, a replicate-axis Broadcast
  inside column ``s`` from owner ``r``.
* :func:`refresh_schedule` — the sharded style's copy made current after the masters changed.

``style="grouped"``: the per-owner ops of each phase (the gather's broadcasts, the stage-1 reduces,
the stage-2 reduces, placed after stage 1, and the publish's broadcasts) carry one ``coalesce`` key
per phase and group: one group call on NCCL, the same ops, bytes and order otherwise.

A whole step's phases, built from these once per model, are :mod:`dmuon.functional.program`.

Byte-counting convention (logical payload, star model of a collective): for one op with payload
``P = numel * itemsize`` executed in a group of ``n`` ranks,

* Broadcast: the source **sends** ``(n-1)*P``, each of the other ``n-1`` ranks **receives** ``P``;
* Reduce: each of the ``n-1`` non-destination ranks **sends** ``P``, the destination **receives**
  ``(n-1)*P``.

* AllReduce (star: reduce to ``members[0]``, then broadcast from it): ``members[0]`` sends and
  receives ``(n-1)*P``, every other member sends and receives ``P``;
* AllGather: member ``j`` sends its part ``P_j`` to each of the others (``(n-1)*P_j``) and receives
  every other part (``P - P_j``, with ``P`` the sum of the parts).
* ShardAllGather / ShardReduceScatter (one collective per hook group and dtype, every part padded
  to the largest, ``P`` = the padded part's bytes): every member sends and receives ``(n-1)*P``
  (the all-gather: its part to each other member; the reduce-scatter: each other member's part of
  its copy). Padding is payload: it crosses the links.
* ShardCopyGather (the sharded style's all-gather of equal parts of ``P`` bytes): every member
  sends and receives ``(n-1)*P``. ShardCopyRefresh (an all-to-all): member ``s`` sends the pieces
  of its column's bucket that the other members' parts cover and receives the pieces of its own
  part that the other members' buckets cover.

So for every Broadcast, Reduce and AllGather the totals over ranks are ``sent == received ==
(n-1)*P`` and for an AllReduce ``2(n-1)*P``. For dedicated params of
``P`` bytes on a shard group of ``N`` ranks, one forward unshard + one backward reduce give a
per-rank average of ``2(N-1)/N * P`` sent (and the same received): the spec's Z2 figure; Z3 adds a
backward re-unshard: ``3(N-1)/N * P``. In HSDP the shard-axis ops run in every replica (same
per-rank averages with ``N = G``), stage 2 adds ``(R-1)*P`` in total over all ranks and the
publish another ``(R-1)*P``. Groups of one rank move nothing (executors issue nothing for them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

from dmuon.functional.buckets import BucketKey, BucketLayout, dtype_itemsize
from dmuon.functional.schedule_ops import (  # the ops, re-exported here
    GROUP_LANES, LANE_AXIS, AllGather, AllReduce, Axis, Broadcast, Gather, Lane, Op, Reduce, Scatter,
    COPY_COLUMN, FLAT_COLUMN, ShardAllGather, ShardBuckets, ShardCopy, ShardCopyGather,
    ShardCopyRefresh, ShardReduceScatter, op_members, op_root_coord)
from dmuon.functional.traffic import LANES, Traffic

__all__ = [
    "Axis", "Lane", "LANES", "LANE_AXIS", "GROUP_LANES", "Broadcast", "Reduce", "AllReduce",
    "AllGather", "Gather", "Scatter", "ShardAllGather", "ShardReduceScatter", "ShardBuckets",
    "ShardCopy", "ShardCopyGather", "ShardCopyRefresh", "FLAT_COLUMN", "COPY_COLUMN",
    "refresh_schedule",
    "Op", "Schedule", "Traffic", "STYLES",
    "unshard_schedule", "reduce_schedule", "publish_schedule", "schedule_traffic",
    "op_members", "op_root_coord",
    "op_rank_index", "op_bytes",
]


# ---------------------------------------------------------------------------------------------
# byte accounting

def op_rank_index(op: Op, shard_size: int, index: int) -> tuple[int, int] | None:
    """Where rank ``index`` stands in ``op``: ``(position in its group, group size)``, or ``None``
    when it takes no part. ``index`` is ``r * G + s`` for shard / replicate ops and the global rank
    (an entry of ``members``) for explicit-group ops."""
    if op.axis == "group":
        return (op.members.index(index), len(op.members)) if index in op.members else None
    s, r = index % shard_size, index // shard_size
    if op.axis == "shard":
        return s, shard_size
    return None if s != op.at else (r, -1)  # the replicate group's size is R (the caller's)


def op_bytes(op: Op, position: int, size: int) -> tuple[int, int]:
    """``(sent, received)`` payload bytes of the member at ``position`` of a group of ``size``
    ranks executing ``op`` (the convention of the module docstring; ``(0, 0)`` in a group of one).
    The one byte count of dmuon: schedules' :class:`Traffic`, the executor's counters and every
    figure derived from them come from here."""
    n = size
    if n <= 1:
        return 0, 0
    is_root = position == op.root
    if isinstance(op, (AllGather, Gather, Scatter)):
        isz = dtype_itemsize(op.dtype)
        mine = op.parts[position][1] * isz
        total = sum(p[1] for p in op.parts) * isz
        if isinstance(op, AllGather):
            return (n - 1) * mine, total - mine
        if isinstance(op, Gather):  # every part into the root
            return (0, total - mine) if is_root else (mine, 0)
        return (total - mine, 0) if is_root else (0, mine)  # Scatter: each part out of the root
    P = op.nbytes
    if isinstance(op, ShardCopyRefresh):  # what does not stay on the member itself
        send, recv = op.splits(position)
        isz = dtype_itemsize(op.dtype)
        return (sum(send) - send[position]) * isz, (sum(recv) - recv[position]) * isz
    if isinstance(op, (ShardBuckets, ShardCopyGather)):  # padded parts: the same both ways for every member
        return (n - 1) * P, (n - 1) * P
    if isinstance(op, AllReduce):
        k = (n - 1) * P if is_root else P
        return k, k
    if isinstance(op, Broadcast):
        return ((n - 1) * P, 0) if is_root else (0, P)
    return (0, (n - 1) * P) if is_root else (P, 0)  # Reduce


def schedule_traffic(schedule: "Schedule") -> Traffic:
    """Bytes sent/received per lane and rank for one execution of ``schedule``
    (:func:`op_bytes` for every op and rank)."""
    G, R = schedule.shard_size, schedule.replicate_size
    W = G * R
    lanes = tuple(dict.fromkeys(LANES + tuple(op.lane for op in schedule.ops)))
    sent = {lane: [0] * W for lane in lanes}
    recv = {lane: [0] * W for lane in lanes}
    coll = {lane: [0] * W for lane in lanes}
    for op in schedule.ops:
        for g in range(W):
            where = op_rank_index(op, G, g)
            if where is None:
                continue
            pos, size = where
            size = R if size < 0 else size
            if size <= 1:
                continue
            a, b = op_bytes(op, pos, size)
            coll[op.lane][g] += 1
            sent[op.lane][g] += a
            recv[op.lane][g] += b
    t = lambda d: {k: tuple(v) for k, v in d.items()}  # noqa: E731
    return Traffic(W, t(sent), t(recv), t(coll))


# ---------------------------------------------------------------------------------------------
# the schedule container

@dataclass(frozen=True)
class Schedule:
    """An ordered tuple of ops on mesh ``(R, G)``; ``waits`` point to earlier ops of the tuple.

    Iterable and sized; ``a + b`` concatenates (ids must stay unique).
    """

    ops: tuple[Op, ...]
    shard_size: int
    replicate_size: int
    _index: Mapping[str, int] = field(default=None, repr=False, compare=False)  # type: ignore

    def __post_init__(self) -> None:
        index: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            if op.id in index:
                raise ValueError(f"duplicate op id {op.id!r} in schedule")
            for w in op.waits:
                if w not in index:
                    raise ValueError(f"op {op.id!r} waits on {w!r}, which is not an earlier op of "
                                     f"this schedule")
            if op.axis == "shard" and not 0 <= op.root < self.shard_size:
                raise ValueError(f"op {op.id!r}: root {op.root} outside shard size {self.shard_size}")
            if op.axis == "group" and not (all(m < self.world_size for m in op.members)
                                           and 0 <= op.root < len(op.members)):
                raise ValueError(f"op {op.id!r}: members {op.members} / root {op.root} outside the "
                                 f"mesh of {self.world_size} ranks")
            if op.axis == "replicate" and not (0 <= op.root < self.replicate_size
                                               and 0 <= op.at < self.shard_size):
                raise ValueError(f"op {op.id!r}: root/column outside the mesh")
            index[op.id] = i
        first: dict[str, Op] = {}  # a coalesced set: one lane, waits only on ops before it
        for op in self.ops:
            if op.coalesce:
                head = first.setdefault(op.coalesce, op)
                if head.lane != op.lane or any(index[w] >= index[head.id] for w in op.waits):
                    raise ValueError(f"op {op.id!r}: the ops coalesced as {op.coalesce!r} must "
                                     f"run on one lane and wait only on ops before the first of "
                                     f"them ({head.id!r})")
        object.__setattr__(self, "_index", index)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def __add__(self, other: "Schedule") -> "Schedule":
        if (other.shard_size, other.replicate_size) != (self.shard_size, self.replicate_size):
            raise ValueError("cannot concatenate schedules of different meshes")
        return Schedule(self.ops + other.ops, self.shard_size, self.replicate_size)

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size

    def op(self, op_id: str) -> Op:
        return self.ops[self._index[op_id]]

    def by_lane(self, lane: str) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.lane == lane)

    def bucket_keys(self) -> tuple[BucketKey, ...]:
        """Distinct buckets touched, in first-use order."""
        return tuple(dict.fromkeys(op.bucket for op in self.ops))

    def traffic(self) -> Traffic:
        return schedule_traffic(self)

    def dump(self) -> str:
        """One readable line per op, then per-lane byte totals."""
        G, R = self.shard_size, self.replicate_size
        lines = [f"Schedule G={G} R={R} ops={len(self.ops)}"]
        for i, op in enumerate(self.ops):
            kind = ("broadcast" if isinstance(op, Broadcast) else "shard_all_gather"
                    if isinstance(op, ShardAllGather) else f"reduce_scatter[{op.op}]"
                    if isinstance(op, ShardReduceScatter) else "all_gather"
                    if isinstance(op, AllGather) else "gather" if isinstance(op, Gather)
                    else "scatter" if isinstance(op, Scatter) else f"all_reduce[{op.op}]"
                    if isinstance(op, AllReduce) else f"reduce[{op.op}]")
            where = ("every replica" if op.axis == "shard" else f"column s={op.at}"
                     if op.axis == "replicate" else f"ranks {list(op.members)}")
            role = (f"src={op.src}" if isinstance(op, (Broadcast, Scatter)) else f"dst={op.dst}"
                    if isinstance(op, (Reduce, Gather)) else "")
            waits = (f" waits={list(op.waits)}" if op.waits else "") + (
                f" group={op.coalesce}" if op.coalesce else "")
            lines.append(f"  {i:>3} {op.lane:<9} {kind:<12} axis={op.axis:<9} {where:<14} {role:<6} "
                         f"{op.bucket}[{op.offset}:{op.offset + op.numel}] "
                         f"({op.nbytes} B) id={op.id}{waits}")
        tr = self.traffic()
        for lane in tr.lanes:
            if any(tr.collectives[lane]):
                lines.append(f"  lane {lane}: sent total {tr.total_sent([lane])} B, received total "
                             f"{tr.total_received([lane])} B, mean/rank "
                             f"{tr.mean_sent([lane]):.1f} B")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# builders

def _mk(layout: BucketLayout, ops: list[Op]) -> Schedule:
    return Schedule(tuple(ops), layout.shard_size, layout.replicate_size)


#: The collective styles of a hook group's phases: one broadcast / reduce per owner column's
#: bucket; one padded all-gather / reduce-scatter per hook group and dtype; or the per-owner ops
#: of each phase as one group call (``coalesce``: all-gather-v / reduce-v, nothing padded).
STYLES = ("per_owner", "per_bucket", "grouped", "sharded")
#: the styles whose per-owner ops of a phase are one group call (the sharded style's reduces and
#: publishes are the grouped style's)
_GROUP_CALLS = ("grouped", "sharded")


def _check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"collective style must be one of {STYLES}, got {style!r}")


def _tag(style: str, phase: str, group: str) -> str:
    """The ``coalesce`` key of a grouped phase's ops ("" for the other styles)."""
    return f"{phase}/{group or '<root>'}" if style in _GROUP_CALLS else ""


def _by_dtype(layout: BucketLayout, group: str) -> dict[str, list]:
    """``{dtype: [bucket of column s or None for s in range(G)]}`` of one group, dtypes in
    first-use order."""
    out: dict[str, list] = {}
    for b in layout.buckets_of(group):
        out.setdefault(b.key.dtype, [None] * layout.shard_size)[b.key.column] = b
    return out


def _shard_op(cls: type, prefix: str, group: str, dtype: str, cols: list, **kw) -> ShardBuckets:
    sizes = tuple(0 if b is None else b.numel for b in cols)
    part = -(-sum(sizes) // len(sizes)) if issubclass(cls, ShardCopy) else max(sizes)
    return cls(id=f"{prefix}/{group or '<root>'}|all|{dtype.replace('torch.', '')}", axis="shard",
               at=None, bucket=BucketKey(group, FLAT_COLUMN, dtype), offset=0, numel=part,
               dtype=dtype, keys=tuple(None if b is None else b.key for b in cols), sizes=sizes,
               **kw)


def unshard_schedule(layout: BucketLayout, group: str, *, lane: str = "unshard",
                     style: str = "per_owner") -> Schedule:
    """Forward unshard of one hook group: per bucket ``(group, s, dtype)`` one shard-axis Broadcast of
    the whole bucket from ``s``, in every replica (HSDP masters live on all of column ``s``);
    ``style="per_bucket"``: per dtype one :class:`ShardAllGather` of the group's buckets instead;
    ``"sharded"``: per dtype one :class:`ShardCopyGather` of the ranks' copies.

    Args:
      layout: the bucket layout.  group: hook-group key.
      lane: ``"unshard"`` (default). Must be a shard-axis lane.
      style: one of :data:`STYLES`.
    """
    _check_style(style)
    ops: list[Op] = []
    if style in ("per_bucket", "sharded"):
        cls = ShardAllGather if style == "per_bucket" else ShardCopyGather
        for dt, cols in _by_dtype(layout, group).items():
            ops.append(_shard_op(cls, "unshard", group, dt, cols, lane=lane))
        return _mk(layout, ops)
    tag = _tag(style, "unshard", group)
    for b in layout.buckets_of(group):
        k = b.key
        ops.append(Broadcast(id=f"unshard/{k}", axis="shard", at=None, bucket=k, offset=0,
                             numel=b.numel, dtype=k.dtype, lane=lane, src=k.column,
                             coalesce=tag))
    return _mk(layout, ops)


def reduce_schedule(layout: BucketLayout, group: str, *, op: str = "avg",
                    replicate: bool = True, style: str = "per_owner") -> Schedule:
    """Backward gradient reduce of one hook group (two stages in HSDP, see module doc).

    Stage 1 (lane ``"reduce"``): per bucket, shard-axis Reduce of the whole bucket to column ``s`` in
    every replica. Stage 2 (lane ``"replicate"``, only when R > 1 and ``replicate``): per owner
    replica ``r`` with entries in the bucket, a replicate-axis Reduce of ``r``'s range inside column
    ``s`` to ``r``, waiting on that bucket's stage 1. With ``op="avg"`` the owner ends with the mean
    over G*R ranks; with ``"sum"`` the sum. ``replicate=False``: stage 1 only (every replica's
    column ``s`` ends with its own replica's reduction; a checkpoint load uses it).
    ``style="per_bucket"``: stage 1 is one :class:`ShardReduceScatter` per dtype of the group's
    buckets (each stage-2 reduce waits on its dtype's). ``"sharded"``: the grouped reduces.
    """
    _check_style(style)
    ops: list[Op] = []
    R = layout.replicate_size
    if style == "per_bucket":
        for dt, cols in _by_dtype(layout, group).items():
            s1 = _shard_op(ShardReduceScatter, "reduce", group, dt, cols, lane="reduce", op=op)
            ops.append(s1)
            for b in (c for c in cols if c is not None and R > 1 and replicate):
                k = b.key
                for r, off, n in b.ranges:
                    ops.append(Reduce(id=f"reduce2/{k}/r{r}", axis="replicate", at=k.column,
                                      bucket=k, offset=off, numel=n, dtype=k.dtype,
                                      lane="replicate", dst=r, op=op, waits=(s1.id,)))
        return _mk(layout, ops)
    stage2: list[Op] = []  # grouped: after every stage-1 reduce (its group call waits on them)
    for b in layout.buckets_of(group):
        k = b.key
        s1 = Reduce(id=f"reduce/{k}", axis="shard", at=None, bucket=k, offset=0, numel=b.numel,
                    dtype=k.dtype, lane="reduce", dst=k.column, op=op,
                    coalesce=_tag(style, "reduce", group))
        ops.append(s1)
        if R > 1 and replicate:
            for r, off, n in b.ranges:
                (stage2 if style in _GROUP_CALLS else ops).append(Reduce(
                    id=f"reduce2/{k}/r{r}", axis="replicate", at=k.column, bucket=k, offset=off,
                    numel=n, dtype=k.dtype, lane="replicate", dst=r, op=op, waits=(s1.id,),
                    coalesce=_tag(style, "reduce2", group)))
    return _mk(layout, ops + stage2)


def refresh_schedule(layout: BucketLayout, group: str) -> Schedule:
    """The sharded style's copy of hook group ``group`` made current from the masters (after a
    step or a load changed them): per dtype one :class:`ShardCopyRefresh` (lane ``"unshard"``), in
    every replica."""
    return _mk(layout, [_shard_op(ShardCopyRefresh, "refresh", group, dt, cols, lane="unshard")
                        for dt, cols in _by_dtype(layout, group).items()])


def publish_schedule(layout: BucketLayout, group: str | Sequence[str] | None = None, *,
                     style: str = "per_owner") -> Schedule:
    """Post-step HSDP publish: per bucket and owner replica ``r``, a replicate-axis Broadcast of ``r``'s
    range inside column ``s`` from ``r`` (lane ``"replicate"``). ``group``: one key, several, or
    ``None`` for all groups in forward order. Empty when R == 1. ``style="grouped"``: each
    group's broadcasts are one group call (a rank takes part in its column's only); so are
    ``"sharded"``'s.
    """
    _check_style(style)
    if group is None:
        groups: Sequence[str] = layout.groups
    elif isinstance(group, str):
        groups = [group]
    else:
        groups = list(group)
    ops: list[Op] = []
    if layout.replicate_size > 1:
        for g in groups:
            for b in layout.buckets_of(g):
                k = b.key
                for r, off, n in b.ranges:
                    ops.append(Broadcast(id=f"publish/{k}/r{r}", axis="replicate", at=k.column,
                                         bucket=k, offset=off, numel=n, dtype=k.dtype,
                                         lane="replicate", src=r,
                                         coalesce=_tag(style, "publish", g)))
    return _mk(layout, ops)
