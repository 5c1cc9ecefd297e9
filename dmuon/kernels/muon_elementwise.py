"""Fused (Triton, CUDA) implementations of Muon's two elementwise stages: the ``elementwise=``
hook of :func:`dmuon.functional.muon.update` (:class:`~dmuon.functional.muon.MuonElementwise`).

The stages and their arithmetic live in the functional core: the momentum stage
(:mod:`dmuon.functional.stages.momentum`, :func:`~dmuon.functional.stages.momentum.foreach_momentum_`)
and the applying stage (:mod:`dmuon.functional.stages.decoupled`,
:func:`~dmuon.functional.stages.decoupled.foreach_apply_`). This module computes the same
formulas, one pass per tensor, in fp32 registers::

    momentum:  b ← μ·b + g;   x ← g + μ·b          (x may live in g's storage)
    apply:     p ← p·decay + alpha·u                (decay = 1 − lr·wd, alpha = −lr·s)

Traffic per fp32 element: momentum reads ``b, g`` and writes ``b, x`` (16 B; the foreach
implementation makes three passes, 32 B); apply reads ``p, u`` and writes ``p`` (12 B; foreach 20 B
with weight decay). The foreach ops round after every op (``b·μ`` is rounded before ``+ g``); here
each stored value is rounded once, so results differ by at most about one unit in the last place
of the stored dtype. ``x`` is computed from the *stored* (rounded) new ``b``, as foreach reads it
back.

Tensors the kernels do not take (not CUDA, not contiguous, param dtype other than fp32 / bf16 /
fp16, e.g. fp64 masters) go to the foreach implementations unchanged (bitwise the default path).
One launch per tensor and stage; Triton specializes each launch on the pointers' 16-byte
alignment, so aligned tensors get 16-byte vector loads.

References: the fused optimizer kernels of PyTorch (``torch._fused_adamw_``) for the one-pass
layout; K. Jordan, "Muon", 2024, for the Nesterov form.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
from torch import Tensor

from dmuon.functional.muon import MuonElementwise, foreach_apply_, foreach_momentum_
from dmuon.kernels.triton_support import interpreting, tl, triton, triton_available, wrote

__all__ = ["fused_elementwise", "momentum_", "apply_", "fused_supported"]


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = 4096
_WARPS = 8

if triton is not None:
    @triton.jit
    def _momentum_kernel(b_ptr, g_ptr, x_ptr, n, mu, NESTEROV: tl.constexpr,
                         BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        b_new = (b * mu + g).to(b_ptr.dtype.element_ty)
        tl.store(b_ptr + offs, b_new, mask=mask)
        if NESTEROV:
            x = g + mu * b_new.to(tl.float32)
            tl.store(x_ptr + offs, x.to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _apply_kernel(p_ptr, u_ptr, n, decay, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask).to(tl.float32)
        tl.store(p_ptr + offs, (p * decay + alpha * u).to(p_ptr.dtype.element_ty), mask=mask)


def fused_supported(*tensors: Optional[Tensor]) -> bool:
    """True when the kernels take these tensors: one CUDA device (or Triton's interpreter),
    contiguous, the first (the param / momentum) fp32, bf16 or fp16, the others floating, and all
    of one numel."""
    ts = [t for t in tensors if t is not None]
    if triton is None or not ts or ts[0].dtype not in _DTYPES:
        return False
    dev = ts[0].device
    n = ts[0].numel()
    return all(t.device == dev and t.is_contiguous() and t.is_floating_point()
               and t.dtype != torch.float64 and t.numel() == n for t in ts) \
        and (dev.type == "cuda" or interpreting())


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def momentum_(bs: list[Tensor], gs: list[Tensor], xs: Optional[list[Tensor]], mu: float) -> None:
    """``b ← μ·b + g`` and (``xs`` given) ``x ← g + μ·b``, one fused pass per tensor; the contract
    of :func:`dmuon.functional.stages.momentum.foreach_momentum_` (tensors the kernel does not take
    go there)."""
    def launch(k: int) -> bool:
        b, g, x = bs[k], gs[k], None if xs is None else xs[k]
        if not fused_supported(b, g, x) or g.dtype != b.dtype or b.numel() == 0:
            return False
        _momentum_kernel[_grid(b.numel())](b, g, g if x is None else x, b.numel(), float(mu),
                                           NESTEROV=x is not None, BLOCK=_BLOCK, num_warps=_WARPS)
        wrote(b, x)
        return True

    rest = _launch_all(bs, launch)
    if rest:
        foreach_momentum_([bs[k] for k in rest], [gs[k] for k in rest],
                          None if xs is None else [xs[k] for k in rest], mu)


def apply_(ps: list[Tensor], us: list[Tensor], decay: float, alphas: Sequence[float]) -> None:
    """``p ← p·decay + alpha·u``, one fused pass per tensor; the contract of
    :func:`dmuon.functional.stages.decoupled.foreach_apply_` (tensors the kernel does not take go
    there)."""
    def launch(k: int) -> bool:
        p, u = ps[k], us[k]
        if not fused_supported(p, u) or p.numel() == 0:
            return False
        _apply_kernel[_grid(p.numel())](p, u, p.numel(), float(decay), float(alphas[k]),
                                        BLOCK=_BLOCK, num_warps=_WARPS)
        wrote(p)
        return True

    rest = _launch_all(ps, launch)
    if rest:
        foreach_apply_([ps[k] for k in rest], [us[k] for k in rest], decay,
                       [alphas[k] for k in rest])


def _launch_all(ts: list[Tensor], launch) -> list[int]:
    """Call ``launch(k)`` for every tensor, with the tensors' CUDA device current; the ``k`` it
    declined."""
    dev = next((t.device for t in ts if t.is_cuda), None)
    with torch.cuda.device(dev) if dev is not None else contextlib.nullcontext():
        return [k for k in range(len(ts)) if not launch(k)]


def fused_elementwise() -> Optional[MuonElementwise]:
    """The fused stages as a :class:`~dmuon.functional.muon.MuonElementwise` hook, or ``None``
    where they cannot run (no Triton or no CUDA device; then use the default foreach stages)."""
    if not (triton_available() or (triton is not None and interpreting())):
        return None
    return MuonElementwise(momentum=momentum_, apply=apply_)
