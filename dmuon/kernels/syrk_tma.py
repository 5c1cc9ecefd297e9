"""Persistent, TMA-fed symmetric-output batched product (SYRK-style) for Hopper, in Triton.

Math (the contract of :func:`dmuon.kernels.syrk.sym_abt_triton`). For batched ``a, b: (B, m, k)``
whose product ``a @ b^T`` is known to be symmetric (``b = a``, or ``b`` a symmetric ``(B, m, m)``
matrix commuting with ``a``), compute::

    out = alpha * (a @ b^T) + beta * c + gamma * I            (c: (B, m, m) symmetric, optional)

with fp32 accumulation, an fp32 epilogue and one cast to ``out``'s dtype. Only output tiles on or
above the diagonal are computed. Each strictly-upper ``BM x BM`` tile is stored twice, directly at
``(i, j)`` and transposed at ``(j, i)``; in a diagonal tile the upper part (diagonal included) is
stored directly and the strictly upper part transposed into the lower part (TMA stores, which
cannot be masked, build that symmetric tile in registers first). Every output element is thus
written from exactly one computed value, so ``out`` equals ``out^T`` bit for bit (the old kernel's
diagonal tiles are not mirror-exact when ``b`` is given). ``c`` is read on/above the diagonal only,
so ``out`` may be ``c``.

Work decomposition. A work item is a ``BM x BN`` stripe (``BN = BM`` or ``2 BM``): super-tiles of
``BN x BN`` on/above the diagonal, in lower-row-major order of ``(J, I)`` (consecutive items share
the column block ``J``, which helps L2), each split into ``BN / BM`` row stripes. With ``BN = 2 BM``
the lower-left ``BM x BM`` block of a diagonal super-tile is computed and discarded (3-11 % extra
flops for m = 4096..1024) in exchange for a larger, more efficient MMA tile. The item index is
mapped to ``(batch, I, J)`` arithmetically (no tile table), and a persistent grid of
``programs_per_sm x #SMs`` programs strides over all items.

Layouts. ``a`` is contiguous ``(B, m, k)`` or the transposed view of a contiguous ``(B, k, m)``
tensor (``a.mT.is_contiguous()``: tall matrices kept in their own layout); the same holds for a
given ``b``; ``c`` and ``out`` are contiguous ``(B, m, m)``. The batch is flattened into rows of a
2-D view, ``(B m, k)`` or ``(B k, m)``, on which the TMA descriptors are built: this is valid
because ``m % BN == 0`` and ``k % BK == 0``, so no tile straddles two matrices. Shapes or layouts
outside this raise ``ValueError`` (the caller then falls back to ``sym_abt_triton``). Pointer
loads and/or pointer (masked) stores, selected by the same kernel's constexprs, do the same math;
warp specialization on Hopper needs the pointer stores. Both paths run in Triton's interpreter
(CPU), where descriptors are emulated, so every config is checked without a GPU.

References: BLAS ``?syrk`` (symmetric rank-k update, one triangle); the idea of a persistent,
descriptor-fed matmul loop follows Triton's "persistent matmul" tutorial (not its code); NVIDIA
Hopper TMA / ``wgmma`` documentation for the operand layouts (K-major and MN-major 16-bit tiles).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Union

import torch
from torch import Tensor

from dmuon.kernels.sym_reference import _check, sym_abt_torch
from dmuon.kernels.triton_support import TRITON_IMPORT_ERROR, interpreting, tl, triton

__all__ = ["CONFIGS", "DEFAULT_CONFIG", "sym_abt_tma", "resolve_config", "tma_supported"]

log = logging.getLogger(__name__)

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

#: Keys of a config: tile (block_m, block_n = block_m or 2 block_m, block_k), launch (num_warps,
#: num_stages), grid (persistent, programs_per_sm, num_programs = explicit override), data path
#: (tma_load: descriptors for a/b/c loads; tma_store: descriptor stores of out) and loop options
#: of the persistent loop (flatten, warp_specialize: ``tl.range`` arguments).
DEFAULT_CONFIG: dict[str, Any] = dict(
    block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, persistent=True,
    programs_per_sm=1, num_programs=None, tma_load=True, tma_store=True, flatten=False,
    warp_specialize=False)

#: Named presets for sweeps (each overrides DEFAULT_CONFIG). On Hopper, Triton 3.6 warp-
#: specializes a loop only with num_warps=4 (it then adds a producer warpgroup and splits the tile
#: over two consumer warpgroups: 12 warps) and only without descriptor stores, hence the "_ws"
#: presets store through pointers.
CONFIGS: dict[str, dict[str, Any]] = {
    "p128x256": {},
    "p128x256_s4": dict(num_stages=4),
    "p128x256_flat": dict(flatten=True),
    "np128x256": dict(persistent=False),
    "p128x128": dict(block_n=128, num_stages=4),
    "p128x128_flat": dict(block_n=128, num_stages=4, flatten=True),
    "p128x128_bk128": dict(block_n=128, block_k=128, num_stages=3),
    "p128x128_2x": dict(block_n=128, num_stages=2, programs_per_sm=2),
    "p64x128": dict(block_m=64, block_n=128, num_warps=4, num_stages=4),
    "p128x128_ptr": dict(block_n=128, num_stages=3, tma_load=False, tma_store=False),
}


if triton is not None:

    @triton.jit
    def _work_item(t, n_sup, R: tl.constexpr):
        """Item ``t`` -> (batch, row tile in BM units, column block in BN units)."""
        per_b = (n_sup * (n_sup + 1) // 2) * R
        bid = t // per_b
        s = t - bid * per_b
        sup = s // R
        stripe = s - sup * R
        # sup = J (J + 1) / 2 + I with 0 <= I <= J: invert with a float sqrt, then fix rounding.
        jj = ((tl.sqrt((8 * sup + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
        jj = tl.where(jj * (jj + 1) // 2 > sup, jj - 1, jj)
        jj = tl.where((jj + 1) * (jj + 2) // 2 <= sup, jj + 1, jj)
        ii = sup - jj * (jj + 1) // 2
        return bid, ii * R + stripe, jj

    @triton.jit
    def _epilogue_tma(v, bid, i, j, c_desc, o_desc, o_ptr, M, n_rows, alpha, beta, gamma,
                      HAS_C: tl.constexpr, PRED: tl.constexpr, BM: tl.constexpr):
        """Finish the fp32 ``BM x BM`` tile ``v`` of ``a b^T`` at tile (i, j) of matrix ``bid``;
        TMA loads of ``c``, TMA stores of ``out``.

        j < i: dropped. j > i: stored at (i, j) and transposed at (j, i). i == j: made symmetric
        in registers (lower part := transpose of the upper part) and stored once. With ``PRED``
        the stores are predicated (sent fully out of bounds, where TMA writes nothing) instead of
        branched on: the loop flattener rejects stores under an ``if``.
        """
        rl = tl.arange(0, BM)
        keep = j >= i
        r0 = bid * M + i * BM  # row in the flattened (B m, m) views of c and out
        rt = bid * M + j * BM  # row of the mirrored tile
        v = v * alpha
        if HAS_C:
            cv = c_desc.load([tl.where(keep, r0, n_rows), j * BM])  # OOB: zeros, no traffic
            v += beta * cv.to(tl.float32)
        v += tl.where((rl[:, None] == rl[None, :]) & (i == j), gamma, 0.0)
        res = v.to(o_ptr.dtype.element_ty)
        if PRED:
            if i == j:
                res = tl.where(rl[:, None] <= rl[None, :], res, tl.trans(res))
            o_desc.store([tl.where(keep, r0, n_rows), j * BM], res)
            o_desc.store([tl.where(j > i, rt, n_rows), i * BM], tl.trans(res))
        else:
            if i == j:
                o_desc.store([r0, j * BM], tl.where(rl[:, None] <= rl[None, :], res, tl.trans(res)))
            elif j > i:
                o_desc.store([r0, j * BM], res)
                o_desc.store([rt, i * BM], tl.trans(res))

    @triton.jit
    def _epilogue_ptr(v, bid, row0, col0, c_desc, c_ptr, o_ptr, M, s_cm, s_om, alpha, beta, gamma,
                      HAS_C: tl.constexpr, C_TMA: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr):
        """Finish the fp32 ``BM x BN`` tile ``v`` at rows ``row0``, columns ``col0`` of matrix
        ``bid`` with element masks: the part on/above the diagonal is stored directly, the part
        strictly above it transposed (disjoint masks, so each element is written once per side)."""
        rm = bid * M + row0 + tl.arange(0, BM)  # flattened rows of out / c
        rn = col0 + tl.arange(0, BN)
        gm = row0 + tl.arange(0, BM)            # rows within the matrix
        up = rn[None, :] >= gm[:, None]
        v = v * alpha
        if HAS_C:
            if C_TMA:  # whole tile; what lies below the diagonal is never stored
                cv = c_desc.load([bid * M + row0, col0])
            else:
                cv = tl.load(c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :], mask=up,
                             other=0.0)
            v += beta * cv.to(tl.float32)
        v += tl.where(rn[None, :] == gm[:, None], gamma, 0.0)
        res = v.to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + rm[:, None].to(tl.int64) * s_om + rn[None, :], res, mask=up)
        tr = bid * M + rn                       # mirrored: rows = our columns
        tl.store(o_ptr + tr[:, None].to(tl.int64) * s_om + gm[None, :], tl.trans(res),
                 mask=rn[:, None] > gm[None, :])

    @triton.jit
    def _sym_tma_kernel(a_desc, b_desc, c_desc, o_desc, a_ptr, b_ptr, c_ptr, o_ptr,
                        M, K, n_items, n_progs,
                        s_ab, s_am, s_ak, s_bb, s_bm, s_bk, s_cm, s_om,
                        alpha, beta, gamma,
                        HAS_C: tl.constexpr, C_TMA: tl.constexpr, A_T: tl.constexpr,
                        B_T: tl.constexpr,
                        TMA_LOAD: tl.constexpr, TMA_STORE: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        FLATTEN: tl.constexpr, WS: tl.constexpr):
        R: tl.constexpr = BN // BM
        n_sup = M // BN
        k_tiles = K // BK
        n_rows = (n_items // ((n_sup * (n_sup + 1) // 2) * R)) * M  # B m: first row out of bounds
        for t in tl.range(tl.program_id(0), n_items, n_progs, flatten=FLATTEN, warp_specialize=WS):
            bid, ti, tj = _work_item(t, n_sup, R)
            row0 = ti * BM
            col0 = tj * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kk in range(k_tiles):
                k0 = kk * BK
                if TMA_LOAD:
                    if A_T:  # 2-D view (B k, m): load [BK, BM] and feed the MMA MN-major
                        av = a_desc.load([bid * K + k0, row0]).T
                    else:    # 2-D view (B m, k)
                        av = a_desc.load([bid * M + row0, k0])
                    if B_T:
                        bv = b_desc.load([bid * K + k0, col0])
                    else:
                        bv = b_desc.load([bid * M + col0, k0]).T
                else:
                    bid64 = bid.to(tl.int64)
                    rm = (row0 + tl.arange(0, BM)).to(tl.int64)
                    rn = (col0 + tl.arange(0, BN)).to(tl.int64)
                    rk = (k0 + tl.arange(0, BK)).to(tl.int64)
                    av = tl.load(a_ptr + bid64 * s_ab + rm[:, None] * s_am + rk[None, :] * s_ak)
                    bv = tl.load(b_ptr + bid64 * s_bb + rk[:, None] * s_bk + rn[None, :] * s_bm)
                acc = tl.dot(av, bv, acc)
            if not TMA_STORE:
                _epilogue_ptr(acc, bid, row0, col0, c_desc, c_ptr, o_ptr, M, s_cm, s_om, alpha,
                              beta, gamma, HAS_C, C_TMA, BM, BN)
            elif BN == BM:
                _epilogue_tma(acc, bid, ti, tj, c_desc, o_desc, o_ptr, M, n_rows, alpha, beta,
                              gamma, HAS_C, FLATTEN, BM)
            else:  # two BM x BM halves of the BM x 2BM stripe
                lo, hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BM)), (0, 2, 1)))
                _epilogue_tma(lo, bid, ti, 2 * tj, c_desc, o_desc, o_ptr, M, n_rows, alpha, beta,
                              gamma, HAS_C, FLATTEN, BM)
                _epilogue_tma(hi, bid, ti, 2 * tj + 1, c_desc, o_desc, o_ptr, M, n_rows, alpha,
                              beta, gamma, HAS_C, FLATTEN, BM)


def resolve_config(config: Union[None, str, dict], m: int = 0, bsz: int = 0,
                   n_sms: int = 132, plain: bool = False) -> dict[str, Any]:
    """Full config dict from ``None`` (heuristic), a preset name of :data:`CONFIGS`, or a dict.

    The heuristic: a plain ``a a^T`` (``plain``: no distinct ``b``, no ``c`` term) with
    ``m % 256 == 0`` takes ``p128x256_flat`` (fastest there on H200, ``syrk_bench_h200.json``);
    otherwise 128x256 stripes when they fill every SM twice, else 128x128.
    """
    if config is None:
        n2 = m // 256
        items_256 = bsz * n2 * (n2 + 1)  # 128x256 stripes
        if plain and m % 256 == 0:
            config = "p128x256_flat"
        else:
            config = "p128x256" if m % 256 == 0 and items_256 >= 2 * n_sms else "p128x128"
    if isinstance(config, str):
        if config not in CONFIGS:
            raise ValueError(f"unknown sym_abt_tma config {config!r}; presets: {sorted(CONFIGS)}")
        config = CONFIGS[config]
    if not isinstance(config, dict):
        raise ValueError(f"config must be None, a preset name or a dict, got {type(config).__name__}")
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    if cfg["block_n"] not in (cfg["block_m"], 2 * cfg["block_m"]):
        raise ValueError(f"block_n must be block_m or 2*block_m, got {cfg['block_n']}/{cfg['block_m']}")
    return cfg


def _layout(x: Tensor, name: str) -> bool:
    """False for contiguous (B, r, s), True for the transposed view of a contiguous (B, s, r)."""
    if x.is_contiguous():
        return False
    if x.mT.is_contiguous():
        return True
    raise ValueError(f"sym_abt_tma: {name} must be contiguous or a transposed view of a contiguous "
                     f"tensor; got strides {tuple(x.stride())} for shape {tuple(x.shape)}")


def tma_supported(a: Tensor, b: Optional[Tensor] = None, c: Optional[Tensor] = None, *,
                  block_m: int = 128, block_k: int = 64) -> bool:
    """Whether :func:`sym_abt_tma` takes these operands (with the 128-row presets): CUDA, 16-bit,
    ``m % block_m == 0``, ``k % block_k == 0``, ``a`` and ``b`` contiguous or transposed views of
    contiguous tensors, ``c`` contiguous. The caller decides whether it also pays (shapes)."""
    if not (a.is_cuda and a.ndim == 3 and a.dtype in (torch.bfloat16, torch.float16)):
        return False
    m, k = a.shape[-2], a.shape[-1]
    if m % block_m or k % block_k:
        return False
    for x in (a, b):
        if x is not None and not (x.is_contiguous() or x.mT.is_contiguous()):
            return False
    if b is not None and b.dtype != a.dtype:
        return False
    return c is None or c.is_contiguous()


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _flat(x: Tensor, transposed: bool) -> Tensor:
    """The 2-D row-major view of the batch: (B r, s), or (B s, r) for a transposed view."""
    base = x.mT if transposed else x
    return base.reshape(-1, base.shape[-1])


def sym_abt_tma(a: Tensor, b: Optional[Tensor] = None, *, alpha: float = 1.0, beta: float = 0.0,
                c: Optional[Tensor] = None, gamma: float = 0.0, out: Optional[Tensor] = None,
                config: Union[None, str, dict] = None) -> Tensor:
    """``alpha a b^T + beta c + gamma I`` (symmetric result) with a persistent TMA Hopper kernel.

    Same contract as :func:`dmuon.kernels.syrk.sym_abt_triton`: the caller guarantees that
    ``a b^T`` and ``c`` are symmetric; the output is exactly symmetric. ``out`` (contiguous
    ``(B, m, m)``; may be ``c``, must not alias ``a`` or ``b``) receives the result when given.

    Args:
      a: ``(B, m, k)`` bf16/fp16, contiguous or a transposed view of a contiguous ``(B, k, m)``.
      b: ``None`` (``b = a``) or ``(B, m, m)`` of ``a``'s dtype in one of the same two layouts.
      alpha, beta, gamma: epilogue scalars; ``c`` (contiguous ``(B, m, m)``) is read when not None
        and ``beta != 0``.
      out: optional contiguous ``(B, m, m)`` output.
      config: ``None`` (heuristic), a preset name of :data:`CONFIGS` or a dict of overrides of
        :data:`DEFAULT_CONFIG`.

    Raises:
      ValueError: for shapes, dtypes, layouts or devices this kernel does not handle (the caller
        should fall back to ``sym_abt_triton`` / ``sym_abt_torch``).
    """
    if triton is None:
        raise RuntimeError(f"Triton is not importable here ({TRITON_IMPORT_ERROR!r})")
    b_given = b is not None
    b = a if b is None else b
    _check(a, b, c)
    if not (a.is_cuda or interpreting()):
        raise ValueError("sym_abt_tma needs CUDA tensors (or TRITON_INTERPRET=1)")
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"sym_abt_tma needs bf16/fp16 operands, got {a.dtype}")
    bsz, m, k = a.shape
    interp = interpreting()
    n_sms = 4 if interp else _num_sms(a.device.index if a.device.index is not None else
                                      torch.cuda.current_device())
    cfg = resolve_config(config, m, bsz, n_sms,
                         plain=not b_given and (c is None or beta == 0.0))
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    if m % bn or m % bm or k % bk:
        raise ValueError(f"sym_abt_tma with block_m={bm}, block_n={bn}, block_k={bk} needs "
                         f"m % {bn} == 0 and k % {bk} == 0; got m={m}, k={k}")
    a_t = _layout(a, "a")
    b_t = _layout(b, "b") if b_given else a_t
    if out is None:
        out = torch.empty((bsz, m, m), dtype=a.dtype, device=a.device)
    elif out.shape != (bsz, m, m) or not out.is_contiguous() or out.device != a.device:
        raise ValueError(f"out must be a contiguous ({bsz}, {m}, {m}) tensor on {a.device}")
    has_c = c is not None and beta != 0.0
    if has_c and (not c.is_contiguous() or c.device != a.device):
        raise ValueError("sym_abt_tma needs a contiguous c on a's device")
    if bsz == 0 or m == 0:
        return out
    if k == 0:
        return out.copy_(sym_abt_torch(a, b, alpha=alpha, beta=beta, c=c, gamma=gamma))
    for name, x in (("a", a), ("b", b), ("c", c if has_c else out), ("out", out)):
        if x.data_ptr() % 16:
            raise ValueError(f"sym_abt_tma needs 16-byte aligned {name}")

    cc = c if has_c else out
    a2, b2 = _flat(a, a_t), _flat(b, b_t)
    descs: list[Any] = [None, None, None, None]
    if cfg["tma_load"]:
        descs[0] = TensorDescriptor.from_tensor(a2, [bk, bm] if a_t else [bm, bk])
        descs[1] = TensorDescriptor.from_tensor(b2, [bk, bn] if b_t else [bn, bk])
    # c through TMA: by BM x BM halves in the TMA epilogue, by whole tiles in the pointer one,
    # not at all under warp specialization (Triton 3.6's Hopper partitioner rejects it there).
    c_tma = has_c and cfg["tma_load"] and (cfg["tma_store"] or not cfg["warp_specialize"])
    if c_tma:
        descs[2] = TensorDescriptor.from_tensor(cc.reshape(-1, m),
                                                [bm, bm] if cfg["tma_store"] else [bm, bn])
    if cfg["tma_store"]:
        descs[3] = TensorDescriptor.from_tensor(out.view(-1, m), [bm, bm])
    n_sup = m // bn
    n_items = bsz * (n_sup * (n_sup + 1) // 2) * (bn // bm)
    if cfg["num_programs"]:
        n_progs = min(n_items, int(cfg["num_programs"]))
    elif cfg["persistent"]:
        n_progs = min(n_items, n_sms * int(cfg["programs_per_sm"]))
    else:
        n_progs = n_items
    log.debug("sym_abt_tma B=%d m=%d k=%d a_t=%s b_t=%s items=%d programs=%d cfg=%s",
              bsz, m, k, a_t, b_t, n_items, n_progs, cfg)
    _sym_tma_kernel[(n_progs,)](
        *descs, a, b, cc, out, m, k, n_items, n_progs,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        cc.stride(1), out.stride(1),
        float(alpha), float(beta), float(gamma),
        HAS_C=has_c, C_TMA=c_tma, A_T=a_t, B_T=b_t, TMA_LOAD=bool(cfg["tma_load"]),
        TMA_STORE=bool(cfg["tma_store"]), BM=bm, BN=bn, BK=bk,
        FLATTEN=bool(cfg["flatten"]), WS=bool(cfg["warp_specialize"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
