"""Moving dedicated matrices (and their optimizer state) for state dicts and checkpoints, bucketed,
one hook group at a time, through the step program's checkpoint phases on a second executor
(:class:`CheckpointTransfer`). Callers drain the training collectives first; the dedicated matrices
move between ranks only through these schedules.

Design notes: docs/design/checkpoint.md, "dmuon.stateful.checkpoint.transfer".
"""
from __future__ import annotations

import math
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Optional

import torch

from dmuon.functional.buckets import BucketKey
from dmuon.functional.group_layout import grid_position
from dmuon.functional.packing import entries, unpack, zero_buffers
from dmuon.functional.program import (CHECKPOINT_ABSENT, checkpoint_over_tp,
                                      checkpoint_to_columns, checkpoint_to_every_rank)
from dmuon.functional.state_dict_check import row_chunks
from dmuon.stateful.modes.tensor_parallel import assemble_tp_slices, local_part
from dmuon.stateful.runtime.executor import Executor

__all__ = ["CheckpointTransfer", "transfer_of", "rows_of", "replicated"]


def replicated(value: Any) -> bool:
    """A DTensor whose every rank holds the whole tensor (``Replicate()`` on every mesh dim, as
    torchtitan's ``FusedQKVLinear`` merge hook produces)."""
    from torch.distributed.tensor import Replicate
    return all(isinstance(p, Replicate) for p in value.placements)


def rows_of(value: Any, st, shape: tuple[int, ...]) -> Optional[tuple[int, torch.Tensor]]:
    """``(first row, local rows)`` of a dedicated entry: a DTensor of dmuon's spec, or a full
    plain tensor (this rank's rows of it); ``None`` for ``None``."""
    if value is None:
        return None
    start, n = row_chunks(shape[0], st.G)[st.coord[0]]
    if hasattr(value, "to_local"):
        if not replicated(value):
            return start, value.to_local()
        value = value.to_local()  # every rank holds it whole
    return start, value[start:start + n]


class CheckpointTransfer:
    """Bucketed transfers of one model's dedicated matrices.

    Args:
      state: the model's :class:`~dmuon.stateful.runtime.state.DedicatedState`.
    """

    def __init__(self, state):
        self.st = state
        self.layout = state.storage.master_layout
        self.executor = Executor(state.mesh_groups)

    def to_every_rank(self, group: str, values: Mapping[str, torch.Tensor], *,
                      owner_only: bool = False) -> dict[str, torch.Tensor]:
        """Collective: ``{name: full tensor}`` for every matrix of ``group``, on every rank (views
        into one group's buffers; copy what must outlive the next call).

        Args:
          values: this rank's values: for ``owner_only=False`` every matrix of its owner column
            (the masters), for ``owner_only=True`` the matrices it owns itself (momentum). A value
            with fewer elements than its matrix (a variant's per-row state) travels in the first
            elements of the matrix's entry (read back with ``reshape(-1)[:numel]``).
        """
        buckets = self.layout.buckets_of(group)
        bufs = zero_buffers(buckets, self.st.device)
        s, _ = self.st.coord
        with torch.no_grad():
            for b, e in entries(buckets, lambda b, e: b.key.column == s):
                v = values.get(e.name)
                if v is not None and tuple(v.shape) == tuple(e.shape):
                    bufs[b.key][e.offset:e.offset + e.numel].view(e.shape).copy_(v)
                elif v is not None:  # a smaller value (a variant's per-row state): its first
                    bufs[b.key][e.offset:e.offset + v.numel()].copy_(v.reshape(-1))  # elements
        self.executor.launch(checkpoint_to_every_rank(self.layout, group,
                                                      owner_only=owner_only), bufs).wait()
        return unpack(buckets, bufs)

    def to_columns(self, group: str,
                   rows: Callable[[str], Optional[tuple[int, torch.Tensor]]], *,
                   from_replica: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Collective: the full matrices of ``group`` on their owner column (every replica), from
        the rows each rank holds: ``rows(name) -> (first row, tensor of rows)`` or ``None``.
        Returns ``{name: full tensor}`` for the matrices of this rank's column. A 1-D ``tensor``
        at first row 0 travels in the first elements of the matrix's entry; ``from_replica``: only
        that replica holds values (:meth:`from_rank0`)."""
        buckets = self.layout.buckets_of(group)
        bufs = {k: b.fill_(CHECKPOINT_ABSENT) for k, b in zero_buffers(buckets,
                                                                       self.st.device).items()}
        with torch.no_grad():
            for b, e in entries(buckets):
                got = rows(e.name)
                if got is None:
                    continue
                start, t = got
                if t.numel() and t.dim() == 1 and len(e.shape) > 1:  # a smaller value
                    bufs[b.key][e.offset:e.offset + t.numel()].copy_(t)
                elif t.numel():
                    full = bufs[b.key][e.offset:e.offset + e.numel].view(e.shape)
                    full[start:start + t.shape[0]].copy_(t)
        self.executor.launch(checkpoint_to_columns(self.layout, group, from_replica=from_replica),
                             bufs).wait()
        s, _ = self.st.coord
        return unpack(buckets, bufs, where=lambda b, e: b.key.column == s)

    def full_masters(self, groups: Optional[Iterable[str]] = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: ``(name, full master)`` of every dedicated matrix of ``groups`` (default:
        every hook group that holds some, in the static order), on every rank, TP slices
        assembled (an all-gather per matrix, TP group); views: copy each before the next group."""
        for group in self.layout.groups if groups is None else groups:
            got = self.to_every_rank(group, self.st.masters)
            yield from assemble_tp_slices(self.st.tp_layouts, got,
                                          self.st.mesh_groups.tp_group).items()

    def to_owners(self, names: Collection[str], value: Callable[[str], Any], *,
                  rank0: bool = False, shapes: Optional[Mapping[str, tuple[int, ...]]] = None,
                  part: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: ``(name, full value)`` on this rank's owner column of each matrix of
        ``names`` (the same on every rank), group by group (views: copy each before the next): a
        load's one route. ``value(name)``: a full tensor, a DTensor or ``None`` (``rank0``:
        :meth:`from_rank0`'s, ``shapes`` their full shapes); ``part(name, full)``: this rank's
        piece of a full value (default: its TP slice)."""
        st = self.st
        part = part or (lambda n, v: local_part(st, n, v))

        def rows(n: str) -> Optional[tuple[int, torch.Tensor]]:
            v = value(n) if n in names else None
            return rows_of(None if v is None else part(n, v), st, st.shape[n])
        for group in self.layout.groups:
            if not any(n in names for n in st.hook_groups.names(group)):
                continue
            got = (self.from_rank0(group, shapes, value, part) if rank0 else
                   self.to_columns(group, rows))
            yield from ((n, t) for n, t in got.items() if n in names)

    def from_rank0(self, group: str, shapes: Mapping[str, tuple[int, ...]],
                   value: Callable[[str], torch.Tensor],
                   part: Callable[[str, torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Collective: :meth:`to_columns` of the values of ``shapes``' names that only global rank
        0 holds (``value(name)``, called there: full, checked; moved to the master dtype on this
        device as it is sent, one at a time; a rank's piece is ``part(name, full)``); under TP its
        TP peers first get the full values and each contributes its slice."""
        mg, st = self.st.mesh_groups, self.st
        at = grid_position(mg.tp_grids or (mg.grid,), 0)[1]
        hold = st.coord == at  # rank 0 (and, under TP, its TP peers)
        shared: dict[str, torch.Tensor] = {}
        full = lambda n: value(n).to(device=st.device, dtype=st.master_dtype[n])  # noqa: E731
        if hold and mg.tp_size > 1:
            shared = self._over_tp(group, [e.name for b in self.layout.buckets_of(group)
                                           for e in b.entries if e.name in shapes], shapes, full)

        def rows(n: str) -> Optional[tuple[int, torch.Tensor]]:
            if not hold or n not in shapes:  # (without TP: hold on rank 0 only)
                return None
            return 0, part(n, shared[n] if mg.tp_size > 1 else full(n))
        return self.to_columns(group, rows, from_replica=at[1])

    def _over_tp(self, group: str, names: list[str], shapes: Mapping[str, tuple[int, ...]],
                 value: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0's full values (``value(name)``, called on rank 0) on every rank of its TP
        group, one flat buffer per master dtype."""
        st = self.st
        by_dtype: dict[torch.dtype, list[str]] = {}
        for n in names:
            by_dtype.setdefault(st.master_dtype[n], []).append(n)
        bufs, out = {}, {}
        for dt, ns in by_dtype.items():  # rank 0's values (in dt, on the device), else -0.0
            key = BucketKey(group, -1, str(dt))
            sizes = [math.prod(shapes[n]) for n in ns]
            bufs[key] = (torch.cat([value(n).reshape(-1) for n in ns]) if st.rank == 0 else
                         torch.full((sum(sizes),), CHECKPOINT_ABSENT, dtype=dt, device=st.device))
            out.update({n: v.view(shapes[n]) for n, v in zip(ns, bufs[key].split(sizes))})
        sched = checkpoint_over_tp(group, {k.dtype: b.numel() for k, b in bufs.items()},
                                   st.mesh_groups.tp_ranks,
                                   world_size=st.G * st.R * st.mesh_groups.tp_size)
        self.executor.launch(sched, bufs).wait()
        return out


def transfer_of(state: Any) -> CheckpointTransfer:
    """The :class:`CheckpointTransfer` of ``state``'s model (bucketed state-dict and checkpoint
    transfers; built at first use and kept on the state)."""
    if getattr(state, "_transfer", None) is None:
        state._transfer = CheckpointTransfer(state)
    return state._transfer
