"""One collective per hook group and dtype (:class:`~dmuon.functional.schedule.ShardAllGather` /
:class:`~dmuon.functional.schedule.ShardReduceScatter`) with ``torch.distributed``.

The executor (:mod:`dmuon.stateful.runtime.executor`) issues them through :func:`shard_buckets`:
every column's bucket is packed into a padded staging tensor of ``G * numel`` elements (gloo's
``all_gather_into_tensor`` / ``reduce_scatter_tensor``, named ``all_gather_single`` /
``reduce_scatter_single`` from torch 2.13, and NCCL's need equal parts; gloo refuses an
uneven list all-gather: "invalid tensor size"), one collective runs on it, and the result is copied
back into the buckets when the work is seen complete or waited (:class:`_Staged`), before any op
that waits on it is issued. The staging costs one extra copy of the group's buckets and ``G *
numel`` elements while the collective runs (not in the memory model).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.functional.schedule import ShardAllGather, ShardBuckets

__all__ = ["shard_buckets"]

# torch 2.13 renamed the two (the old names warn "deprecated"); 2.11 / 2.12 have the old ones only
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Staged:
    """The work handle of a :class:`ShardBuckets` op: the collective ran on a padded staging
    buffer; ``finish`` copies its result into the buckets, once, as soon as the collective is
    seen complete (before any op that depends on it is issued) or waited."""

    def __init__(self, work: Any, finish: Any) -> None:
        self.work, self._finish = work, finish

    def _done(self) -> None:
        if self._finish is not None:
            fn, self._finish = self._finish, None
            fn()

    def is_completed(self) -> bool:
        if self.work.is_completed():
            self._done()
            return True
        return False

    def wait(self) -> bool:
        self.work.wait()
        self._done()
        return True


def shard_buckets(op: ShardBuckets, me: int, bufs: Sequence[Optional[Tensor]],
                  reduce_ops: Mapping[str, Any], kw: dict) -> _Staged:
    """A :class:`ShardAllGather` / :class:`ShardReduceScatter`: every column's bucket packed into
    equal padded parts (zeros where a column has none), one ``all_gather_into_tensor`` /
    ``reduce_scatter_tensor``, the parts copied back out (the all-gather: every other column's
    bucket; the reduce-scatter: this rank's column). Moves ``G * numel`` elements per member, as
    :func:`~dmuon.functional.schedule.op_bytes` counts.

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
        return _Staged(work, finish)
    inp = torch.zeros(len(op.sizes) * pad, dtype=ref.dtype, device=ref.device)
    for j, (b, n) in enumerate(zip(bufs, op.sizes)):
        if b is not None:
            inp.narrow(0, j * pad, n).copy_(b.narrow(0, 0, n))
    out = torch.empty(pad, dtype=ref.dtype, device=ref.device)
    work = _reduce_scatter(out, inp, op=reduce_ops[op.op], **kw)

    def finish_rs() -> None:
        if mine is not None:
            mine.narrow(0, 0, op.sizes[me]).copy_(out.narrow(0, 0, op.sizes[me]))
    return _Staged(work, finish_rs)
