"""Per-matrix scale and dtype cast at memory speed: the NS engine's gather and scatter.

Math. For a contiguous batch ``src`` of ``B`` matrices of ``N`` elements each (any float dtype)
and an optional per-matrix ``denom`` (``B`` fp32 values)::

    dst[b, i] = cast(src[b, i] / denom[b])        (or cast(src[b, i]) without denom)

computed in fp32 with an IEEE-rounded division and one round-to-nearest-even cast to ``dst``'s
dtype: bitwise what ``torch.div(src, denom, out=dst)`` / ``dst.copy_(src)`` give. The gather of
the NS engine is ``denom = ||G||_F + eps`` (the Frobenius normalization of
:func:`dmuon.newton_schulz.iteration.frobenius_normalize`); the scatter is the plain cast back
to the parameter dtype.

Why a kernel: PyTorch runs a broadcast division with a dtype change, and a bf16 -> fp32 copy,
on its generic (non-vectorized) elementwise path, measured at 0.9-1.8 TB/s on H200
(``benchmarks/ns_breakdown.py``); a flat Triton loop streams at close to the copy bandwidth.
Where Triton or CUDA is missing the torch ops above run instead (same result).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dmuon.kernels.triton_support import tl, triton, triton_available, wrote

__all__ = ["scale_cast_"]


_BLOCK = 4096
#: The kernel computes in fp32, so it only takes dtypes that fp32 holds exactly (fp64 goes to
#: torch, which keeps fp64 exact).
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:

    @triton.jit
    def _scale_cast_kernel(src_ptr, dst_ptr, denom_ptr, n,
                           HAS_DENOM: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src_ptr + b * n + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DENOM:
            d = tl.load(denom_ptr + b)
            x = tl.math.div_rn(x, d)
        tl.store(dst_ptr + b * n + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def scale_cast_(dst: Tensor, src: Tensor, denom: Optional[Tensor] = None) -> Tensor:
    """``dst <- src / denom`` per matrix (or ``dst <- src``), cast to ``dst.dtype``; returns ``dst``.

    Args:
      dst: contiguous ``(B, ...)`` tensor (written; may have another float dtype than ``src``).
      src: contiguous tensor with ``dst``'s shape (read; must not overlap ``dst``).
      denom: ``None`` or a tensor of ``B`` fp32 values (any shape with ``B`` elements, e.g.
        ``(B, 1, 1)``): the per-matrix divisor, leading dim of ``dst`` indexing matrices.

    Returns:
      ``dst``.
    """
    if dst.shape != src.shape:
        raise ValueError(f"scale_cast_: dst{tuple(dst.shape)} and src{tuple(src.shape)} differ")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("scale_cast_ needs contiguous dst and src (use .contiguous() first)")
    bsz = dst.shape[0] if dst.ndim > 0 else 1
    if denom is not None and denom.numel() != bsz:
        raise ValueError(f"denom has {denom.numel()} values for {bsz} matrices")
    if dst.numel() == 0:
        return dst
    use_triton = (triton_available() and dst.is_cuda and src.is_cuda
                  and src.dtype in _KERNEL_DTYPES and dst.dtype in _KERNEL_DTYPES
                  and (denom is None or (denom.is_cuda and denom.dtype == torch.float32))
                  and bsz <= 65535)
    if not use_triton:
        if denom is None:
            return dst.copy_(src)
        view = denom.reshape((bsz,) + (1,) * (src.ndim - 1))
        return torch.div(src, view, out=dst)
    n = dst.numel() // bsz
    grid = (triton.cdiv(n, _BLOCK), bsz)
    d = denom.reshape(bsz).contiguous() if denom is not None else dst
    _scale_cast_kernel[grid](src, dst, d, n, HAS_DENOM=denom is not None, BLOCK=_BLOCK,
                             num_warps=8)
    wrote(dst)
    return dst
