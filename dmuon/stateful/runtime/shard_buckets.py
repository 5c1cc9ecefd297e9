"""One collective per hook group and dtype (:class:`~dmuon.functional.schedule.ShardAllGather` /
:class:`~dmuon.functional.schedule.ShardReduceScatter`) with ``torch.distributed``, through a padded
staging tensor of ``G * numel`` elements whose result is copied back into the buckets before any
op that waits on it is issued; and the sharded style's ``ShardCopyGather`` / ``ShardCopyRefresh``.

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.shard_buckets".
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.functional.schedule import ShardAllGather, ShardBuckets, ShardCopy, ShardCopyGather

__all__ = ["Works", "shard_buckets", "shard_copy"]

# torch 2.13 renamed the two (the old names warn "deprecated"); 2.11 / 2.12 have the old ones only
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Works:
    """Several work handles as one (also an uneven explicit-group op's sends / receives);
    ``finish`` (a :class:`ShardBuckets` op: copy the staging buffer's result into the buckets)
    runs once, when they are seen complete or waited."""

    def __init__(self, works: Sequence[Any], finish: Any = None) -> None:
        self.works, self._finish = [w for w in works if w is not None], finish

    def _done(self) -> None:
        if self._finish is not None:
            fn, self._finish = self._finish, None
            fn()

    def is_completed(self) -> bool:
        if all(w.is_completed() for w in self.works):
            self._done()
            return True
        return False

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        self._done()
        return True


def shard_buckets(op: ShardBuckets, me: int, bufs: Sequence[Optional[Tensor]],
                  reduce_ops: Mapping[str, Any], kw: dict) -> Works:
    """Issue a :class:`ShardAllGather` / :class:`ShardReduceScatter` on equal padded parts (zeros
    where a column has none); ``G * numel`` elements per member, as ``op_bytes`` counts.

    Args:
      op: the op.  me: this rank's shard index.  bufs: this rank's bucket of every column
        (``None`` where the column has none).  reduce_ops: ``{"avg"|"sum": ReduceOp}``.
      kw: ``group=`` and ``async_op=True``.
    """
    pad = op.numel
    ref = next(b for b in bufs if b is not None)
    mine = bufs[me]
    if isinstance(op, ShardAllGather):
        out = torch.empty(len(op.sizes) * pad, dtype=ref.dtype, device=ref.device)
        inp = out.narrow(0, me * pad, pad)
        n_me = op.sizes[me]
        if mine is not None:
            inp.narrow(0, 0, n_me).copy_(mine.narrow(0, 0, n_me))
        inp.narrow(0, n_me, pad - n_me).zero_()  # the padding: zeros, never read
        work = _all_gather(out, inp, **kw)

        def finish() -> None:
            for j, (b, n) in enumerate(zip(bufs, op.sizes)):
                if b is not None and j != me:
                    b.narrow(0, 0, n).copy_(out.narrow(0, j * pad, n))
        return Works([work], finish)
    inp = torch.zeros(len(op.sizes) * pad, dtype=ref.dtype, device=ref.device)
    for j, (b, n) in enumerate(zip(bufs, op.sizes)):
        if b is not None:
            inp.narrow(0, j * pad, n).copy_(b.narrow(0, 0, n))
    out = torch.empty(pad, dtype=ref.dtype, device=ref.device)
    work = _reduce_scatter(out, inp, op=reduce_ops[op.op], **kw)

    def finish_rs() -> None:
        if mine is not None:
            mine.narrow(0, 0, op.sizes[me]).copy_(out.narrow(0, 0, op.sizes[me]))
    return Works([work], finish_rs)



def shard_copy(op: ShardCopy, me: int, flat: Tensor, copy: Tensor, mine: Tensor, kw: dict) -> Any:
    """Issue a :class:`ShardCopyGather` (this rank's copy into its part of ``flat``, then an
    in-place all-gather) or a :class:`ShardCopyRefresh` (``mine``, this rank's column bucket, to
    the copies: an all-to-all of :meth:`ShardCopy.splits`). ``kw``: ``group=``, ``async_op``."""
    if isinstance(op, ShardCopyGather):
        part = flat.narrow(0, me * op.numel, op.numel)
        return _all_gather(flat, part.copy_(copy), **kw)
    send, recv = op.splits(me)
    return dist.all_to_all_single(copy.narrow(0, 0, sum(recv)), mine, recv, send, **kw)
