"""The host <-> device copies of offloaded Muon state (:class:`OffloadCopies`): copies in on one
side stream, copies back on another; copies back that would outlast the step start at the next
forward's first hook group (:func:`~dmuon.functional.momentum_chunks.next_out_budget` learns the
step's budget from timing events).
Design notes: docs/design/optimizer.md, "Offload copies and their timing"."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from dmuon.functional.momentum_chunks import next_out_budget
from dmuon.kernels.streams import side_stream

__all__ = ["OffloadCopies", "NoCopies", "next_out_budget"]


class NoCopies:
    """The copies of momentum kept on the device: none (:class:`OffloadCopies`' interface, each
    call a no-op), so that the storage never asks whether it offloads."""

    copies_in = copies_out = 0

    def __init__(self) -> None:
        self.staged: dict[str, tuple[Tensor, Optional[Any]]] = {}

    def flush(self, names: Optional[Mapping[str, Any]] = None) -> None:
        """Nothing is deferred."""

    def synchronize(self) -> None:
        """Nothing is copied."""

    def end_step(self) -> None:
        """Nothing is timed."""


class OffloadCopies:
    """The copies of one optimizer's offloaded momentum (see the module docstring).

    Args:
      device: the masters' device.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.in_stream = side_stream(self.device, "state_offload") if self.cuda else None
        self.out_stream = side_stream(self.device, "state_offload_out") if self.cuda else None
        #: {name: (device staging buffer, event of its copy in or None)}, in staging order
        self.staged: dict[str, tuple[Tensor, Optional[Any]]] = {}
        #: tensors copied host -> device and device -> host (requested) so far
        self.copies_in = self.copies_out = 0
        #: bytes of copies back the step starts at once (``None``: all; CPU: none, see above)
        self.out_budget: Optional[int] = None if self.cuda else 0
        # copies back not started yet: (host tensors, device data, names, event of the data)
        self._pending: list[tuple[list[Tensor], list[Tensor], list[str], Optional[Any]]] = []
        self._out_events: dict[str, Any] = {}  # name -> event after its last copy out
        # host tensors whose copy back was deferred or issued since the last synchronize:
        # id -> (name, tensor, its version then); a write by anyone else in between is refused
        self._versions: dict[int, tuple[str, Tensor, int]] = {}
        self._last_out: Optional[Any] = None  # the out stream's last event (covers all before)
        self._last_timed: Optional[Any] = None  # timing event after this step's last copy
        self._step_bytes = 0  # bytes started at once in this step
        self._deferred = 0  # bytes deferred in this step
        self._first_ev: Optional[Any] = None  # timing: out stream before this step's first copy
        self._measure: Optional[tuple] = None  # the last step's (end, first, last, bytes, deferred)

    # ------------------------------------------------------------------ in
    def copy_in(self, todo: Mapping[str, Tensor]) -> None:
        """Start copying the host tensors ``todo`` (``{name: host tensor}``) into new device
        staging buffers (:attr:`staged`), after every copy back of those names."""
        self.flush(todo)  # the copies back of these names are on the out stream before the reads
        self.copies_in += len(todo)
        if not self.cuda:  # CPU: the same path, synchronously
            for n, t in todo.items():
                self.staged[n] = (torch.empty_like(t, device=self.device).copy_(t), None)
            return
        # allocated on the current stream, so they reuse what the backward freed
        bufs = {n: torch.empty_like(t, device=self.device) for n, t in todo.items()}
        st = self.in_stream
        st.wait_stream(torch.cuda.current_stream(self.device))  # the blocks are free
        for ev in {id(e): e for e in (self._out_events.get(n) for n in todo) if e}.values():
            st.wait_event(ev)  # the host buffers hold the last step's values
        with torch.cuda.stream(st):
            for n, t in todo.items():
                bufs[n].copy_(t, non_blocking=True)
                bufs[n].record_stream(st)
            ev = torch.cuda.Event()
            ev.record(st)
        for n, b in bufs.items():
            self.staged[n] = (b, ev)

    def wait(self, names: Sequence[str]) -> list[Tensor]:
        """The staging buffers of ``names`` (staged), the current stream waiting for their
        copies."""
        cur = torch.cuda.current_stream(self.device) if self.cuda else None
        waited, out = set(), []
        for n in names:
            buf, ev = self.staged[n]
            if ev is not None and id(ev) not in waited:
                cur.wait_event(ev)
                waited.add(id(ev))
            out.append(buf)
        return out

    # ------------------------------------------------------------------ out
    def copy_out(self, names: Sequence[str], hosts: Sequence[Tensor],
                 datas: Sequence[Tensor]) -> None:
        """Copy the device tensors ``datas`` (written by the current stream) into the host
        tensors ``hosts``: now, while the step's :attr:`out_budget` lasts (on CUDA the step's
        first copy always, so that its time is measured), else at the next :meth:`flush`."""
        for n in names:
            self.staged.pop(n, None)
        self.copies_out += len(names)
        nbytes = sum(d.nbytes for d in datas)
        # once the step defers a copy, the rest of its copies wait too (one order)
        now = self.cuda and self._deferred == 0 and (
            self._step_bytes == 0 or self.out_budget is None
            or self._step_bytes + nbytes <= self.out_budget)
        ready = None
        if self.cuda:
            if self._step_bytes == 0 and self._deferred == 0:
                self._learn()  # the last step's measurement, if its events completed
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        item = (list(hosts), list(datas), list(names), ready)
        if not now:
            self._deferred += nbytes
            self._pending.append(item)
            self._versions.update({id(t): (n, t, t._version) for n, t in zip(names, hosts)})
            return
        self.flush()  # earlier deferred copies first (one order on the out stream)
        if self._first_ev is None:
            self._first_ev = torch.cuda.Event(enable_timing=True)
            self.out_stream.wait_event(ready)
            self._first_ev.record(self.out_stream)
        self._step_bytes += nbytes
        self._submit(item, timing=True)

    def _submit(self, item: tuple, timing: bool = False) -> None:
        hosts, datas, names, ready = item
        if not self.cuda:
            for t, d in zip(hosts, datas):
                t.copy_(d)
        else:
            st = self.out_stream
            st.wait_event(ready)
            with torch.cuda.stream(st):
                for t, d in zip(hosts, datas):
                    t.copy_(d, non_blocking=True)
                    d.record_stream(st)
                ev = torch.cuda.Event(enable_timing=timing)
                ev.record(st)
            self._out_events.update((n, ev) for n in names)
            self._last_out = ev
            if timing:
                self._last_timed = ev
        self._versions.update({id(t): (n, t, t._version) for n, t in zip(names, hosts)})

    def end_step(self) -> None:
        """The step's work is queued: record its end (CUDA, for :attr:`out_budget`)."""
        if self.cuda and self._first_ev is not None and self._last_timed is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self._measure = (end, self._first_ev, self._last_timed, self._step_bytes,
                             self._deferred)
        self._first_ev, self._last_timed, self._step_bytes, self._deferred = None, None, 0, 0

    def _learn(self) -> None:
        """Set :attr:`out_budget` from the last measured step, once its events completed: the
        bytes its copy engine moved by the step's end (more when it finished early and some
        were deferred)."""
        m = self._measure
        if m is None or not all(e.query() for e in m[:3]):
            return
        self._measure = None
        end, first, last, nbytes, deferred = m
        self.out_budget = next_out_budget(self.out_budget, nbytes, bool(deferred),
                                          first.elapsed_time(last), end.elapsed_time(last))

    def flush(self, names: Optional[Mapping[str, Any]] = None) -> None:
        """Start the deferred copies back, in order (see the module docstring): all of them, or
        (``names``) those up to the last one that holds one of ``names`` (a step's own chunk
        copies in then leave its deferred copies back deferred)."""
        self._check_unwritten()
        last = len(self._pending) if names is None else max(
            (i + 1 for i, item in enumerate(self._pending) if any(n in names for n in item[2])),
            default=0)
        todo, self._pending = self._pending[:last], self._pending[last:]
        for item in todo:
            self._submit(item)

    def synchronize(self) -> None:
        """Start the deferred copies back and wait for all of them (before the host buffers are
        read or written)."""
        self.flush()
        if self._last_out is not None:
            self._last_out.synchronize()
        self._last_out = None
        self._out_events.clear()
        self._versions.clear()  # current from here on: a read may be written through

    def _check_unwritten(self) -> None:
        """Raise if a host tensor was written while its copy back was deferred or running: a
        tensor read from ``optimizer.state`` before a ``step()`` and written after it (its
        value was the step's input, and the copy back would overwrite the write)."""
        bad = [n for n, t, v in self._versions.values() if t._version != v]
        if bad:
            self._versions.clear()
            raise RuntimeError(
                f"dmuon.Muon (offload_state=True): the host momentum of {bad[:3]} was written "
                "after step() while the step's copy back to the host was pending, through a "
                "tensor read from optimizer.state before that step (it held the value before the "
                "step, and the write would be lost). Read optimizer.state again after step() and "
                "write through what it returns.")
