"""Where and in what dtype the owners keep the momentum field of their chain
(:class:`MomentumStorage`: fp32 / bf16 / 8-bit floats with per-matrix scales, on the device or
offloaded), the step's chunked access to it (:class:`StepIO`, the momentum stage's io) and the
runtime listener that starts offloaded copies with the backward (:class:`StorageListener`).
With fp32 on the device the storage is the working momentum (bitwise the historical step).
FSDP2's AdamW moments (:class:`AdamWStorage`) share the note a converting load logs.
Design notes: docs/design/optimizer.md, "Momentum storage"."""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from dmuon.functional import adamw_storage as fadamw_storage
from dmuon.functional import state_dtype as sd
from dmuon.functional.momentum_chunks import step_chunks, within_room
from dmuon.stateful.optimizer.offload_copies import NoCopies, OffloadCopies

logger = logging.getLogger(__name__)

__all__ = ["MomentumStorage", "StepIO", "CHUNK_BYTES", "PREFETCH_BYTES", "StorageListener",
           "note_conversion", "AdamWStorage"]

#: The step's chunk budget: bytes of working (decoded) momentum alive at once, by default
#: (:data:`dmuon.functional.state_dtype.STEP_CHUNK_BYTES`; read when a storage is built).
CHUNK_BYTES = sd.STEP_CHUNK_BYTES
#: Offload: bytes of momentum the backward copies to the device ahead of the step, by default
#: (``None``: every hook group's, as its reduce is issued).
PREFETCH_BYTES: Optional[int] = None


class MomentumStorage:
    """The storage of one optimizer's owned momentum (see the module docstring).

    Args:
      dtype: ``momentum_dtype`` (checked by :func:`~dmuon.functional.state_dtype.check_state_dtype`).
      offload: keep it in host memory between steps.
      device: the masters' device (``None``: set later by :meth:`bind`).
    """

    def __init__(self, dtype: Any, offload: bool, device: Optional[torch.device]):
        self.dtype = sd.check_state_dtype(dtype)
        if not isinstance(offload, bool):
            raise TypeError(f"dmuon.Muon offload_state must be True or False, got {offload!r}")
        self.offload = offload
        self.scales: dict[str, Tensor] = {}
        #: TP, 8-bit floats (:meth:`share_scales`): the TP slices' names; the MAX over the TP group
        self.shared_names: frozenset = frozenset()
        self._max_reduce: Optional[Callable[[Tensor], Tensor]] = None
        #: bytes of working momentum one chunk of the step decodes at most (a larger matrix is a
        #: chunk of its own); see the module docstring
        self.chunk_bytes = CHUNK_BYTES
        #: offload: bytes of staged (storage-dtype) momentum the backward may copy ahead of the
        #: step (``None``: every group's, as its reduce is issued); the step copies the rest a
        #: chunk ahead of its use
        self.prefetch_bytes: Optional[int] = PREFETCH_BYTES
        #: chunks the last step ran (0: the identity storage, no chunking)
        self.last_chunks = 0
        self.bind(device if device is not None else torch.device("cpu"))

    def bind(self, device: torch.device) -> None:
        """Set the masters' device and the copies' :class:`OffloadCopies` (on device:
        :class:`NoCopies`: ``copies.staged`` is empty, its calls no-ops)."""
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.copies = OffloadCopies(self.device) if self.offload else NoCopies()

    @property
    def identity(self) -> bool:
        """fp32 on the device: the storage is the working momentum (no copy, no rounding)."""
        return self.dtype == torch.float32 and not self.offload

    def share_scales(self, names: Sequence[str], max_reduce: Callable[[Tensor], Tensor]) -> None:
        """TP: the 8-bit scale of each of ``names`` (this rank's TP slices, the same names on
        every rank of its TP group) is its whole matrix's: ``max_reduce`` (``TPStep.
        max_over_group``, a collective) maps the slices' absmaxes to the matrices', once per step
        or load. Only 8-bit floats have a scale: other dtypes share none (decided here)."""
        self.shared_names = frozenset(names) if sd.is_scaled(self.dtype) else frozenset()
        self._max_reduce = max_reduce

    def whole_absmax(self, names: Sequence[str], amaxes: Sequence[Tensor]) -> dict[str, Tensor]:
        """``{name: the whole matrix's absmax}`` from this slice's ``amaxes``: one collective
        (every rank of the TP group calls it with the same names, in the same order)."""
        if not names:
            return {}
        return dict(zip(names, self._max_reduce(torch.stack(list(amaxes))).unbind()))

    # ------------------------------------------------------------------ layout
    def store(self, momentum: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``{name: stored data}`` of working-dtype ``momentum`` (encoded, offloaded); the scales
        are kept in :attr:`scales` (TP slices: their matrices', one collective). Or the identity."""
        if self.identity:
            return dict(momentum)
        shared = [n for n in momentum if n in self.shared_names]
        amax = self.whole_absmax(shared, [sd.absmax(momentum[n]) for n in shared])
        out = {}
        for n, m in momentum.items():
            data, scale = sd.encode(m, self.dtype, amax=amax.get(n))
            if scale is not None:
                self.scales[n] = scale
            if self.offload:
                host = torch.empty(data.shape, dtype=data.dtype, device="cpu",
                                   pin_memory=self._cuda)
                host.copy_(data)
                data = host
            out[n] = data
        return out

    def nbytes(self, stored: Mapping[str, Tensor]) -> dict[str, int]:
        """``{"device": bytes, "host": bytes}`` of the stored momentum and its scales (the scales
        stay on the device when the momentum is offloaded)."""
        data = sum(t.nbytes for t in stored.values())
        scales = sum(s.nbytes for s in self.scales.values())
        return {"device": scales + (0 if self.offload else data),
                "host": data if self.offload else 0}

    # ------------------------------------------------------------------ step
    def prefetch(self, stored: Mapping[str, Tensor], *, ahead: bool = False) -> None:
        """Offload: start copying the host momentum ``stored`` (``{name: host tensor}``; names
        already staged are skipped) into device staging buffers, a plain copy on CPU. On CUDA the
        buffers are allocated on the current stream (so they reuse what the backward freed) and
        filled on the side stream after the work queued so far (one event for the batch, waited
        before the first use). A no-op on device.

        Called per hook group when its gradient reduce is issued in backward
        (:class:`StorageListener`, for the owned names of the group; ``ahead=True``:
        only while the staged bytes stay within :attr:`prefetch_bytes`) and by the step for the
        rest, a chunk ahead."""
        if not self.offload:
            return
        staged = self.copies.staged
        todo = {n: t for n, t in stored.items() if n not in staged}
        if ahead and self.prefetch_bytes is not None:  # within the budget (staged bytes count)
            room = self.prefetch_bytes - sum(b.nbytes for b, _ in staged.values())
            todo = {n: todo[n] for n in within_room({n: t.nbytes for n, t in todo.items()}, room)}
        if todo:
            self.copies.copy_in(todo)

    # ------------------------------------------------------------------ checkpoints
    def values(self, stored: Mapping[str, Tensor], masters: Mapping[str, Tensor]
               ) -> dict[str, Tensor]:
        """``{name: momentum}`` for a checkpoint, on the device, exactly (fp32: the stored
        tensors themselves; bf16 and 8-bit floats: bf16, see
        :func:`~dmuon.functional.state_dtype.checkpoint_dtype`)."""
        if self.identity:
            return dict(stored)
        self.copies.synchronize()
        out = {}
        for n, data in stored.items():
            want = sd.checkpoint_dtype(self.dtype, masters[n].dtype)
            out[n] = sd.decode(sd.Stored(data.to(self.device), self.scales.get(n)), want)
        return out

    def load(self, momentum: Mapping[str, Tensor], saved_dtype: Optional[str],
             what: str) -> dict[str, Tensor]:
        """``store`` of working-dtype ``momentum`` read from a checkpoint saved with
        ``momentum_dtype = saved_dtype`` (``None``: fp32); one ``logging`` note if that differs
        from this optimizer's."""
        note_conversion(saved_dtype, self.dtype, what)
        self.copies.synchronize()
        self.scales.clear()
        self.copies.staged.clear()  # a load replaced the host tensors
        return self.store(momentum)


class StepIO:
    """One step's access to the stored momentum, chunk by chunk (the
    :class:`~dmuon.functional.stages.momentum.MomentumIO` of :func:`dmuon.functional.muon.update`).

    Chunks: the active matrices, those already staged first (in the order their copies were
    started: the backward's reduce order), greedily packed up to
    :attr:`MomentumStorage.chunk_bytes` of working momentum (a larger matrix alone). Per chunk:
    the next chunk's copy-in is started (offload), this chunk's copies are waited (an event per
    hook group on CUDA), its momentum decoded (fp32 offload: the staging buffer itself), updated,
    encoded into the stored tensor (on device) or copied back to the host buffer (offload: on the
    side stream, the staging buffer released once the copy ran).
    """

    def __init__(self, storage: MomentumStorage, stored: Mapping[str, Tensor],
                 masters: Mapping[str, Tensor]):
        self.st, self.stored, self.masters = storage, stored, masters
        storage.last_chunks = 0
        self._amax: dict[str, Tensor] = {}  # TP slices: their matrices' absmax this step
        self._measuring = False  # in the momentum stage's first pass (the TP slices' absmax)
        self._plan: list[list[str]] = []
        self._next = 0

    def chunks(self, names: Sequence[str]) -> list[list[int]]:
        st = self.st
        nbytes = {n: self.masters[n].nbytes for n in names}
        out = step_chunks(names, list(st.copies.staged), nbytes, st.chunk_bytes)
        self._plan = [[names[k] for k in ks] for ks in out]
        self._next = 0
        st.last_chunks += len(out)
        return out

    def shared(self, names: Sequence[str]) -> list[int]:
        """Positions of the TP slices among ``names`` (8-bit floats): the momentum stage measures
        their updated absmax in a first pass and hands it to :meth:`share_absmax` (offload with
        a ``prefetch_bytes`` cap: the first pass drops each chunk's staged copies, as a step
        would, so the cap holds; without a cap they stay for the storing pass)."""
        mine = self.st.shared_names.intersection(names)
        self._measuring = bool(mine)
        return [k for k, n in enumerate(names) if n in mine]

    def share_absmax(self, names: Sequence[str], amaxes: Sequence[Tensor]) -> None:
        """The matrices' absmaxes (one MAX all-reduce over the TP group for all of ``names``):
        each slice then encodes with its whole matrix's scale in :meth:`store`."""
        self._amax, self._measuring = self.st.whole_absmax(names, amaxes), False

    def load(self, names: Sequence[str], stored: Sequence[Tensor]) -> list[Tensor]:
        st = self.st
        self._next += 1
        if not st.offload:
            return [sd.decode(sd.Stored(t, st.scales.get(n)), self.masters[n].dtype)
                    for n, t in zip(names, stored)]
        st.prefetch({n: self.stored[n] for n in names})  # not staged in backward
        if self._next < len(self._plan):  # the next chunk's copy overlaps this chunk's math
            st.prefetch({n: self.stored[n] for n in self._plan[self._next]})
        out = []
        for n, buf in zip(names, st.copies.wait(names)):
            want = self.masters[n].dtype
            if buf.dtype == want and st.dtype == torch.float32:
                out.append(buf)  # fp32 offload: the staging buffer itself
            else:
                out.append(sd.decode(sd.Stored(buf, st.scales.get(n)), want))
            if self._measuring and st.prefetch_bytes is not None:
                st.copies.staged.pop(n)  # the decoded copy is all the first pass reads
        return out

    def holds(self, names: Sequence[str], buffers: Sequence[Tensor]) -> bool:
        return len(names) == len(buffers) and all(
            self.stored.get(n) is b for n, b in zip(names, buffers))

    def store(self, names: Sequence[str], stored: Sequence[Tensor],
              work: Sequence[Tensor]) -> None:
        st = self.st
        enc = []
        for n, t, w in zip(names, stored, work):  # on device: encoded into the stored tensor
            if n in st.shared_names and n not in self._amax:
                raise RuntimeError(f"dmuon: TP slice {n!r} without its matrix's absmax (internal)")
            data, scale = sd.encode(w, st.dtype, out=None if st.offload else t,
                                    amax=self._amax.get(n))
            if scale is not None:
                st.scales[n] = scale
            enc.append(data)
        if not st.offload:
            return
        st.copies.copy_out(names, stored, enc)  # now or, past the step's budget, at the next
        # forward (offload_copies.py)


def note_conversion(saved_dtype: Optional[str], dtype: torch.dtype, what: str,
                    state: str = "Muon momentum", option: str = "momentum_dtype") -> None:
    """The one logged note of a load that converts a state saved in ``saved_dtype`` (``None``:
    fp32) into this optimizer's ``dtype``."""
    saved = sd.check_state_dtype(saved_dtype)
    if saved != dtype:
        logger.warning("%s: the checkpoint's %s was stored in %s; this optimizer stores it in %s "
                       "(%s): converted on load", what, state, sd.dtype_name(saved),
                       sd.dtype_name(dtype), option)


class AdamWStorage(fadamw_storage.AdamWStorage):
    """FSDP2's AdamW moments in ``adamw_state_dtype`` (the pure rules:
    :class:`dmuon.functional.adamw_storage.AdamWStorage`) with :meth:`load` (checkpoints)."""

    def load(self, st: Any, saved_dtype: Optional[str], what: str) -> Any:
        """``stored_state`` of staged working moments read from a checkpoint whose AdamW moments
        were stored in ``saved_dtype`` (``None``: fp32); a note if that differs."""
        note_conversion(saved_dtype, self.dtype, what, "AdamW moments", "adamw_state_dtype")
        return self.stored_state(st)


class StorageListener:
    """The runtime's listener (:meth:`~dmuon.stateful.runtime.state.DedicatedState.set_listener`)
    of one optimizer (held weakly: the model does not keep it alive): when a hook group's reduce
    is issued, its owned offloaded momentum starts its copy to the device
    (:meth:`MomentumStorage.prefetch`, ``ahead``) and, with ``set_ns_overlap``, the group's early
    owner update launches (:mod:`dmuon.stateful.optimizer.ns_overlap`, dropped when the gradients
    are cleared); when a forward reaches its first hook group, the copies back the last step
    deferred start (:meth:`OffloadCopies.flush`)."""

    def __init__(self, optimizer: Any):
        self.ref, self.generation = weakref.ref(optimizer), optimizer._generation

    def reduce_issued(self, names: Any) -> None:
        opt = self.ref()
        if opt is not None and opt.dedicated_state.is_current(self.generation):
            opt._overlap.reduce_issued(names)  # ns_overlap: the group's early owner update
            if opt._storage.offload:
                mom = opt._owner.stored_momentum()
                opt._storage.prefetch({n: mom[n] for n in names if n in mom}, ahead=True)

    def grads_cleared(self) -> None:
        if (opt := self.ref()) is not None:
            opt._overlap.discard()

    def group_forward(self) -> None:  # also once when a newer optimizer replaces this listener
        if (opt := self.ref()) is not None:
            opt._storage.copies.flush()  # offload: the copies back the last step deferred


def state_nbytes(optimizer: Any) -> dict[str, int]:
    """``{"device": bytes, "host": bytes}`` this rank's optimizer holds for its owned matrices'
    Muon state (what :func:`dmuon.functional.memory_model.rank_memory` models)."""
    return optimizer._storage.nbytes(optimizer._owner.stored_momentum())
