"""Where and in what dtype an owner keeps its Muon momentum: ``dmuon.Muon(momentum_dtype=...,
offload_state=...)`` (:class:`MomentumStorage`); and the dtype of FSDP2's AdamW moments,
``adamw_state_dtype`` (:class:`AdamWStorage`: fp32 or bf16, rounded after each update).

The optimizer's ``muon_state.momentum[name]`` holds each owned matrix's momentum **as stored**:
in ``momentum_dtype`` (fp32, bf16, or an 8-bit float whose per-matrix power-of-two scale is kept
here, :mod:`dmuon.functional.state_dtype`), on the device or, with ``offload_state=True``, in
(pinned, on CUDA) host memory. Each ``step()``:

1. :meth:`MomentumStorage.prefetch` (at the start of the step, before the gradient reduces are
   waited): offloaded momentum is copied into device staging buffers, on a side stream on CUDA
   (an event orders the step after it), so the copy overlaps the tail of the backward's reduces;
2. :meth:`MomentumStorage.working`: the working momentum in the master's dtype (the staging buffer
   itself for fp32, else :func:`~dmuon.functional.state_dtype.decode` of it);
3. the owner's update runs on it (Newton–Schulz sees the updated value before it is rounded);
4. :meth:`MomentumStorage.commit`: :func:`~dmuon.functional.state_dtype.encode` back into the
   storage dtype, and (offload) copied back to the host buffers on the side stream (the staging
   buffers are freed once the copy ran; the next prefetch and every read of the host buffers wait
   for it).

With the defaults (fp32, on device) every call returns its input: bitwise the historical step.
Exactness: fp32 offload is bitwise the on-device step (copies are exact); bf16 / fp8 are the
one-process Muon that rounds its momentum the same way after each update
(:func:`~dmuon.functional.state_dtype.round_trip`), bitwise.

Transient memory: the working fp32 momentum of the owned matrices exists during ``step()`` only
(forward and backward run without it).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from dmuon.functional import state_dtype as sd
from dmuon.kernels.streams import side_stream

logger = logging.getLogger(__name__)

__all__ = ["MomentumStorage"]


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
        #: tensors copied host -> device (prefetch) and back (commit) so far (offload)
        self.copies_in = self.copies_out = 0
        self.bind(device if device is not None else torch.device("cpu"))
        self._copied_in: Optional[Any] = None   # event: staging buffers filled
        self._copied_out: Optional[Any] = None  # event: host buffers written back
        self._staging: Optional[dict[str, Tensor]] = None

    def bind(self, device: torch.device) -> None:
        """Set the masters' device (and, offloading on CUDA, the side stream of the copies)."""
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._stream = (side_stream(self.device, "state_offload") if (self.offload and self._cuda)
                        else None)

    @property
    def identity(self) -> bool:
        """fp32 on the device: the storage is the working momentum (no copy, no rounding)."""
        return self.dtype == torch.float32 and not self.offload

    # ------------------------------------------------------------------ layout
    def store(self, momentum: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``{name: stored data}`` of working-dtype ``momentum`` (encoded, offloaded); the scales
        are kept in :attr:`scales`. The identity by default."""
        if self.identity:
            return dict(momentum)
        out = {}
        for n, m in momentum.items():
            data, scale = sd.encode(m, self.dtype)
            if scale is not None:
                self.scales[n] = scale
            if self.offload:
                host = torch.empty(data.shape, dtype=data.dtype, device="cpu",
                                   pin_memory=self._cuda)
                host.copy_(data)
                data = host
            out[n] = data
        return out

    def stored_state(self, ms: Any) -> Any:
        """The ``MuonState`` ``ms`` (working momentum) with its momentum as stored."""
        return ms._replace(momentum=self.store(ms.momentum))

    def working_state(self, ms: Any, masters: Mapping[str, Tensor]) -> Any:
        """The stored ``MuonState`` ``ms`` with its working momentum (:meth:`working`)."""
        return ms._replace(momentum=self.working(ms.momentum, masters))

    def commit_state(self, ms: Any, work: Any) -> Any:
        """The updated working state ``work`` stored (:meth:`commit` into ``ms``'s buffers)."""
        return work._replace(momentum=self.commit(ms.momentum, work.momentum))

    def nbytes(self, stored: Mapping[str, Tensor]) -> dict[str, int]:
        """``{"device": bytes, "host": bytes}`` of the stored momentum and its scales (the scales
        stay on the device when the momentum is offloaded)."""
        data = sum(t.nbytes for t in stored.values())
        scales = sum(s.nbytes for s in self.scales.values())
        return {"device": scales + (0 if self.offload else data),
                "host": data if self.offload else 0}

    # ------------------------------------------------------------------ step
    def prefetch(self, stored: Mapping[str, Tensor]) -> None:
        """Offload: start copying the host momentum into device staging buffers (a side stream on
        CUDA). A no-op on device."""
        if not self.offload or self._staging is not None:
            return
        self.copies_in += len(stored)
        if self._stream is None:  # CPU: the same path, synchronously
            self._staging = {n: torch.empty_like(t, device=self.device).copy_(t)
                             for n, t in stored.items()}
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._staging = {n: torch.empty_like(t, device=self.device).copy_(t, non_blocking=True)
                             for n, t in stored.items()}
            self._copied_in = torch.cuda.Event()
            self._copied_in.record(self._stream)

    def working(self, stored: Mapping[str, Tensor],
                masters: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The working momentum (each in its master's dtype, on the device) for this step."""
        if self.identity:
            return dict(stored)
        if self.offload:
            self.prefetch(stored)
            if self._copied_in is not None:
                torch.cuda.current_stream(self.device).wait_event(self._copied_in)
                for t in self._staging.values():
                    t.record_stream(torch.cuda.current_stream(self.device))
            on_dev = self._staging
        else:
            on_dev = stored
        out = {}
        for n, data in on_dev.items():
            want = masters[n].dtype
            if data.dtype == want and self.dtype == torch.float32:
                out[n] = data  # fp32 offload: the staging buffer itself
            else:
                out[n] = sd.decode(sd.Stored(data, self.scales.get(n)), want)
        return out

    def commit(self, stored: Mapping[str, Tensor], work: Mapping[str, Tensor]
               ) -> dict[str, Tensor]:
        """Store this step's working momentum (encode; offload: copy back to the host buffers)
        and return the stored tree (the same host tensors when offloaded)."""
        self._copied_in = None
        if self.identity:
            return dict(work)
        enc = {}
        for n, w in work.items():
            data, scale = sd.encode(w, self.dtype)
            if scale is not None:
                self.scales[n] = scale
            enc[n] = data
        if not self.offload:
            return enc
        self._staging = None
        self.copies_out += len(enc)
        if self._stream is None:
            for n, t in enc.items():
                stored[n].copy_(t)
            return dict(stored)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for n, t in enc.items():
                stored[n].copy_(t, non_blocking=True)
                t.record_stream(self._stream)
            self._copied_out = torch.cuda.Event()
            self._copied_out.record(self._stream)
        return dict(stored)

    def synchronize(self) -> None:
        """Wait for the last copy back to the host buffers (before they are read or written)."""
        if self._copied_out is not None:
            self._copied_out.synchronize()
            self._copied_out = None

    # ------------------------------------------------------------------ checkpoints
    def values(self, stored: Mapping[str, Tensor], masters: Mapping[str, Tensor]
               ) -> dict[str, Tensor]:
        """``{name: momentum}`` for a checkpoint, on the device, exactly (fp32: the stored
        tensors themselves; bf16 and 8-bit floats: bf16, see
        :func:`~dmuon.functional.state_dtype.checkpoint_dtype`)."""
        if self.identity:
            return dict(stored)
        self.synchronize()
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
        saved = sd.check_state_dtype(saved_dtype)
        if saved != self.dtype:
            logger.warning("%s: the checkpoint's Muon momentum was stored in %s; this optimizer "
                           "stores it in %s (momentum_dtype): converted on load", what,
                           sd.dtype_name(saved), sd.dtype_name(self.dtype))
        self.synchronize()
        self.scales.clear()
        self._staging = None
        return self.store(momentum)


def check_storage(storage: MomentumStorage, transform: Any, rt: Any) -> None:
    """Refuse, at construction, the combinations this storage does not cover (never silently
    wrong): a variant's chain state (``transform=``), and an 8-bit momentum of tensor-parallel
    slices (each owner would scale its slice, not the matrix)."""
    if storage.identity:
        return
    if transform is not None:
        raise NotImplementedError(
            "dmuon.Muon: momentum_dtype other than torch.float32 and offload_state=True apply to "
            "Muon's momentum; a variant's chain state (transform=) is kept in fp32 on the device. "
            "Drop transform= or use momentum_dtype=torch.float32, offload_state=False.")
    if getattr(rt, "tp_layouts", None) and storage.dtype not in (torch.float32, torch.bfloat16):
        raise NotImplementedError(
            f"dmuon.Muon: momentum_dtype={storage.dtype} with tensor parallelism: the 8-bit "
            "momentum's per-matrix scale would be taken per TP slice. Use torch.bfloat16 (exact "
            "per element) or torch.float32 with TP.")


def checkpoint_momentum(optimizer: Any) -> dict[str, Tensor]:
    """``{name: momentum}`` of the owned matrices for a checkpoint (exact; see
    :meth:`MomentumStorage.values`); ``{}`` without Muon state."""
    ms = optimizer.muon_state
    if ms is None:
        return {}
    return optimizer._storage.values(ms.momentum, optimizer.dedicated_state.owned_masters())


def install_momentum(optimizer: Any, values: Mapping[str, Tensor], saved_dtype: Optional[str],
                     what: str) -> None:
    """Install checkpoint momentum ``values`` (full matrices this rank owns, any float dtype)
    into ``optimizer.muon_state`` (converted to its ``momentum_dtype``, with a logged note when the
    checkpoint's differs)."""
    ms = optimizer.muon_state
    if ms is None:
        return
    store = optimizer._storage
    if store.identity and sd.check_state_dtype(saved_dtype) == torch.float32:
        for n, t in values.items():
            ms.momentum[n].copy_(t)
        return
    masters = optimizer.dedicated_state.owned_masters()
    work = {n: (values[n] if n in values else store.values(ms.momentum, masters)[n])
            .to(device=masters[n].device, dtype=masters[n].dtype, copy=True) for n in ms.momentum}
    optimizer.muon_state = ms._replace(momentum=store.load(work, saved_dtype, what))


def state_nbytes(optimizer: Any) -> dict[str, int]:
    """``{"device": bytes, "host": bytes}`` this rank's optimizer holds for its owned matrices'
    Muon state (what :func:`dmuon.functional.memory_model.rank_memory` models)."""
    ms = optimizer.muon_state
    if ms is None:
        return {"device": 0, "host": 0}
    return optimizer._storage.nbytes(ms.momentum)


class AdamWStorage:
    """FSDP2's AdamW moments (``exp_avg``, ``exp_avg_sq`` of the local shards) stored in
    ``adamw_state_dtype``: ``torch.float32`` (default: as the params, bitwise as before) or
    ``torch.bfloat16`` (round to nearest even after each update; the update runs on the decoded
    values in the params' dtype, as torch's AdamW would, then rounds). 8-bit floats are refused:
    the second moment spans more binades than one scale per shard keeps.
    """

    def __init__(self, dtype: Any):
        self.dtype = sd.check_state_dtype(dtype, "adamw_state_dtype")
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dmuon.Muon adamw_state_dtype must be torch.float32 or "
                             f"torch.bfloat16, got {self.dtype}: AdamW's second moment spans "
                             "too many binades for an 8-bit float with one scale")

    @property
    def identity(self) -> bool:
        return self.dtype == torch.float32

    def _tree(self, tree: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {n: sd.encode(t, self.dtype).data for n, t in tree.items()}

    def stored_state(self, st: Any) -> Any:
        """The ``AdamWState`` ``st`` (working moments) with its moments as stored."""
        if self.identity:
            return st
        return st._replace(mu=self._tree(st.mu), nu=self._tree(st.nu))

    def working_state(self, st: Any, params: Mapping[str, Tensor]) -> Any:
        """The stored ``st`` with its moments decoded into the params' dtype (new tensors)."""
        if self.identity:
            return st
        return st._replace(**{k: {n: sd.decode(sd.Stored(t, None), params[n].dtype)
                                  for n, t in getattr(st, k).items()} for k in ("mu", "nu")})

    def commit_state(self, stored: Any, work: Any) -> Any:
        """The updated working state rounded back into ``stored``'s buffers."""
        if self.identity:
            return work
        for k in ("mu", "nu"):
            for n, t in getattr(work, k).items():
                getattr(stored, k)[n].copy_(sd.encode(t, self.dtype).data)
        return work._replace(mu=stored.mu, nu=stored.nu)

    def load(self, st: Any, saved_dtype: Optional[str], what: str) -> Any:
        """``stored_state`` of staged working moments read from a checkpoint whose AdamW moments
        were stored in ``saved_dtype`` (``None``: fp32); a note if that differs."""
        saved = sd.check_state_dtype(saved_dtype)
        if saved != self.dtype:
            logger.warning("%s: the checkpoint's AdamW moments were stored in %s; this optimizer "
                           "stores them in %s (adamw_state_dtype): converted on load", what,
                           sd.dtype_name(saved), sd.dtype_name(self.dtype))
        return self.stored_state(st)
