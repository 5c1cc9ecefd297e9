"""Storage dtypes of optimizer state (pure): the one definition of how a state tensor is kept
in fp32, bf16 or an 8-bit float, and how it comes back.

A state tensor ``x`` (Muon's momentum) is **stored** in ``dtype`` and **updated** in the working
dtype (the master's: fp32 or fp64): the optimizer decodes it, runs its update on the decoded
value (Newton–Schulz sees the updated value before it is rounded again), and encodes the result.

* ``torch.float32`` (or ``None``): stored as is, in the working dtype (4 bytes per element for
  fp32 masters, 8 for fp64 masters); :func:`encode` is the identity, so the default path is
  bitwise the historical one.
* ``torch.bfloat16``: round to nearest even (2 bytes per element); exact to decode.
* ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``: ``data = round(x / scale)`` in the 8-bit float,
  with one fp32 **power-of-two** scale per matrix (1 byte per element + 4 bytes per matrix),
  ``scale = 2**ceil(log2(amax / fmax))``. A power of two makes the decoded value ``data·scale``
  exact in bf16 and fp32, so a checkpoint carries it exactly in bf16 and re-encoding it gives the
  same decoded values (a lossless round trip through any checkpoint, any topology). The scale
  is :func:`scale_from_absmax` of the matrix's :func:`absmax`; a matrix cut into tensor-parallel
  slices takes the MAX of its slices' absmaxes (the caller's collective), so every slice encodes
  with the whole matrix's scale (``encode(..., amax=)``).

Per matrix or per row (measured on the momentum of the demo's Llama-shaped model after 30 Muon
steps, all 14 projections, fp8 e4m3fn, mean relative Frobenius error of one round trip
``‖decode(encode(b)) − b‖ / ‖b‖``): per matrix 0.0265, per row 0.0265 (equal to 4 digits; bf16:
0.0017). With power-of-two scales, rounding is scale-invariant except for values pushed into the
8-bit subnormal range (below ``2**-6`` of the scale), which a momentum matrix's dynamic range
rarely reaches; a scale per row would buy nothing for ``4·rows`` more bytes, so dmuon keeps one
scale per matrix.

Stochastic rounding is not offered (not measured): with a decaying momentum (``b ← μ·b + g``)
each step's rounding error is damped by ``μ`` rather than summed as in a weight.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["STATE_DTYPES", "STEP_CHUNK_BYTES", "chunk_peak", "Stored", "check_state_dtype",
           "absmax", "scale_from_absmax", "encode", "decode", "round_trip", "state_nbytes",
           "checkpoint_dtype", "dtype_name", "is_scaled"]

#: The storage dtypes offered (``None`` means ``torch.float32``).
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_scaled(dtype: object) -> bool:
    """Whether a state stored in ``dtype`` carries a per-matrix scale (the 8-bit floats)."""
    return dtype in _FP8

#: The owner's step decodes a stored momentum in chunks of at most this many bytes of working
#: (decoded) momentum (a larger matrix is a chunk of its own): ``dmuon.Muon``'s default
#: (:mod:`dmuon.stateful.optimizer.state_storage`) and the memory model's.
STEP_CHUNK_BYTES = 256 * 2**20


def chunk_peak(sizes: "list[int]", chunk_bytes: Optional[int] = STEP_CHUNK_BYTES) -> int:
    """The most bytes one chunk can hold when matrices of ``sizes`` bytes are packed into chunks
    of at most ``chunk_bytes`` (a larger matrix alone; ``None``: one chunk), in any order, as
    the owner's step packs its working momentum: ``min(total, max(largest, chunk_bytes))``."""
    total = sum(sizes)
    if chunk_bytes is None or not sizes:
        return total
    return min(total, max(max(sizes), chunk_bytes))


class Stored(NamedTuple):
    """One stored state tensor: ``data`` in the storage dtype and its fp32 ``scale`` (a 0-d tensor
    for the 8-bit floats, ``None`` otherwise)."""

    data: Tensor
    scale: Optional[Tensor]


def check_state_dtype(dtype: object, what: str = "momentum_dtype") -> torch.dtype:
    """``dtype`` as one of :data:`STATE_DTYPES` (``None`` -> ``torch.float32``; also the names
    ``"fp32"``, ``"bf16"``, ``"fp8"`` (e4m3fn) and ``str(torch dtype)``).

    Raises:
      ValueError: any other value (the message lists the choices).
    """
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    names.update({str(d): d for d in STATE_DTYPES})
    names.update({str(d).replace("torch.", ""): d for d in STATE_DTYPES})
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype in names:
        return names[dtype]
    if isinstance(dtype, torch.dtype) and dtype in STATE_DTYPES:
        return dtype
    raise ValueError(f"{what} must be one of {[str(d) for d in STATE_DTYPES]} (or 'fp32', "
                     f"'bf16', 'fp8'), got {dtype!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """``"torch.bfloat16"``-style name (what param groups and checkpoints carry)."""
    return str(dtype)


def _fmax(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


@torch.no_grad()
def absmax(x: Tensor) -> Tensor:
    """``max |x|`` as a 0-d fp32 tensor on ``x``'s device (0 for an empty ``x``): what
    :func:`scale_from_absmax` takes. A matrix cut into slices (tensor parallelism) has the MAX
    of its slices' absmaxes (exact), so every slice can encode with the whole matrix's scale."""
    return x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)


@torch.no_grad()
def scale_from_absmax(amax: Tensor, dtype: torch.dtype) -> Tensor:
    """The fp32 power-of-two scale of a matrix whose absolute max is ``amax`` (a 0-d tensor, or a
    vector: one scale per entry) stored in the 8-bit float ``dtype``: ``2**ceil(log2(amax /
    fmax))`` exactly, clamped to an fp32 normal, 1 where ``amax`` is 0; on the device, no host
    sync (frexp: ``v = m * 2**e`` with ``m`` in ``[0.5, 1)``: ``ceil(log2 v) = e``, or ``e - 1``
    when ``v`` is a power of two). The one definition :func:`encode` uses.

    Raises:
      ValueError: ``dtype`` is not an 8-bit float.
    """
    if dtype not in _FP8:
        raise ValueError(f"scale_from_absmax: {dtype} has no scale (only {list(map(str, _FP8))})")
    amax = amax.float()
    m, e = torch.frexp(amax / _fmax(dtype))
    k = torch.where(m == 0.5, e - 1, e)
    k = torch.where(amax > 0, k, torch.zeros_like(k)).clamp_(-126, 127)  # an fp32 normal
    return torch.ldexp(torch.ones_like(amax), k)


@torch.no_grad()
def encode(x: Tensor, dtype: torch.dtype, out: Optional[Tensor] = None,
           amax: Optional[Tensor] = None) -> Stored:
    """``x`` stored in ``dtype`` (see the module docstring); ``x`` itself for fp32 (of an fp32 or
    fp64 ``x``).

    Args:
      x: the state tensor in its working dtype (fp32 or fp64).
      dtype: one of :data:`STATE_DTYPES`.
      out: write the data into this tensor (of the storage dtype and ``x``'s shape) and return
        it as ``data`` (the same rounding: a copy into a narrower dtype rounds as ``.to`` does).
      amax: the 8-bit floats: the absolute max the scale is taken from (default ``absmax(x)``).
        A slice of a matrix passes the whole matrix's (``>= absmax(x)``), so that it encodes as
        its part of the whole matrix's encoding, bitwise.
    """
    if dtype == torch.float32 and x.dtype in (torch.float32, torch.float64):
        return Stored(x if out is None else out.copy_(x), None)  # fp32: "as the master"
    if dtype not in _FP8:
        return Stored(x.to(dtype) if out is None else out.copy_(x), None)
    fmax = _fmax(dtype)
    scale = scale_from_absmax(absmax(x) if amax is None else amax.to(x.device), dtype)
    data = (x / scale.to(x.dtype)).clamp_(-fmax, fmax)
    return Stored(data.to(dtype) if out is None else out.copy_(data), scale)


@torch.no_grad()
def decode(stored: Stored, dtype: torch.dtype, out: Optional[Tensor] = None) -> Tensor:
    """The value of ``stored`` in ``dtype`` (into ``out`` if given). Exact: bf16 and 8-bit
    values times a power of two are representable in fp32 / fp64 (and in bf16)."""
    data, scale = stored
    if out is None:
        out = torch.empty(data.shape, dtype=dtype, device=data.device)
    out.copy_(data)
    if scale is not None:
        out.mul_(scale.to(out.device))
    return out


def round_trip(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``decode(encode(x, dtype), x.dtype)``: what storing ``x`` in ``dtype`` leaves of it (the
    one-process reference applies this after each update)."""
    return decode(encode(x, dtype), x.dtype)


def state_nbytes(numel: int, dtype: object, matrices: int = 1,
                 working: torch.dtype = torch.float32) -> int:
    """Bytes of ``matrices`` state tensors with ``numel`` elements in all, stored in ``dtype``
    (fp32: as the master, ``working``; the 8-bit floats: plus one 4-byte scale per matrix)."""
    dtype = check_state_dtype(dtype)
    if dtype == torch.float32:
        return numel * max(working.itemsize, 4)
    return numel * dtype.itemsize + (4 * matrices if dtype in _FP8 else 0)


def checkpoint_dtype(dtype: torch.dtype, working: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a checkpoint holds the state in, exactly: the working dtype for fp32, bf16 for
    bf16 and the 8-bit floats (their power-of-two scales make ``data·scale`` exact in bf16)."""
    dtype = check_state_dtype(dtype)
    return working if dtype == torch.float32 else torch.bfloat16
