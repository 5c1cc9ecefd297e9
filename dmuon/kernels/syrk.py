"""Symmetric-output batched products (SYRK-style) for Newton–Schulz, in Triton, with a cuBLAS twin.

Math. For batched ``a: (B, m, k)`` and ``b: (B, m, k)`` whose product ``a @ b^T`` is known to be
symmetric (in NS: ``b = a``, or ``b`` a symmetric ``(B, m, m)`` matrix, so ``a b^T = a b``),
compute::

    out = alpha * (a @ b^T) + beta * c + gamma * I            (c: (B, m, m) symmetric, optional)

Only the tiles on and above the diagonal are computed; each off-diagonal tile is written twice, at
``(i, j)`` and transposed at ``(j, i)`` ("mirror"), so the result is exactly symmetric and about half
of a general product's flops are done. This covers every symmetric product of Newton–Schulz:

* ``X X^T`` (``b = a``: SYRK proper);
* ``A A`` for a symmetric ``A`` (``A A^T = A A``), and with the epilogue the whole polynomial
  ``b A + c A^2`` (direct NS) or ``a I + b A + c A^2`` (Gram NS) in one kernel;
* ``P Q`` for commuting symmetric ``P, Q`` (polynomials of the same Gram matrix), where
  ``P Q^T = P Q`` is symmetric.

Operands are read in their own dtype (fp16 or bf16 on the fast path), accumulated in fp32, and the
epilogue runs in fp32 before one cast to the output dtype. ``sym_abt_torch`` is the same function on cuBLAS
(``torch.baddbmm``), used where Triton is missing, on CPU, or where it is faster (see
``benchmarks/NOTES_ns.md`` for the measured shapes).

References: BLAS ``?syrk`` / ``?syr2k`` (symmetric rank-k updates, one triangle); the Triton matmul
tutorial for the tiling; Gram Newton–Schulz (symmetric ``m x m`` iterations) for why every square
product in NS has a symmetric result.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from dmuon.newton_schulz.iteration import SymOp
from dmuon.kernels.sym_reference import _check, sym_abt_torch
from dmuon.kernels.triton_support import TRITON_IMPORT_ERROR, tl, triton, triton_available

__all__ = ["triton_available", "sym_abt", "sym_abt_torch", "sym_abt_triton", "make_sym_op"]


if triton is not None:

    @triton.jit
    def _sym_abt_kernel(a_ptr, b_ptr, c_ptr, o_ptr, tiles_ptr, M, K,
                        s_ab, s_am, s_ak, s_bb, s_bm, s_bk, s_cb, s_cm, s_cn, s_ob, s_om, s_on,
                        alpha, beta, gamma,
                        HAS_C: tl.constexpr, HAS_GAMMA: tl.constexpr, EVEN: tl.constexpr,
                        SYMMETRIZE: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        bid = tl.program_id(1).to(tl.int64)
        ti = tl.load(tiles_ptr + 2 * pid)
        tj = tl.load(tiles_ptr + 2 * pid + 1)
        rm = ti * BLOCK + tl.arange(0, BLOCK)
        rn = tj * BLOCK + tl.arange(0, BLOCK)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + bid * s_ab + rm[:, None] * s_am + rk[None, :] * s_ak
        b_ptrs = b_ptr + bid * s_bb + rn[:, None] * s_bm + rk[None, :] * s_bk
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                kmask = rk[None, :] < K - k0
                a = tl.load(a_ptrs, mask=(rm[:, None] < M) & kmask, other=0.0)
                b = tl.load(b_ptrs, mask=(rn[:, None] < M) & kmask, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BLOCK_K * s_ak
            b_ptrs += BLOCK_K * s_bk
        acc = acc * alpha
        if HAS_C:
            c_ptrs = c_ptr + bid * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn
            if EVEN:
                cv = tl.load(c_ptrs)
            else:
                cv = tl.load(c_ptrs, mask=(rm[:, None] < M) & (rn[None, :] < M), other=0.0)
            acc += beta * cv.to(tl.float32)
        if HAS_GAMMA:
            acc += tl.where(rm[:, None] == rn[None, :], gamma, 0.0)
        res = acc.to(o_ptr.dtype.element_ty)
        # Every output element comes from ONE computed value: an off-diagonal tile is stored at
        # (ti, tj) and, transposed, at (tj, ti); a diagonal tile keeps its upper triangle
        # (diagonal included) and takes its lower one from the transposed upper one, in
        # registers. (With b != a, a tile's own lower half a_r . b_c differs from a_c . b_r by
        # rounding: measured 2x the NS error before this symmetrization.)
        if SYMMETRIZE:  # b is not a (a a^T tiles are symmetric as computed: same products)
            if ti == tj:
                res = tl.where(rm[:, None] <= rn[None, :], res, tl.trans(res))
        o_ptrs = o_ptr + bid * s_ob + rm[:, None] * s_om + rn[None, :] * s_on
        if EVEN:
            tl.store(o_ptrs, res)
        else:
            tl.store(o_ptrs, res, mask=(rm[:, None] < M) & (rn[None, :] < M))
        if ti != tj:  # mirror: the transposed tile lands at (tj, ti)
            t_ptrs = o_ptr + bid * s_ob + rn[:, None] * s_om + rm[None, :] * s_on
            if EVEN:
                tl.store(t_ptrs, tl.trans(res))
            else:
                tl.store(t_ptrs, tl.trans(res), mask=(rn[:, None] < M) & (rm[None, :] < M))


@functools.lru_cache(maxsize=64)
def _tile_table(n_tiles: int, device: str) -> Tensor:
    """int32 ``(T, 2)`` list of upper-triangle tile pairs ``(i, j)``, ``i <= j``, row-major."""
    pairs = [(i, j) for i in range(n_tiles) for j in range(i, n_tiles)]
    return torch.tensor(pairs, dtype=torch.int32, device=device).contiguous()


# Tile configuration: (BLOCK, BLOCK_K, num_warps, num_stages). 128x128 tiles with 8 warps use
# Hopper's warpgroup MMA; smaller matrices get 64x64 tiles so that the grid fills the chip.
_CONFIGS = {
    "large": (128, 64, 8, 3),
    "small": (64, 64, 4, 4),
}


def _pick_config(m: int, batch: int) -> tuple[int, int, int, int]:
    n_big = -(-m // 128)
    if batch * n_big * (n_big + 1) // 2 >= 132 * 2:
        return _CONFIGS["large"]
    return _CONFIGS["small"]


def sym_abt_triton(a: Tensor, b: Optional[Tensor] = None, *, alpha: float = 1.0,
                   beta: float = 0.0, c: Optional[Tensor] = None, gamma: float = 0.0,
                   out: Optional[Tensor] = None, config: Optional[tuple] = None) -> Tensor:
    """Triton ``alpha a b^T + beta c + gamma I`` computing one triangle of tiles and mirroring it.

    The caller guarantees that ``a b^T`` (and ``c``) are symmetric; the lower triangle is never
    computed, only copied from the upper one. Args as :func:`sym_abt_torch`; ``out`` (``(B, m, m)``,
    may not alias ``a``, ``b`` or ``c``) receives the result; ``config`` overrides the tile choice
    ``(BLOCK, BLOCK_K, num_warps, num_stages)``.
    """
    if triton is None:
        raise RuntimeError(f"Triton is not importable here ({TRITON_IMPORT_ERROR!r}); "
                           "use sym_abt_torch")
    # a a^T: every element (r, c) and (c, r) sums the same products in the same order, so the
    # diagonal tiles come out symmetric; a distinct b needs them symmetrized.
    symmetrize = b is not None and not (b is a or (b.data_ptr() == a.data_ptr()
                                                   and b.stride() == a.stride()
                                                   and b.shape == a.shape))
    b = a if b is None else b
    _check(a, b, c)
    bsz, m, k = a.shape
    if out is None:
        out = torch.empty((bsz, m, m), dtype=a.dtype, device=a.device)
    if bsz == 0 or m == 0:
        return out
    if k == 0:
        return sym_abt_torch(a, b, alpha=alpha, beta=beta, c=c, gamma=gamma)
    block, block_k, warps, stages = config or _pick_config(m, bsz)
    n_tiles = -(-m // block)
    tiles = _tile_table(n_tiles, str(a.device))
    even = (m % block == 0) and (k % block_k == 0)
    has_c = c is not None and beta != 0.0
    cc = c if has_c else out
    grid = (tiles.shape[0], bsz)
    _sym_abt_kernel[grid](
        a, b, cc, out, tiles, m, k,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        cc.stride(0), cc.stride(1), cc.stride(2), out.stride(0), out.stride(1), out.stride(2),
        float(alpha), float(beta), float(gamma),
        HAS_C=has_c, HAS_GAMMA=gamma != 0.0, EVEN=even, SYMMETRIZE=symmetrize,
        BLOCK=block, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return out


#: The persistent TMA kernel beat the pointer kernel on H200 for inner dimensions of 4096 and up
#: (``X X^T`` of long matrices: 1.1-1.25x; all 4096 x 4096 products: 1.15-1.2x) and lost or tied
#: at k = 1024-2048 (2048 x 2048 products with an epilogue: 0.87-0.96x), ``syrk_bench_h200.json``.
TMA_MIN_K = 4096

#: Below this many rows the triangle kernel lost to cuBLAS on H200 (512: 0.66-0.69x; 1024 and up:
#: 1.10-1.54x, benchmarks/NOTES_ns.md), so "auto" sends smaller products to cuBLAS.
TRITON_MIN_M = 1024


def sym_abt(a: Tensor, b: Optional[Tensor] = None, *, alpha: float = 1.0, beta: float = 0.0,
            c: Optional[Tensor] = None, gamma: float = 0.0, backend: str = "auto") -> Tensor:
    """``alpha a b^T + beta c + gamma I`` for a symmetric result, on the chosen backend.

    Args:
      a, b: ``(B, m, k)`` (``b=None``: ``b = a``, i.e. SYRK).
      alpha, beta, c, gamma: epilogue (``c`` symmetric ``(B, m, m)`` or None).
      backend: ``"triton"``, ``"torch"`` (cuBLAS / CPU) or ``"auto"`` (Triton on CUDA when it is
        importable and ``m >= TRITON_MIN_M``, cuBLAS otherwise). Triton means the persistent
        TMA kernel (:mod:`dmuon.kernels.syrk_tma`) where its shape and layout rules hold (Hopper,
        16-bit, ``m % 128 == 0``, ``k % 64 == 0``), the pointer kernel :func:`sym_abt_triton`
        elsewhere.

    Returns:
      ``(B, m, m)`` in ``a``'s dtype, exactly symmetric on the Triton path.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "auto":
        use = a.is_cuda and triton is not None and a.shape[-2] >= TRITON_MIN_M
        backend = "triton" if use else "torch"
    if backend == "triton":
        if _tma_applicable(a, b, c):
            from dmuon.kernels.syrk_tma import sym_abt_tma
            return sym_abt_tma(a, b, alpha=alpha, beta=beta, c=c, gamma=gamma)
        return sym_abt_triton(a, b, alpha=alpha, beta=beta, c=c, gamma=gamma)
    return sym_abt_torch(a, b, alpha=alpha, beta=beta, c=c, gamma=gamma)


def _tma_applicable(a: Tensor, b: Optional[Tensor], c: Optional[Tensor]) -> bool:
    """Whether the TMA kernel runs this product: it takes the operands
    (:func:`dmuon.kernels.syrk_tma.tma_supported`), the device is Hopper or newer, and the inner
    dimension is at least :data:`TMA_MIN_K` (where it beat the pointer kernel)."""
    from dmuon.kernels.syrk_tma import tma_supported
    return (a.shape[-1] >= TMA_MIN_K and tma_supported(a, b, c)
            and torch.cuda.get_device_capability(a.device)[0] >= 9)


def make_sym_op(backend: str = "auto") -> SymOp:
    """The ``sym=`` hook of :func:`dmuon.newton_schulz.iteration.newton_schulz` on a backend.

    Args:
      backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see :func:`sym_abt`).

    Returns:
      ``sym(a, b=None, *, alpha=1.0, beta=0.0, c=None, gamma=0.0)`` computing
      ``alpha a b^T + beta c + gamma I`` with :func:`sym_abt` on that backend.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")

    def sym(a: Tensor, b: Optional[Tensor] = None, *, alpha: float = 1.0, beta: float = 0.0,
            c: Optional[Tensor] = None, gamma: float = 0.0) -> Tensor:
        return sym_abt(a, b, alpha=alpha, beta=beta, c=c, gamma=gamma, backend=backend)
    return sym
