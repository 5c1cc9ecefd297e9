"""Between pytrees and buckets: a ``{name: tensor}`` tree packed into a layout's flat buffers, and
the buffers read back as views (pure, or into buffers the caller donates).

A bucket (:class:`~dmuon.functional.buckets.Bucket`) holds the matrices of one hook group whose
owners sit in one shard column, each entry a contiguous range viewed as its shape; a layout built
with ``presence=True`` adds one presence element per entry (1: this rank holds a gradient for it,
0: it does not; averaged by the reduce, so the owner sees > 0 iff any rank had one).

* :func:`empty_buffers` / :func:`zero_buffers` — one 1-D tensor per bucket, in its dtype;
* :func:`pack_` — write values (``None``: zeros and presence 0) into given buffers;
* :func:`pack` — the same into new buffers;
* :func:`unpack` — ``{name: view}`` of the entries asked for;
* :func:`presence` — ``{name: 0-d presence element}`` of the entries asked for.

These are what the runtime's hooks do when they gather a group or send its gradients, and what
the pure step (:mod:`dmuon.functional.step`) does per simulated rank.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional

import torch
from torch import Tensor

from dmuon.functional.buckets import Bucket, BucketEntry, BucketKey, to_torch_dtype

__all__ = ["empty_buffers", "zero_buffers", "pack_", "pack", "unpack", "presence", "entries"]

EntryFilter = Optional[Callable[[Bucket, BucketEntry], bool]]


def empty_buffers(buckets: Iterable[Bucket], device: "torch.device | str" = "cpu"
                  ) -> dict[BucketKey, Tensor]:
    """One uninitialized 1-D buffer per bucket, in the bucket's dtype."""
    return {b.key: torch.empty(b.numel, dtype=to_torch_dtype(b.key.dtype), device=device)
            for b in buckets}


def zero_buffers(buckets: Iterable[Bucket], device: "torch.device | str" = "cpu"
                 ) -> dict[BucketKey, Tensor]:
    """One zero 1-D buffer per bucket, in the bucket's dtype."""
    return {b.key: torch.zeros(b.numel, dtype=to_torch_dtype(b.key.dtype), device=device)
            for b in buckets}


def entries(buckets: Iterable[Bucket], where: EntryFilter = None
            ) -> list[tuple[Bucket, BucketEntry]]:
    """``(bucket, entry)`` pairs in layout order, those ``where(bucket, entry)`` accepts (a
    list: asked per step, a generator would be one Python call per entry)."""
    return [(b, e) for b in buckets for e in b.entries if where is None or where(b, e)]


@torch.no_grad()
def pack_(buckets: Iterable[Bucket], buffers: Mapping[BucketKey, Tensor],
          values: Mapping[str, Optional[Tensor]], *, where: EntryFilter = None,
          missing_is_zero: bool = True) -> dict[str, bool]:
    """Write ``values`` into the (donated) ``buffers``, entry by entry.

    Args:
      buckets: the buckets to fill (e.g. ``layout.buckets_of(group)``).
      buffers: ``{bucket key: 1-D tensor}``, written in place.
      values: ``{name: tensor of the entry's shape}``; a name absent or ``None`` writes zeros
        (``missing_is_zero``) or leaves the range as it is, and presence 0.
      where: only the entries it accepts (default: all).

    Returns:
      dict: ``{name: whether a value was written}`` for every entry visited.
    """
    wrote: dict[str, bool] = {}
    dst, src, zero = [], [], []  # the entries' ranges don't overlap: one batched copy, one zero
    for b, e in entries(buckets, where):
        buf = buffers[b.key]
        v = values.get(e.name)
        view = buf[e.offset:e.offset + e.numel]
        if v is not None:
            dst.append(view.view(e.shape))
            src.append(v)
        elif missing_is_zero:
            zero.append(view)
        if e.flag >= 0:  # fill_, not ``buf[i] = v``: that copies a host scalar (a host sync on CUDA)
            buf[e.flag:e.flag + 1].fill_(0.0 if v is None else 1.0)
        wrote[e.name] = v is not None
    if dst:
        torch._foreach_copy_(dst, src)
    if zero:
        torch._foreach_zero_(zero)
    return wrote


def pack(buckets: Iterable[Bucket], values: Mapping[str, Optional[Tensor]], *,
         where: EntryFilter = None, device: "torch.device | str" = "cpu"
         ) -> dict[BucketKey, Tensor]:
    """:func:`pack_` into new zero buffers (one per bucket)."""
    buckets = tuple(buckets)
    buffers = zero_buffers(buckets, device)
    pack_(buckets, buffers, values, where=where)
    return buffers


def unpack(buckets: Iterable[Bucket], buffers: Mapping[BucketKey, Tensor], *,
           where: EntryFilter = None) -> dict[str, Tensor]:
    """``{name: view of its entry, in its shape}`` (views: they alias ``buffers``)."""
    return {e.name: buffers[b.key][e.offset:e.offset + e.numel].view(e.shape)
            for b, e in entries(buckets, where)}


def presence(buckets: Iterable[Bucket], buffers: Mapping[BucketKey, Tensor], *,
             where: EntryFilter = None) -> dict[str, Tensor]:
    """``{name: 0-d presence element}`` (> 0 iff a rank held a value) of entries that have one."""
    return {e.name: buffers[b.key][e.flag] for b, e in entries(buckets, where) if e.flag >= 0}
