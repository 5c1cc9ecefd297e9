"""Runs :mod:`dmuon.functional.schedule` ops with ``torch.distributed`` (gloo on CPU, NCCL on CUDA):
``Executor.launch(ops, buffers)`` is non-blocking and returns a :class:`Pending`; ``wait()`` makes
the results usable. Each lane keeps its ops in launch order on its own process groups (CPU: one
FIFO per lane; CUDA: one stream per lane), so ranks that interleave lanes differently cannot
deadlock.

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.executor".
"""
from __future__ import annotations

import logging
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.compat.torch_api import coalesced_calls
from dmuon.functional.buckets import BucketKey
from dmuon.functional.rank_report import collective_failure
from dmuon.functional.schedule import (LANES, AllGather, AllReduce, Broadcast, Gather, Op, Reduce,
                                       Schedule, Scatter, ShardBuckets, ShardCopy, op_bytes)
from dmuon.kernels.streams import side_stream
from dmuon.stateful.runtime.process_groups import MeshGroups, make_process_groups
from dmuon.stateful.runtime.shard_buckets import Works, shard_buckets, shard_copy

log = logging.getLogger(__name__)

__all__ = ["Executor", "Pending", "mesh_executor"]

_REDUCE_OPS = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
#: a lane's counters (:meth:`Executor.counters`)
_COUNTS = ("collectives", "sent_bytes", "received_bytes")


@dataclass(eq=False)
class _Rec:
    """One op on this rank: its view, dependencies and, once issued, its handle or end event."""

    op: Op
    seq: int
    view: Tensor | None            # None: this rank does not take part (or trivial group skipped)
    group: Any = None
    root: int = -1                  # global rank of the root
    group_size: int = 1
    position: int = 0               # this rank's index in the op's group
    part_only: bool = False         # a Gather / Scatter member other than the root gave its part
    bufs: tuple = ()                # a ShardBuckets op: this rank's bucket of every column (or None)
    deps: list["_Rec"] = field(default_factory=list)
    issued: bool = False
    handle: Any = None              # gloo work handle
    event: Any = None               # CUDA end event
    executor: Any = None            # for the context of a failed wait

    def complete(self) -> bool:
        """Finished on this rank (a skipped op: when its own dependencies are)."""
        if not self.issued:
            return False
        if self.handle is not None:
            return bool(self.handle.is_completed())
        if self.event is not None:
            return bool(self.event.query())
        return all(d.complete() for d in self.deps)

    def wait_host(self) -> None:
        """CPU: block until complete (through skipped ops to their dependencies); an op still
        queued is issued first, with the ops before it in its lane."""
        if not self.issued:
            self.executor._drain([self])
        if self.handle is not None:
            try:
                self.handle.wait()
            except RuntimeError as e:  # gloo: timeout, or a peer's pair closed
                raise self.executor.collective_error(self, e) from e
        elif self.event is None:
            for d in self.deps:
                d.wait_host()

    def events(self) -> list:
        """CUDA: the events that mark this op done on this rank (a skipped op: its deps' events)."""
        if self.event is not None:
            return [self.event]
        return [e for d in self.deps for e in d.events()]


def _parts(rec: _Rec) -> list[Tensor]:
    """The members' parts of an explicit-group op, as views of this rank's range (a member that
    passed only its own part: that part alone, at its position)."""
    if rec.part_only:
        return [rec.view if j == rec.position else None for j in range(len(rec.op.parts))]
    return [rec.view.narrow(0, o - rec.op.offset, n) for o, n in rec.op.parts]


def _collective(rec: _Rec) -> Any:
    """Issue ``rec``'s collective on its view (async); returns the work handle."""
    op, kw = rec.op, dict(group=rec.group, async_op=True)
    if isinstance(op, ShardBuckets):
        return shard_buckets(rec.op, rec.position, rec.bufs, _REDUCE_OPS, kw)
    if isinstance(op, ShardCopy):
        return shard_copy(op, rec.position, *rec.bufs, kw)
    if isinstance(op, Broadcast):
        return dist.broadcast(rec.view, src=rec.root, **kw)
    if isinstance(op, Reduce):
        return dist.reduce(rec.view, dst=rec.root, op=_REDUCE_OPS[op.op], **kw)
    if isinstance(op, AllReduce):
        return dist.all_reduce(rec.view, op=_REDUCE_OPS[op.op], **kw)
    parts = _parts(rec)
    mine = parts[rec.position]
    # uneven parts (gloo's and NCCL's collectives need equal sizes), or members not in the
    # group's rank order (the collectives order parts by group rank): explicit peers instead
    if len({n for _, n in op.parts}) > 1 or list(op.members) != sorted(op.members):
        return _uneven(rec, parts, mine, kw)
    if isinstance(op, Gather):
        return dist.gather(mine, parts if rec.position == op.root else None, dst=rec.root, **kw)
    if isinstance(op, Scatter):
        return dist.scatter(mine, parts if rec.position == op.root else None, src=rec.root, **kw)
    return dist.all_gather(parts, mine.clone(), **kw)  # AllGather


def _uneven(rec: _Rec, parts: list, mine: Tensor, kw: dict) -> Works:
    """An explicit-group op with uneven parts (or members out of rank order): one broadcast per
    part (all-gather) or point-to-point sends / receives with the root (gather / scatter)."""
    op, group = rec.op, kw["group"]
    if isinstance(op, AllGather):
        return Works([dist.broadcast(p, src=op.members[j], **kw) for j, p in enumerate(parts)])
    to_root = isinstance(op, Gather)  # a gather's parts go to the root, a scatter's come from it
    if rec.position != op.root:
        return Works([(dist.isend if to_root else dist.irecv)(mine, rec.root, group=group)])
    return Works([(dist.irecv if to_root else dist.isend)(p, op.members[j], group=group)
                  for j, p in enumerate(parts) if j != op.root and p.numel() > 0])


class Pending:
    """Handle of one :meth:`Executor.launch`. ``wait()`` is idempotent."""

    def __init__(self, executor: "Executor", recs: list[_Rec], device_type: str):
        self._ex = executor
        self._recs = recs
        self._device_type = device_type

    def is_completed(self) -> bool:
        """Non-blocking: all ops issued and finished (on CUDA: their end events have fired)."""
        if self._device_type != "cuda":
            self._ex.poll()
        return all(r.complete() for r in self._recs)

    def wait(self) -> None:
        """CPU: issue what is still queued (blocking on dependencies) and wait on every work handle.
        CUDA: make the current stream wait on the ops' end events (no host synchronization)."""
        if self._device_type == "cuda":
            dev = next(r.view.device for r in self._recs if r.view is not None)
            cur = torch.cuda.current_stream(dev)
            for ev in {id(e): e for r in self._recs for e in r.events()}.values():
                cur.wait_event(ev)
        else:
            if self._recs:
                self._ex._drain(self._recs)
            for r in self._recs:
                r.wait_host()


class Executor:
    """Executes schedule ops on this rank with the lane process groups of ``groups``.

    Args:
      groups: from :func:`dmuon.stateful.runtime.process_groups.make_process_groups`.
      issue_trivial: also issue collectives on groups of one rank (no-ops; useful to exercise the
        lanes at world size 1)."""

    def __init__(self, groups: MeshGroups, *, issue_trivial: bool = False):
        self.groups = groups
        self.issue_trivial = issue_trivial
        # CPU: per lane, launched and not yet issued, in launch order
        self._queues: dict[str, deque[_Rec]] = defaultdict(deque)
        self._seq = 0
        self._streams: dict[tuple[int, str], Any] = {}
        self.reset_counters()

    # ----------------------------------------------------------------------------- counters
    def counters(self) -> dict[str, dict[str, int]]:
        """``{lane: {"collectives", "sent_bytes", "received_bytes"}}`` for this rank (a copy): the
        three mesh lanes always, an explicit-group lane (``"tp"``) once it ran."""
        return {lane: dict(c) for lane, c in self._counters.items()}

    def reset_counters(self) -> None:
        self._counters = {lane: dict.fromkeys(_COUNTS, 0) for lane in LANES}

    def _count(self, rec: _Rec) -> None:
        """Count ``rec`` on this rank (:func:`~dmuon.functional.schedule.op_bytes`)."""
        c = self._counters.setdefault(rec.op.lane, dict.fromkeys(_COUNTS, 0))
        for k, v in zip(_COUNTS, (1, *op_bytes(rec.op, rec.position, rec.group_size))):
            c[k] += v

    _LANE_WHAT = {"unshard": "weight gather (forward / backward pre-hook)",
                  "reduce": "gradient reduce (backward)",
                  "replicate": "HSDP replicate-axis collective (stage-2 gradient reduce or "
                               "post-step publish)"}

    def collective_error(self, rec: "_Rec", err: BaseException) -> RuntimeError:
        """The error raised when waiting on ``rec``'s collective fails: which dmuon operation,
        hook group, ranks and timeout, and what usually causes it."""
        op, mg = rec.op, self.groups
        ranks = mg.op_ranks(op)
        return RuntimeError(collective_failure(
            f"{self._LANE_WHAT.get(op.lane, op.lane)} {op.id!r} ({type(op).__name__}, lane "
            f"{op.lane!r}, hook group {op.bucket.group or '<root>'!r}, process group of ranks "
            f"{ranks}, root rank {rec.root})", ranks, mg.rank, mg.timeout, err,
            "dmuon's process groups are unusable now; restart the job. "))

    # ----------------------------------------------------------------------------- streams
    def lane_stream(self, lane: str, device: torch.device):
        """The CUDA stream of ``lane`` on ``device`` (created once; shard-axis lanes high priority)."""
        key = (device.index if device.index is not None else torch.cuda.current_device(), lane)
        st = self._streams.get(key)
        if st is None:  # the process's stream of the lane (a rebuilt model reuses it)
            st = side_stream(key[0], f"lane:{lane}", high_priority=lane in ("unshard", "reduce"))
            self._streams[key] = st
        return st

    # ----------------------------------------------------------------------------- launch
    def _record(self, op: Op, buffers: Mapping[BucketKey, Tensor], by_id: dict[str, _Rec],
                after: list[_Rec]) -> _Rec:
        mg = self.groups
        ranks = mg.op_ranks(op)
        takes_part, root, n = mg.rank in ranks, ranks[op.root], len(ranks)
        pos = ranks.index(mg.rank) if takes_part else -1
        deps = []
        for w in op.waits:
            if w not in by_id:
                raise ValueError(f"op {op.id!r} waits on {w!r}, which is not an earlier op of this "
                                 f"launch; pass the earlier launch's Pending as `after`")
            deps.append(by_id[w])
        rec = _Rec(op=op, seq=self._seq, view=None, root=root, group_size=n, position=pos,
                   deps=deps + after, executor=self)
        self._seq += 1
        if not takes_part or (n <= 1 and not self.issue_trivial):
            return rec
        rec.group = mg.member_group(op.members) if op.axis == "group" else mg.groups[op.lane]
        if isinstance(op, ShardBuckets):
            rec.bufs = tuple(None if k is None else self._bucket(op, k, n_, buffers)
                             for k, n_ in zip(op.keys, op.sizes))
            rec.view = next(b for b in rec.bufs if b is not None).narrow(0, 0, 0)
            return rec
        if isinstance(op, ShardCopy):  # (flat buffer, copy, this rank's column bucket)
            key, flat = op.keys[pos], self._bucket(op, op.bucket, n * op.numel, buffers)
            rec.view, rec.bufs = flat[:0], (flat, self._bucket(op, op.copy_key, op.numel, buffers),
                                            flat[:0] if key is None else buffers[key])
            return rec
        # a member's own part is all a gather / scatter needs of it
        part = op.parts[pos][1] if isinstance(op, (Gather, Scatter)) and pos != op.root else None
        buf = self._bucket(op, op.bucket, op.offset + op.numel, buffers, part)
        rec.part_only = part is not None and buf.numel() == part
        rec.view = buf if rec.part_only else buf.narrow(0, op.offset, op.numel)
        return rec

    def _bucket(self, op: Op, key: BucketKey, numel: int, buffers: Mapping[BucketKey, Tensor],
                part: Optional[int] = None) -> Tensor:
        """This rank's bucket ``key`` for ``op``, checked: a contiguous 1-D tensor of at least
        ``numel`` elements, or of exactly ``part`` (a gather / scatter member's own part)."""
        mg = self.groups
        if (buf := buffers.get(key)) is None:
            raise KeyError(f"rank {mg.rank} {mg.coord} takes part in op {op.id!r} but no buffer "
                           f"for bucket {key} was given")
        if buf.dim() != 1 or not buf.is_contiguous() or (
                buf.numel() < numel and buf.numel() != part):
            raise ValueError(f"bucket {key} must be a contiguous 1-D tensor with at least "
                             f"{numel} elements, got {tuple(buf.shape)}")
        if str(buf.dtype) != op.dtype:
            raise ValueError(f"op {op.id!r} expects {op.dtype}, bucket tensor is {buf.dtype}")
        return buf

    def launch(self, ops: "Schedule | Sequence[Op]", buffers: Mapping[BucketKey, Tensor], *,
               after: "Pending | Iterable[Pending] | None" = None) -> Pending:
        """Start ``ops`` on this rank's ``buffers`` (``BucketKey -> 1-D tensor``); non-blocking.

        Every rank must launch the same ops in the same order. ``waits`` must name earlier ops of
        the same launch; ``after``: earlier launches every op of this one must also follow.
        All participating buffers must be on one device type (CPU or CUDA).
        """
        afters = [] if after is None else ([after] if isinstance(after, Pending) else list(after))
        after_recs = [r for p in afters for r in p._recs]
        by_id: dict[str, _Rec] = {}
        recs = []
        for op in ops:
            rec = self._record(op, buffers, by_id, after_recs)
            by_id[op.id] = rec
            recs.append(rec)
        devs = {rec.view.device.type for rec in recs if rec.view is not None}
        if len(devs) > 1:
            raise ValueError(f"launch: buffers on several device types {devs}; use one")
        dev_type = devs.pop() if devs else "cpu"
        if dev_type == "cuda":
            self._launch_cuda(recs)
        else:
            for rec in recs:
                self._queues[rec.op.lane].append(rec)
            self.poll()
        return Pending(self, recs, dev_type)

    def run(self, ops: "Schedule | Sequence[Op]", buffers: Mapping[BucketKey, Tensor]) -> None:
        """Launch ``ops`` and wait for them (the ``run`` a pure step takes,
        :func:`dmuon.functional.step.rank_step`)."""
        self.launch(ops, buffers).wait()

    # ----------------------------------------------------------------------------- CPU path
    def _issue_cpu(self, rec: _Rec) -> None:
        if rec.view is not None:
            rec.handle = _collective(rec)
            self._count(rec)
        rec.issued = True

    def poll(self) -> None:
        """CPU: issue queued ops, in order per lane, while their dependencies are complete
        (non-blocking)."""
        for q in self._queues.values():
            while q and all(d.complete() for d in q[0].deps):
                self._issue_cpu(q.popleft())

    def _drain(self, recs: Sequence[_Rec]) -> None:
        """CPU: issue ``recs`` and the ops queued before them in their lanes, blocking on
        dependencies (other lanes are left alone)."""
        upto = {r.op.lane: r.seq for r in sorted(recs, key=lambda r: r.seq)}  # last per lane
        for lane, seq in upto.items():
            q = self._queues[lane]
            while q and q[0].seq <= seq:
                for d in q[0].deps:
                    d.wait_host()
                self._issue_cpu(q.popleft())

    # ----------------------------------------------------------------------------- CUDA path
    def _launch_cuda(self, recs: list[_Rec]) -> None:
        dev = next(r.view.device for r in recs if r.view is not None)
        producer = torch.cuda.current_stream(dev).record_event()
        for lane in dict.fromkeys(r.op.lane for r in recs if r.view is not None):
            self.lane_stream(lane, dev).wait_event(producer)
        calls: dict = {}  # an op alone, or the ops of one coalesce key and lane: one group call
        for i, rec in enumerate(recs):
            rec.issued = True
            if rec.view is not None:
                calls.setdefault((rec.op.coalesce, rec.op.lane) if rec.op.coalesce else i,
                                 []).append(rec)
        for call in calls.values():  # a group's waits precede its first op (Schedule checks)
            st, event = self.lane_stream(call[0].op.lane, dev), torch.cuda.Event()
            for ev in {id(e): e for r in call for d in r.deps for e in d.events()}.values():
                st.wait_event(ev)
            with torch.cuda.stream(st):
                with coalesced_calls(call[0].group, dev, len(call)) as cm:
                    works = [_collective(r) for r in call]
                (cm or Works(works)).wait()  # the lane stream waits on them: no host sync
                for b in (b for r in call for b in (r.view, *r.bufs) if b is not None):
                    b.record_stream(st)  # a ShardBuckets op: every column's bucket
                event.record(st)
            for r in call:
                r.event = event
                self._count(r)


def mesh_executor(shard_size: int, replicate_size: int = 1, *, timeout: Any = None) -> Executor:
    """An :class:`Executor` over the world as ``replicate_size`` replicas of ``shard_size`` ranks
    (``r * G + s``; collective: every rank calls it). ``executor.run`` is the runner a pure step
    takes (:func:`dmuon.functional.step.rank_step`)."""
    return Executor(make_process_groups(shard_size=shard_size, replicate_size=replicate_size,
                                        timeout=timeout))
