"""The collective ops of dmuon's communication schedules, as data (pure): lanes and axes,
``Broadcast`` / ``Reduce`` on the mesh axes, and the explicit-group ops ``AllReduce`` /
``AllGather`` (split Newton–Schulz) and ``Gather`` / ``Scatter`` (tensor parallelism's NS), and the
per-bucket shard-axis ops ``ShardAllGather`` / ``ShardReduceScatter`` (one collective per hook
group and dtype instead of one per owner column: :mod:`dmuon.functional.collectives`), and the
sharded style's ``ShardCopyGather`` / ``ShardCopyRefresh`` (a sharded compute-dtype copy of a
group's buckets, gathered as FSDP2 gathers its params).
Any op may carry a ``coalesce`` key: the ops of one launch with the same key form one group call
(the grouped style's all-gather-v / reduce-v: on NCCL one ``ncclGroupStart`` / ``End`` of the
parts; gloo and the simulator run the parts one after another, as without the key).
Their semantics and the byte-counting convention are :mod:`dmuon.functional.schedule`'s docstring;
the schedule container, builders and accounting live there.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence, Union

from dmuon.functional.buckets import BucketKey, dtype_itemsize

__all__ = ["Axis", "Lane", "LANE_AXIS", "GROUP_LANES", "Broadcast", "Reduce", "AllReduce",
           "AllGather", "Gather", "Scatter", "ShardAllGather", "ShardReduceScatter", "ShardBuckets",
           "ShardCopy", "ShardCopyGather", "ShardCopyRefresh", "FLAT_COLUMN", "COPY_COLUMN",
           "Op", "op_members", "op_root_coord"]

#: ``BucketKey.column`` of a hook group's flat buffer of one dtype (the per-bucket style's padded
#: staging, the sharded style's gathered buffer) and of a rank's part of the sharded copy
FLAT_COLUMN, COPY_COLUMN = -1, -2

Axis = Literal["shard", "replicate", "group"]
Lane = Literal["unshard", "reduce", "replicate", "split", "tp", "tp_reduce"]
LANE_AXIS: Mapping[str, str] = {"unshard": "shard", "reduce": "shard", "replicate": "replicate"}
#: Lanes of explicit-group ops: ``"tp"`` (the TP group's NS gather / scatter,
#: :mod:`dmuon.functional.tp_plan`), ``"tp_reduce"`` (the TP group's small all-reduces of an
#: owner's step: an 8-bit momentum's whole-matrix absmax, a variant's row sums,
#: :mod:`dmuon.functional.tp_step`) and ``"split"`` (split Newton–Schulz's units); the runtime's
#: executor runs them all.
GROUP_LANES: Mapping[str, str] = {"split": "group", "tp": "group", "tp_reduce": "group"}
_ALL_LANE_AXIS: Mapping[str, str] = {**LANE_AXIS, **GROUP_LANES}


@dataclass(frozen=True, kw_only=True)
class _Collective:
    id: str
    axis: str
    at: int | None
    bucket: BucketKey
    offset: int
    numel: int
    dtype: str
    lane: str
    waits: tuple[str, ...] = ()
    members: tuple[int, ...] | None = None
    #: ops of one launch with this key (non-empty) are issued as one group call (module doc)
    coalesce: str = ""

    def __post_init__(self) -> None:
        if self.axis not in ("shard", "replicate", "group"):
            raise ValueError(f"op {self.id}: axis must be 'shard', 'replicate' or 'group', "
                             f"got {self.axis!r}")
        if _ALL_LANE_AXIS.get(self.lane) != self.axis:
            raise ValueError(f"op {self.id}: lane {self.lane!r} does not run on axis {self.axis!r}; "
                             f"lanes and axes: {dict(_ALL_LANE_AXIS)}")
        if self.axis == "group":
            m = self.members
            if (self.at is not None or m is None or not m or len(set(m)) != len(m)
                    or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in m)):
                raise ValueError(f"op {self.id}: a group op needs at=None and members = distinct "
                                 f"global ranks (>= 0), got at={self.at!r}, members={m!r}")
        elif self.members is not None:
            raise ValueError(f"op {self.id}: members are for axis 'group' only")
        elif (self.axis == "shard") != (self.at is None):
            raise ValueError(f"op {self.id}: shard-axis ops run in every replica (at=None); "
                             f"replicate-axis ops need the column index `at`")
        if self.offset < 0 or self.numel < 0:
            raise ValueError(f"op {self.id}: negative offset/numel")
        if self.dtype != self.bucket.dtype:
            raise ValueError(f"op {self.id}: dtype {self.dtype} differs from its bucket's "
                             f"{self.bucket.dtype}")

    @property
    def nbytes(self) -> int:
        """Payload bytes of the op (``numel * itemsize``)."""
        return self.numel * dtype_itemsize(self.dtype)


@dataclass(frozen=True, kw_only=True)
class Broadcast(_Collective):
    """Broadcast ``bucket[offset:offset+numel]`` from index ``src`` along ``axis`` (see module doc)."""

    src: int

    @property
    def root(self) -> int:
        return self.src


@dataclass(frozen=True, kw_only=True)
class Reduce(_Collective):
    """Reduce ``bucket[offset:offset+numel]`` to index ``dst`` along ``axis`` with ``op``.

    ``op="avg"``: the destination gets the mean over the group's ranks. Non-destination buffers are
    undefined afterwards (the simulator fills them with NaN).
    """

    dst: int
    op: str = "avg"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.op not in ("avg", "sum"):
            raise ValueError(f"op {self.id}: reduce op must be 'avg' or 'sum', got {self.op!r}")

    @property
    def root(self) -> int:
        return self.dst


@dataclass(frozen=True, kw_only=True)
class AllReduce(_Collective):
    """Every member's ``bucket[offset:offset+numel]`` becomes the sum (``op="sum"``), mean
    (``"avg"``) or elementwise maximum (``"max"``) over the members (explicit group:
    ``axis="group"``, lane ``"split"`` or ``"tp"``).

    Bytes are counted as a reduce to ``members[0]`` followed by a broadcast from it (module doc).
    """

    op: str = "sum"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.axis != "group":
            raise ValueError(f"op {self.id}: AllReduce runs on an explicit group (axis='group')")
        if self.op not in ("avg", "sum", "max"):
            raise ValueError(f"op {self.id}: reduce op must be 'avg', 'sum' or 'max', got "
                             f"{self.op!r}")

    @property
    def root(self) -> int:
        return 0


@dataclass(frozen=True, kw_only=True)
class _Parts(_Collective):
    """An explicit-group op whose member ``j`` owns ``parts[j] = (offset, numel)`` of the bucket
    (disjoint, inside ``[offset, offset + numel)``)."""

    parts: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.axis != "group":
            raise ValueError(f"op {self.id}: {type(self).__name__} runs on an explicit group "
                             "(axis='group')")
        parts = tuple((int(o), int(n)) for o, n in self.parts)
        object.__setattr__(self, "parts", parts)
        if len(parts) != len(self.members):
            raise ValueError(f"op {self.id}: {len(parts)} parts for {len(self.members)} members")
        spans = sorted(p for p in parts if p[1] > 0)
        for (o1, n1), (o2, _) in zip(spans, spans[1:]):
            if o1 + n1 > o2:
                raise ValueError(f"op {self.id}: parts overlap: {parts}")
        if any(o < self.offset or n < 0 or o + n > self.offset + self.numel for o, n in parts):
            raise ValueError(f"op {self.id}: parts {parts} leave [{self.offset}, "
                             f"{self.offset + self.numel})")


@dataclass(frozen=True, kw_only=True)
class AllGather(_Parts):
    """Member ``j`` contributes ``parts[j]``; afterwards every member holds all parts."""

    @property
    def root(self) -> int:
        return 0


@dataclass(frozen=True, kw_only=True)
class Gather(_Parts):
    """Member ``j`` contributes ``parts[j]``; afterwards member ``dst`` (an index into
    ``members``) holds all parts; the others' buffers are unchanged."""

    dst: int

    @property
    def root(self) -> int:
        return self.dst


@dataclass(frozen=True, kw_only=True)
class Scatter(_Parts):
    """Member ``src`` holds every part; afterwards member ``j`` holds ``parts[j]`` (its copy of
    the other parts unchanged)."""

    src: int

    @property
    def root(self) -> int:
        return self.src


def _check_columns(op: Any) -> None:
    """``op.keys[s]``: column ``s``'s bucket of ``op``'s group and dtype, or ``None`` with
    ``op.sizes[s] == 0`` (a column owning nothing there)."""
    for s, (k, n) in enumerate(zip(op.keys, op.sizes)):
        if (k is None) != (n == 0) or n < 0 or (k is not None and (
                k.column != s or k.group != op.bucket.group or k.dtype != op.dtype)):
            raise ValueError(f"op {op.id}: part {s} ({k}, {n}) is not column {s}'s bucket "
                             f"of group {op.bucket.group!r} in {op.dtype}")


@dataclass(frozen=True, kw_only=True)
class ShardBuckets(_Collective):
    """A shard-axis op over one hook group's buckets of one dtype, one bucket per shard index.

    ``keys[s]``: the bucket of owner column ``s`` (``None`` where column ``s`` owns nothing in
    the group: its part is zeros); ``sizes[s]``: its numel (0 for ``None``). Every part is padded
    to ``numel = max(sizes)`` elements (gloo's and NCCL's all-gather / reduce-scatter need equal
    parts), and the padding is moved and counted (:func:`dmuon.functional.schedule.op_bytes`).
    ``bucket`` is ``BucketKey(group, -1, dtype)``, a name for the group's padded buffer (no such
    bucket exists in the layout); ``offset`` is 0. The executor and the simulator address the
    per-column buckets through ``keys``.
    """

    keys: tuple[BucketKey | None, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.axis != "shard":
            raise ValueError(f"op {self.id}: {type(self).__name__} runs on the shard axis")
        if len(self.keys) != len(self.sizes) or not self.keys:
            raise ValueError(f"op {self.id}: keys and sizes need one entry per shard index")
        _check_columns(self)
        if self.offset != 0 or self.numel != max(self.sizes):
            raise ValueError(f"op {self.id}: offset must be 0 and numel the largest part "
                             f"({max(self.sizes)}), got {self.offset}, {self.numel}")

    @property
    def root(self) -> int:
        return 0

    @property
    def padded_numel(self) -> int:
        """Elements each member moves per part: the largest part."""
        return self.numel

    @property
    def padding(self) -> int:
        """Padding elements over all parts (``G * numel - sum(sizes)``)."""
        return len(self.sizes) * self.numel - sum(self.sizes)


@dataclass(frozen=True, kw_only=True)
class ShardAllGather(ShardBuckets):
    """Forward gather of one hook group in one collective: shard index ``s`` contributes bucket
    ``keys[s]`` (padded); afterwards every member holds every column's bucket (in every replica)."""


@dataclass(frozen=True, kw_only=True)
class ShardReduceScatter(ShardBuckets):
    """Gradient reduce of one hook group in one collective: afterwards member ``s``'s bucket
    ``keys[s]`` holds the ``op`` (``"avg"``: mean, ``"sum"``) over the shard group of every
    member's copy of it (in every replica). The other members' copies of ``keys[s]`` are undefined
    afterwards, as after a ``Reduce`` (the simulator poisons them)."""

    op: str = "avg"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.op not in ("avg", "sum"):
            raise ValueError(f"op {self.id}: reduce op must be 'avg' or 'sum', got {self.op!r}")


@dataclass(frozen=True, kw_only=True)
class ShardCopy(_Collective):
    """A shard-axis op of the sharded style over one hook group's buckets of one dtype.

    The buckets of columns ``0 .. G-1`` (``keys[s]``, ``None`` where column ``s`` owns nothing
    in the group; ``sizes[s]`` elements) laid end to end in column order are the group's **flat
    buffer** ``bucket = BucketKey(group, FLAT_COLUMN, dtype)`` of ``G * numel`` elements (zeros
    past ``sum(sizes)``, never read), cut into ``G`` equal **parts** of ``numel = ceil(sum(sizes)
    / G)``: member ``j`` keeps part ``j`` between steps as its **copy**, ``BucketKey(group,
    COPY_COLUMN, dtype)`` of ``numel`` elements (FSDP2's sharding of a flat parameter).
    """

    keys: tuple[BucketKey | None, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        G = len(self.sizes)
        if self.axis != "shard" or self.bucket.column != FLAT_COLUMN:
            raise ValueError(f"op {self.id}: {type(self).__name__} runs on the shard axis on a "
                             f"group's flat buffer (column {FLAT_COLUMN})")
        if len(self.keys) != G or not G or sum(self.sizes) <= 0:
            raise ValueError(f"op {self.id}: keys and sizes need one entry per shard index and "
                             "a non-empty bucket")
        _check_columns(self)
        if self.offset != 0 or self.numel != -(-sum(self.sizes) // G):
            raise ValueError(f"op {self.id}: offset must be 0 and numel ceil(sum(sizes) / G) = "
                             f"{-(-sum(self.sizes) // G)}, got {self.offset}, {self.numel}")

    @property
    def root(self) -> int:
        return 0

    @property
    def copy_key(self) -> BucketKey:
        """The key of a member's copy (its part of the flat buffer)."""
        return BucketKey(self.bucket.group, COPY_COLUMN, self.dtype)

    @functools.cached_property  # (read per launch by the executor's refresh: computed once)
    def starts(self) -> tuple[int, ...]:
        """Where column ``s``'s bucket starts in the flat buffer."""
        out, at = [], 0
        for n in self.sizes:
            out.append(at)
            at += n
        return tuple(out)

    def splits(self, member: int) -> tuple[list[int], list[int]]:
        """``(numel sent to each member, numel received from each member)`` by ``member`` in a
        :class:`ShardCopyRefresh` (:meth:`moved`, in column order: the flat buffer's)."""
        G = len(self.sizes)
        return ([self.moved(member, j)[1] for j in range(G)],
                [self.moved(s, member)[1] for s in range(G)])

    def moved(self, src: int, dst: int) -> tuple[int, int]:
        """``(start in the flat buffer, numel)`` of column ``src``'s bucket inside part ``dst``."""
        a = max(self.starts[src], dst * self.numel)
        b = min(self.starts[src] + self.sizes[src], (dst + 1) * self.numel)
        return a, max(0, b - a)


@dataclass(frozen=True, kw_only=True)
class ShardCopyGather(ShardCopy):
    """Forward gather (and Z3 re-gather) of one hook group and dtype in the sharded style: every
    member's flat buffer becomes the members' copies end to end (member ``j``'s at
    ``j * numel``): one all-gather of equal parts, FSDP2's own collective, nothing padded beyond
    the last part's ``< G`` elements."""


@dataclass(frozen=True, kw_only=True)
class ShardCopyRefresh(ShardCopy):
    """The sharded copy made current after the masters changed: member ``s`` contributes its
    column's bucket ``keys[s]`` (its masters in the compute dtype, written by the gather phase)
    and member ``j``'s copy becomes part ``j`` of the flat buffer they form: an all-to-all of
    uneven parts (member ``s`` sends the pieces of its bucket that other members' parts cover,
    about ``1/G`` of a gather's bytes per rank)."""


Op = Union[Broadcast, Reduce, AllReduce, AllGather, Gather, Scatter, ShardAllGather,
           ShardReduceScatter, ShardCopyGather, ShardCopyRefresh]


def op_members(op: Op, shard_size: int, replicate_size: int) -> list[list[tuple[int, int]]]:
    """The groups that execute ``op``: a list of groups, each a list of ``(s, r)`` in axis order.

    Shard axis: R groups ``[(0, r), ..., (G-1, r)]``; replicate axis: one group
    ``[(at, 0), ..., (at, R-1)]``; explicit group: one group, the members' coordinates
    ``(g % G, g // G)`` in ``members`` order.
    """
    if op.axis == "shard":
        return [[(s, r) for s in range(shard_size)] for r in range(replicate_size)]
    if op.axis == "group":
        return [[(g % shard_size, g // shard_size) for g in op.members]]
    return [[(op.at, r) for r in range(replicate_size)]]


def op_root_coord(op: Op, group: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The root ``(s, r)`` of ``op`` inside one of its groups (index ``op.root`` along the axis)."""
    return group[op.root]
