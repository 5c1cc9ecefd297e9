"""A pure in-process simulator of N = G*R ranks executing a :class:`~dmuon.functional.schedule.Schedule`.

Ranks are indexed globally by ``r * G + s``. Each rank holds a dict ``BucketKey -> 1-D tensor``.
Ops run in schedule order (every ``waits`` entry points to an earlier op, so schedule order is a valid
topological order). Exact semantics, per group of the op (see :func:`schedule.op_members`):

* ``Broadcast``: every member's range ``[offset, offset+numel)`` becomes a copy of the source's.
* ``Reduce`` (``avg``): the destination's range becomes ``sum_i x_i / n`` where the sum runs over the
  members in axis order, accumulated in the buffer dtype (``sum``: no division). The members'
  ranges other than the destination's become **undefined**, as a real gloo reduce leaves them; the
  simulator fills them with NaN (``poison=True``; integer buffers are left as they were) so code that
  reads them fails in tests.

* ``AllReduce``: every member's range becomes the sum over the members in ``members`` order
  (``avg``: divided by their number; ``max``: the elementwise maximum), accumulated in the buffer
  dtype.
* ``AllGather``: every member's copy of each part ``parts[j]`` becomes member ``j``'s.
* ``Gather``: the destination's copy of each part ``parts[j]`` becomes member ``j``'s.
* ``Scatter``: member ``j``'s part ``parts[j]`` becomes the source's copy of it.
* ``ShardAllGather``: every member's bucket ``keys[j]`` becomes member ``j``'s (padding moves
  nothing a rank reads).
* ``ShardReduceScatter``: member ``j``'s bucket ``keys[j]`` becomes the combination of every
  member's copy, exactly as a ``Reduce`` of that bucket to ``j`` (same order, same poisoning).
* ``ShardCopyGather``: every member's flat buffer becomes the members' copies end to end.
* ``ShardCopyRefresh``: member ``j``'s copy becomes part ``j`` of the members' own column buckets
  laid end to end (the rest of a last, short part: zeros).

Groups of one rank are no-ops. Only ranks that take part in an op need its bucket; a missing bucket
on a participating rank raises ``KeyError`` saying which.

Purity: inputs are not mutated unless ``donate=True`` (then the given tensors are updated in place and
returned in the result dicts).
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
from torch import Tensor

from dmuon.functional.buckets import BucketKey
from dmuon.functional.schedule import (AllGather, AllReduce, Broadcast, Gather, Reduce, Scatter,
                                       Schedule, ShardAllGather, ShardBuckets, ShardCopy,
                                       ShardCopyGather, ShardReduceScatter, op_members,
                                       op_root_coord)

__all__ = ["simulate"]


def _combine(views: Sequence[Tensor], how: str) -> Tensor:
    """Sum of ``views`` in order (``how="avg"``: divided by their number; floor for integers)."""
    acc = views[0].clone()
    if how == "max":
        return torch.stack(list(views)).amax(0)
    for v in views[1:]:
        acc += v
    if how == "avg":
        if acc.is_floating_point() or acc.is_complex():
            acc /= len(views)
        else:
            acc //= len(views)
    return acc


def simulate(schedule: Schedule, buffers: Sequence[Mapping[BucketKey, Tensor]], *,
             donate: bool = False, poison: bool = True) -> list[dict[BucketKey, Tensor]]:
    """Run ``schedule`` over ``len(buffers)`` simulated ranks.

    Args:
      schedule: the ops to run.
      buffers: per global rank (``r * G + s``), ``BucketKey -> 1-D tensor``; length must be G*R.
      donate: update the given tensors in place (no copies); otherwise they are left untouched.
      poison: fill undefined ranges (non-destination ranks of a Reduce) with NaN.

    Returns:
      Per rank, a new dict of the (new or donated) bucket tensors, same keys as the input.

    Raises:
      ValueError: wrong number of ranks, a buffer that is not 1-D or is too short for an op,
        dtype mismatch between an op and its bucket tensor.
      KeyError: a participating rank lacks a bucket.
    """
    G, R = schedule.shard_size, schedule.replicate_size
    if len(buffers) != G * R:
        raise ValueError(f"simulate: schedule is for G*R = {G * R} ranks, got {len(buffers)} "
                         f"buffer dicts")
    out: list[dict[BucketKey, Tensor]] = [
        {k: (v if donate else v.clone()) for k, v in rank_bufs.items()} for rank_bufs in buffers]

    def view(coord: tuple[int, int], op, key: BucketKey | None = None, offset: int | None = None,
             numel: int | None = None) -> Tensor:
        s, r = coord
        rank = r * G + s
        key = op.bucket if key is None else key
        offset = op.offset if offset is None else offset
        numel = op.numel if numel is None else numel
        try:
            t = out[rank][key]
        except KeyError:
            raise KeyError(f"simulate: rank {rank} (s={s}, r={r}) takes part in op {op.id!r} but "
                           f"holds no bucket {key}") from None
        if t.dim() != 1 or t.numel() < offset + numel:
            raise ValueError(f"simulate: bucket {key} on rank {rank} must be 1-D with at "
                             f"least {offset + numel} elements, got shape {tuple(t.shape)}")
        if str(t.dtype) != op.dtype:
            raise ValueError(f"simulate: op {op.id!r} expects {op.dtype}, rank {rank} holds "
                             f"{t.dtype}")
        return t.narrow(0, offset, numel)

    for op in schedule.ops:
        for group in op_members(op, G, R):
            if len(group) == 1:
                continue
            if isinstance(op, ShardBuckets):
                _shard_buckets(op, group, view, poison)
                continue
            if isinstance(op, ShardCopy):
                _shard_copy(op, group, view)
                continue
            root = op_root_coord(op, group)
            views = [view(c, op) for c in group]
            root_view = views[group.index(root)]
            if isinstance(op, AllGather):
                parts = [views[j].narrow(0, o - op.offset, n).clone()
                         for j, (o, n) in enumerate(op.parts)]
                for v in views:
                    for (o, n), part in zip(op.parts, parts):
                        v.narrow(0, o - op.offset, n).copy_(part)
            elif isinstance(op, Gather):
                for (o, n), v in zip(op.parts, views):
                    if v is not root_view:
                        root_view.narrow(0, o - op.offset, n).copy_(v.narrow(0, o - op.offset, n))
            elif isinstance(op, Scatter):
                for (o, n), v in zip(op.parts, views):
                    if v is not root_view:
                        v.narrow(0, o - op.offset, n).copy_(root_view.narrow(0, o - op.offset, n))
            elif isinstance(op, AllReduce):
                acc = _combine(views, op.op)
                for v in views:
                    v.copy_(acc)
            elif isinstance(op, Broadcast):
                src = root_view.clone()
                for c, v in zip(group, views):
                    if c != root:
                        v.copy_(src)
            elif isinstance(op, Reduce):
                root_view.copy_(_combine(views, op.op))
                if poison:
                    for c, v in zip(group, views):
                        if c != root and (v.is_floating_point() or v.is_complex()):
                            v.fill_(math.nan)
            else:  # pragma: no cover - the Op union is closed
                raise TypeError(f"simulate: unknown op type {type(op).__name__}")
    return out


def _shard_buckets(op: ShardBuckets, group: list, view, poison: bool) -> None:
    """One shard group's :class:`ShardAllGather` / :class:`ShardReduceScatter` (module doc)."""
    for j, (key, n) in enumerate(zip(op.keys, op.sizes)):
        if key is None:
            continue
        views = [view(c, op, key, 0, n) for c in group]
        if isinstance(op, ShardAllGather):
            src = views[j].clone()
            for i, v in enumerate(views):
                if i != j:
                    v.copy_(src)
        elif isinstance(op, ShardReduceScatter):
            views[j].copy_(_combine(views, op.op))
            if poison:
                for i, v in enumerate(views):
                    if i != j and (v.is_floating_point() or v.is_complex()):
                        v.fill_(math.nan)
        else:  # pragma: no cover - the two kinds are all
            raise TypeError(f"simulate: unknown op type {type(op).__name__}")


def _shard_copy(op: ShardCopy, group: list, view) -> None:
    """One shard group's :class:`ShardCopyGather` / :class:`ShardCopyRefresh` (module doc)."""
    L, G = op.numel, len(group)
    copies = [view(c, op, op.copy_key, 0, L) for c in group]
    if isinstance(op, ShardCopyGather):
        parts = [c.clone() for c in copies]
        for c in group:
            flat = view(c, op, op.bucket, 0, G * L)
            for j, part in enumerate(parts):
                flat.narrow(0, j * L, L).copy_(part)
        return
    sent = [None if k is None else view(c, op, k, 0, n).clone()
            for c, k, n in zip(group, op.keys, op.sizes)]
    for j, copy in enumerate(copies):
        copy.zero_()
        for s, b in enumerate(sent):
            at, n = op.moved(s, j)
            if n:
                copy.narrow(0, at - j * L, n).copy_(b.narrow(0, at - op.starts[s], n))


def zeros_like_layout(layout, world_size: int | None = None, *, device: "torch.device | str" = "cpu"
                      ) -> list[dict[BucketKey, Tensor]]:
    """Zero buckets for every rank (every rank holds every bucket): a convenience for tests."""
    from dmuon.functional.buckets import to_torch_dtype
    W = layout.world_size if world_size is None else world_size
    return [{b.key: torch.zeros(b.numel, dtype=to_torch_dtype(b.key.dtype), device=device)
             for b in layout.buckets} for _ in range(W)]
