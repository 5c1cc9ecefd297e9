"""Where the dedicated matrices live on this rank: masters (views into flat master buckets of this
rank's column; they never move after setup), zero-size placeholders between uses, and the reused
gradient-buffer pool.

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.storage".
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn as nn

from dmuon.functional.buckets import BucketKey, BucketLayout, HookGroups, bucket_layout
from dmuon.functional.packing import empty_buffers, pack_, unpack
from dmuon.functional.policy import master_dtype_for
from dmuon.stateful.runtime.guard_base import plain_access
from dmuon.stateful.runtime.guards import call_plain, to_placeholder, to_plain

__all__ = ["free_storage", "alloc_storage", "DedicatedStorage", "GradBufferPool"]


def free_storage(t: torch.Tensor) -> None:
    """Give ``t``'s storage back (0 bytes); views of it stay valid objects (FSDP2's trick)."""
    st = t.untyped_storage()
    if st.size() != 0:
        st.resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Re-allocate ``t``'s storage to its full size (contents undefined)."""
    st = t.untyped_storage()
    want = t.numel() * t.element_size()
    if st.size() != want:
        st.resize_(want)


class DedicatedStorage:
    """Masters and placeholders of the dedicated params of one model on this rank.

    Args:
      params: ``{name: param}`` (the params ``dedicate_params`` selected; their values are copied
        into the masters of this rank's column, then each ``.data`` becomes a placeholder).
      shapes, device: meta-device init only: the params' full shapes and the masters' device
        (the masters are left uninitialized; :mod:`dmuon.stateful.modes.meta_init` fills them).
      owners: ``{name: (s, r)}`` from the owner plan.  groups: the hook groups.
      shard_size, replicate_size: G, R.  coord: this rank's ``(s, r)``.
      master_dtypes: ``{name: dtype}`` overriding
        :func:`~dmuon.functional.policy.master_dtype_for` (a policy rule's ``master_dtype``,
        validated by :class:`dmuon.functional.policy.Rule`).
    """

    def __init__(self, params: Mapping[str, nn.Parameter], owners: Mapping[str, tuple[int, int]],
                 groups: HookGroups, shard_size: int, replicate_size: int,
                 coord: tuple[int, int], *, shapes: Optional[Mapping[str, tuple[int, ...]]] = None,
                 device: Optional[torch.device] = None,
                 master_dtypes: Optional[Mapping[str, torch.dtype]] = None):
        self.params = dict(params)
        self.coord = coord
        self.shape = ({n: tuple(shapes[n]) for n in self.params} if shapes is not None
                      else {n: tuple(p.shape) for n, p in self.params.items()})
        self.orig_dtype = {n: p.dtype for n, p in self.params.items()}
        self.master_dtype = {n: master_dtype_for(d) for n, d in self.orig_dtype.items()}
        self.master_dtype.update({n: d for n, d in (master_dtypes or {}).items()
                                  if n in self.master_dtype})
        self.device = device if device is not None else next(iter(self.params.values())).device
        self.master_layout: BucketLayout = bucket_layout(
            owners, self.shape, self.master_dtype, groups, shard_size, replicate_size)
        mine = tuple(b for b in self.master_layout.buckets if b.key.column == coord[0])
        self.master_buffers: dict[BucketKey, torch.Tensor] = empty_buffers(mine, self.device)
        self.masters: dict[str, torch.Tensor] = unpack(mine, self.master_buffers)
        if shapes is None:  # (meta-device init leaves them uninitialized: its init writes them)
            pack_(mine, self.master_buffers, {n: p.detach() for n, p in self.params.items()})
        #: the masters this rank runs Muon on (owner == coord), in the params' order
        self.owned_masters: dict[str, torch.Tensor] = {
            n: self.masters[n] for n in self.params if tuple(owners[n]) == tuple(coord)}
        self._placeholders: dict[str, torch.Tensor] = {}
        self.set_placeholder_dtypes(self.orig_dtype)

    @plain_access
    def set_placeholder_dtypes(self, dtypes: Mapping[str, torch.dtype]) -> None:
        """Make every param a zero-size placeholder of ``dtypes[name]`` (the compute dtype)."""
        for n in self.params:
            self._placeholders[n] = torch.empty(0, dtype=dtypes[n], device=self.device)
            self.point(n)

    @plain_access
    def point(self, name: str, view: Optional[torch.Tensor] = None) -> None:
        """Make param ``name`` show ``view`` (a view into a gathered bucket): a plain parameter;
        ``None``: its placeholder again (ops on its values raise, see
        :mod:`dmuon.stateful.runtime.guards`)."""
        p = self.params[name]
        p.data = self._placeholders[name] if view is None else view
        (to_placeholder if view is None else to_plain)(p)

    def is_placeholder(self, name: str) -> bool:
        """The param holds its zero-size placeholder (its reported shape is the matrix's)."""
        return call_plain(torch.Tensor.numel, (self.params[name],), {}) == 0  # local (not .data)


class GradBufferPool:
    """The reduce buckets of this rank's own column: allocated once, reused every step (a bucket
    already in use, or another column's, gets a transient buffer); unless ``persistent``, their
    storage is given back between steps."""

    def __init__(self, column: int, device: torch.device, *, persistent: bool = False):
        self.column = column
        self.device = device
        self.persistent = persistent
        self.buffers: dict[BucketKey, torch.Tensor] = {}
        self._busy: set[BucketKey] = set()

    def acquire(self, key: BucketKey, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``numel`` elements of ``dtype`` for bucket ``key`` (contents undefined)."""
        if key.column == self.column and key not in self._busy:
            if (buf := self.buffers.get(key)) is None:
                buf = torch.empty(numel, dtype=dtype, device=self.device)
                self.buffers[key] = buf
            alloc_storage(buf)
            self._busy.add(key)
            return buf
        return torch.empty(numel, dtype=dtype, device=self.device)

    def release_all(self) -> None:
        """Every buffer is free again (its gradients were consumed or dropped)."""
        self._busy.clear()
        if not self.persistent:
            for buf in self.buffers.values():
                free_storage(buf)
