"""Newton–Schulz orthogonalization: the approximate polar factor ``U V^T`` of ``G = U S V^T``.

Both variants compute, for a schedule ``(a_k, b_k, c_k)`` (see :mod:`dmuon.newton_schulz.coefficients`),

    X_0 = G / (||G||_F + eps),    X_{k+1} = p_k(X_k) = a_k X_k + (b_k A_k + c_k A_k^2) X_k,
    A_k = X_k X_k^T,

on the wide orientation (``m <= n``; a tall input is transposed, iterated and transposed back, which
gives the same function because ``p_k(X^T) = p_k(X)^T`` but works with the smaller ``m x m`` Gram).
Each step maps every singular value ``s`` to ``a s + b s^3 + c s^5`` and keeps singular vectors.

**Direct** runs the recurrence as written: per step ``A = X X^T``, ``B = b A + c A A``,
``X = a X + B X``.

**Gram** never forms the ``m x n`` iterates between restarts. Write ``X_k = Q_k X_0`` and
``P_k = a_k I + Z_k`` with ``Z_k = b_k A_k + c_k A_k^2``, so ``X_{k+1} = P_k X_k`` and

    Q_{k+1} = P_k Q_k = a_k Q_k + Z_k Q_k            (Q_0 = I, hence Q_1 = P_0: no product)
    A_{k+1} = X_{k+1} X_{k+1}^T = P_k A_k P_k^T = P_k A_k P_k
            = a_k R_k + Z_k R_k,   R_k = a_k A_k + A_k Z_k,

using that ``P_k`` is a polynomial in the symmetric ``A_k`` (hence symmetric and commuting with
``A_k``). Only ``m x m`` products appear; ``X = Q X_0`` is formed at the end. In exact arithmetic
this is the same function as direct NS; for ``n > 1.5 m`` it costs fewer flops
(:mod:`dmuon.newton_schulz.cost`).

**Restarts.** In low precision the recurrence for ``A`` drifts from ``Q X_0 (Q X_0)^T`` (rounding
errors are amplified by the large early coefficients; spurious negative eigenvalues and eigenvector
drift, as analysed by Dao, Zhang, Amsel, Chen, "Gram Newton-Schulz", 2026,
https://tridao.me/blog/2026/gram-newton-schulz/). Every ``gram_restart`` iterations (before every
iteration ``i > 0`` with ``i % gram_restart == 0``) the Gram variant re-materializes
``X_0 <- Q X_0``, recomputes ``A = X_0 X_0^T`` from it and resets ``Q = I``. The default,
``gram_restart="auto"``, takes the period from the compute dtype (:func:`default_gram_restart`):
3 for fp16 (one restart in 5 steps), 2 otherwise; ``None`` disables restarts.

**Compute dtype.** ``dtype=None`` means fp16 on CUDA and fp32 elsewhere (:func:`default_ns_dtype`).
Every NS iterate is bounded (``X_0`` has Frobenius norm 1; with the Polar Express schedule the
eigenvalues of ``A`` stay below 2 and those of ``Z`` below 9, and ``Q`` below ``prod_k a_k``, about
1e3), so fp16 never overflows, and its 11-bit mantissa makes the iteration about 8x closer to fp64
than bf16's 8 bits at the same tensor-core rate. Its narrow exponent range is the catch: the
typical entry of a normalized ``m x n`` matrix is ``1/sqrt(m n)`` (1.3e-4 at 4096x14336), near
fp16's subnormals (below 6.1e-5), hence the range lift below.

**Range lift (fp16).** The first iterations run on the lifted ``X~ = s X_0`` with ``s = 2^7``
(:func:`default_range_lift`; 1 for other dtypes): entries of order ``s / sqrt(m n)`` instead of
``1 / sqrt(m n)``, and ``A~ = X~ X~^T = s^2 A`` (eigenvalues at most ``s^2 = 2^14``, inside fp16's
range). Every update is linear in ``X`` and ``A`` except ``Z = b A + c A^2``, computed as
``(b / s^2) A~ + (c / s^4) A~^2`` (scalars applied to the fp32 accumulator); ``Q`` and ``Z`` keep
their natural scale. The lift ends at the first Gram restart, whose product ``X_0 <- Q X~_0 / s``
re-materializes ``X`` at its natural scale (by then its singular values are of order 1), or at the
last general product (``alpha = 1/s``). Powers of two commute with rounding, so apart from the
subnormals it removes the lifted iteration rounds exactly like the plain one.

Measured on the H200 (``benchmarks/ns_accuracy.py``; Gaussian, decaying, low-rank, power-law and
row-scaled inputs from 512x2048 to 8192x28672): the lift brings fp16 1.0-3.0x closer to the fp64
iteration (most on Gaussian and row-scaled inputs of 2048x8192 and up), and fp16 with one restart
and the lift is 4.8-10x closer than bf16 with two restarts, 5.9-10x on the weaker half of the
singular directions.

**Symmetric products.** ``A``, ``Z``, ``Q``, ``R`` are all polynomials of one symmetric Gram
matrix, so every ``m x m`` product above (and ``X X^T``) has a symmetric result. Each goes through
one op, ``sym(a, b, alpha, beta, c, gamma) = alpha a b^T + beta c + gamma I`` (the ``sym=`` hook,
default :func:`sym_product` on ``torch.baddbmm``), so a GPU kernel that computes one triangle and
fuses the polynomial into its epilogue replaces all of them at once. ``P = a I + Z`` is not
formed as an operand (the products take ``Z`` and add ``a`` times the other factor in the
epilogue), which rounds better in bf16 than rounding ``a + z_ii``.

References: K. Jordan, "Muon" (2024), https://kellerjordan.github.io/posts/muon/ ; N. Amsel et al.,
"The Polar Express" (2025), arXiv:2505.16932.
"""
from __future__ import annotations

import math
from typing import Callable, Literal, NamedTuple, Optional, Union

import torch
from torch import Tensor

from dmuon.newton_schulz.coefficients import CoefficientSpec, ns_coefficient_table
from dmuon.newton_schulz.cost import DEFAULT_GRAM_RESTART, choose_ns_variant

__all__ = ["FinalProduct", "GramRestart", "SymOp", "default_gram_restart", "default_ns_dtype",
           "default_range_lift", "resolve_gram_restart", "frobenius_denominator",
           "frobenius_normalize", "left_product", "newton_schulz", "ns_iterate", "sym_product",
           "NSPlan", "ns_plan", "ns_run"]

#: ``sym(a, b=None, *, alpha=1.0, beta=0.0, c=None, gamma=0.0) -> Tensor``; see :func:`sym_product`.
SymOp = Callable[..., Tensor]
#: ``final(p, x, *, alpha=1.0, beta=0.0, c=None) -> Tensor | None``; see :func:`left_product` and
#: :func:`ns_iterate`.
FinalProduct = Callable[..., Optional[Tensor]]
#: A Gram restart period: an int ``k >= 1`` (restart before every iteration ``i > 0`` with
#: ``i % k == 0``), ``None`` or 0 (never), or ``"auto"`` (:func:`default_gram_restart`).
GramRestart = Union[int, None, Literal["auto"]]

#: Gram restart period per compute dtype under ``gram_restart="auto"``; dtypes not listed use
#: :data:`~dmuon.newton_schulz.cost.DEFAULT_GRAM_RESTART` (2). fp16 carries 3 more mantissa bits
#: than bf16, so its Gram recurrence drifts less and one restart in 5 steps keeps it 2-10x closer to
#: fp64 than bf16 with two restarts (module docstring), with one ``4 m^2 n``-flop restart fewer.
GRAM_RESTART_BY_DTYPE = {torch.float16: 3}

#: Range lift ``s`` per compute dtype (module docstring): fp16's normal range starts at 6.1e-5,
#: above the typical entry of a normalized 4096x14336 matrix (1.3e-4 is near it, 8192x28672's
#: 6.9e-5 at it); ``2^7`` lifts entries 128x while ``s^2 = 2^14`` keeps ``A~`` far below 65504.
#: bf16, fp32 and fp64 share fp32's exponent range and need none (1).
RANGE_LIFT_BY_DTYPE = {torch.float16: 2.0 ** 7}


def default_ns_dtype(device: torch.device | str) -> torch.dtype:
    """The compute dtype used when ``dtype=None``: float16 on CUDA, float32 elsewhere.

    fp16 rather than bf16 on CUDA: the same tensor-core rate, 8x finer rounding, and NS never
    leaves fp16's range (module docstring).
    """
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def default_gram_restart(dtype: torch.dtype) -> int:
    """The Gram restart period ``gram_restart="auto"`` means for compute ``dtype``.

    3 for float16 (:data:`GRAM_RESTART_BY_DTYPE`), else
    :data:`~dmuon.newton_schulz.cost.DEFAULT_GRAM_RESTART` (2).
    """
    return GRAM_RESTART_BY_DTYPE.get(dtype, DEFAULT_GRAM_RESTART)


def default_range_lift(dtype: torch.dtype) -> float:
    """The range lift ``s`` (a power of two) the iteration uses in compute ``dtype``: ``2^7`` for
    float16 (:data:`RANGE_LIFT_BY_DTYPE`), 1 otherwise (module docstring)."""
    return RANGE_LIFT_BY_DTYPE.get(dtype, 1.0)


def resolve_gram_restart(gram_restart: GramRestart, dtype: torch.dtype) -> int | None:
    """Validate ``gram_restart`` and turn it into a period (``None``: never) for ``dtype``.

    Raises:
      ValueError: not ``"auto"``, ``None`` or an int ``>= 0``.
    """
    if isinstance(gram_restart, str) and gram_restart == "auto":
        return default_gram_restart(dtype)
    if gram_restart is not None and (isinstance(gram_restart, bool) or
                                     not isinstance(gram_restart, int) or gram_restart < 0):
        raise ValueError(f"gram_restart must be 'auto', None or an int >= 0 (0: no restarts), "
                         f"got {gram_restart!r}")
    return gram_restart or None


def frobenius_denominator(x: Tensor, eps: float, dtype: torch.dtype, *,
                          lift: float = 1.0) -> Tensor:
    """``(||X||_F + eps) / lift`` per matrix (last two dims), shape ``(..., 1, 1)``, in at least fp32.

    The divisor of :func:`frobenius_normalize`, computed in ``promote(x.dtype, dtype, float32)``;
    exposed so that a fused gather (the GPU engine's scale-and-cast kernel) divides by exactly
    the same numbers. ``lift`` is the range lift (a power of two, :func:`default_range_lift`), so
    dividing by it is exact and the quotient is ``lift`` times the plain one.
    """
    acc = torch.promote_types(torch.promote_types(x.dtype, dtype), torch.float32)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=acc).add_(eps)
    return norm if lift == 1.0 else norm.div_(lift)


def frobenius_normalize(x: Tensor, eps: float, dtype: torch.dtype, *,
                        out: Tensor | None = None, lift: float = 1.0) -> Tensor:
    """``X_0 = lift * X / (||X||_F + eps)`` per matrix (last two dims), in at least fp32, cast.

    Args:
      x: ``(..., m, n)``; not mutated.
      eps: added to each Frobenius norm.
      dtype: dtype of the result (the NS compute dtype). The norm and the division run in
        ``promote(x.dtype, dtype, float32)``.
      out: optional ``(..., m, n)`` tensor of ``dtype`` (any strides, e.g. a transposed view of a
        batch) that receives the result; the caller donates it.
      lift: the range lift (:func:`frobenius_denominator`); the result is ``lift`` times the plain
        one, exactly.

    Returns:
      ``out`` if given, else a new tensor.
    """
    norm = frobenius_denominator(x, eps, dtype, lift=lift)
    if out is None:
        return torch.div(x, norm).to(dtype)
    return torch.div(x, norm, out=out)


def sym_product(a: Tensor, b: Tensor | None = None, *, alpha: float = 1.0, beta: float = 0.0,
                c: Tensor | None = None, gamma: float = 0.0) -> Tensor:
    """The reference symmetric-product op: ``alpha a b^T + beta c + gamma I``, batched.

    This is the contract of the ``sym=`` hook of :func:`newton_schulz`, and its default. The
    caller guarantees that the result is symmetric: either ``b`` is ``None`` (``b = a``, so
    ``a a^T``: SYRK), or ``b`` is a symmetric ``(B, m, m)`` matrix commuting with ``a`` (in NS
    every such pair is two polynomials of one Gram matrix), so ``a b^T = a b``. A replacement may
    exploit the symmetry (compute one triangle and mirror it); this reference computes the full
    product ``a @ b`` (not ``a @ b.mT``: on a low-precision ``b`` that is symmetric only up to
    rounding the two differ, and ``a @ b`` is what the iteration was validated with).

    Args:
      a: ``(B, m, k)``.
      b: ``None`` or a symmetric ``(B, m, m)`` (then ``k = m``).
      alpha, beta, gamma: scalars; ``c`` (``(B, m, m)``, symmetric) is read only when not None
        and ``beta != 0``.

    Returns:
      A new ``(B, m, m)`` tensor in ``a``'s dtype (``torch.baddbmm`` / ``torch.bmm``).
    """
    bt = a.mT if b is None else b
    if c is not None and beta != 0.0:
        out = torch.baddbmm(c, a, bt, beta=beta, alpha=alpha)
    else:
        out = torch.bmm(a, bt)
        if alpha != 1.0:
            out.mul_(alpha)
    if gamma != 0.0:
        out.diagonal(dim1=-2, dim2=-1).add_(gamma)
    return out


def _transposed_layout(x: Tensor) -> bool:
    """True for a transposed view of a contiguous batch (a tall matrix kept in its own layout)."""
    return x.ndim == 3 and not x.is_contiguous() and x.mT.is_contiguous()


def left_product(p: Tensor, x: Tensor, *, alpha: float = 1.0, beta: float = 0.0,
                 c: Tensor | None = None) -> Tensor:
    """``alpha p @ x + beta c`` for ``p: (B, m, m)``, ``x, c: (B, m, n)``, in ``x``'s memory layout.

    The general (non-symmetric) products of NS: ``Z X`` (direct) and ``Q X_0`` (Gram). When ``x``
    is a transposed view of a contiguous ``(B, n, m)`` batch (how a tall matrix is iterated without
    a transposed copy), the product is computed as ``(x^T p^T)^T``: the same sums of the same
    products (only the accumulation order may differ), written contiguously in ``x``'s own layout,
    so the iteration never copies a tall matrix into wide layout and back. ``p^T`` is read, not
    ``p``, so the result is exactly ``p @ x`` also where ``p`` is symmetric only up to rounding.

    Args:
      p: ``(B, m, m)``.
      x: ``(B, m, n)``, contiguous or a transposed view of a contiguous ``(B, n, m)`` tensor.
      alpha: scalar on the product, applied to the accumulator before the cast (``torch.baddbmm``).
      beta, c: optional ``beta * c`` term (``c`` laid out like ``x``), fused into the product.

    Returns:
      A new ``(B, m, n)`` tensor laid out like ``x`` (contiguous, or transposed-contiguous).
    """
    if _transposed_layout(x):               # (x^T p^T)^T, written in x's layout
        return _product(x.mT, p.mT, alpha, beta, None if c is None else c.mT).mT
    return _product(p, x, alpha, beta, c)


def _product(a: Tensor, b: Tensor, alpha: float, beta: float, c: Tensor | None) -> Tensor:
    """``alpha a @ b + beta c`` by one cuBLAS call (plain ``bmm`` when ``alpha = 1`` and no ``c``)."""
    if c is not None:
        return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)
    if alpha == 1.0:
        return torch.bmm(a, b)
    # in place into a fresh buffer (one allocation, as bmm); beta = 0: its contents are not read
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    return out.baddbmm_(a, b, beta=0.0, alpha=alpha)


def _direct(x: Tensor, table, sym: SymOp, final: FinalProduct, s: float) -> Tensor | None:
    for i, (a, b, c) in enumerate(table):                       # x = s X, a_mat = s^2 A
        a_mat = sym(x)                                          # A = X X^T
        z = sym(a_mat, a_mat, alpha=c / s**4, beta=b / s**2, c=a_mat)  # Z = b A + c A^2
        if i < len(table) - 1:
            x = left_product(z, x, beta=a, c=x)                 # X = a X + Z X (general)
        else:                                                   # the last one drops the lift
            x = final(z, x, alpha=1.0 / s, beta=a / s, c=x)
    return x


def _gram(x0: Tensor, table, sym: SymOp, restart: int | None,
          final: FinalProduct, s: float) -> Tensor | None:
    steps = len(table)
    a_mat = sym(x0)                                             # A_0 = X_0 X_0^T (lifted: s^2 A_0)
    q: Tensor | None = None
    for i, (a, b, c) in enumerate(table):
        if restart and i > 0 and i % restart == 0:              # restart: X_0 <- Q X_0
            x0 = left_product(q, x0, alpha=1.0 / s)             # (natural scale from here on)
            a_mat = sym(x0)
            q, s = None, 1.0
        z = sym(a_mat, a_mat, alpha=c / s**4, beta=b / s**2, c=a_mat)  # Z = b A + c A^2
        if q is None:                                           # Q = P = Z + a I (no product)
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = sym(z, q, beta=a, c=q)                          # Q = Z Q + a Q
        last_in_segment = i == steps - 1 or bool(restart and (i + 1) % restart == 0)
        if not last_in_segment:
            r = sym(a_mat, z, beta=a, c=a_mat)                  # R = A Z + a A
            a_mat = sym(z, r, beta=a, c=r)                      # A = Z R + a R = P A P
    return final(q, x0, alpha=1.0 / s)


def ns_iterate(x0: Tensor, table, *, variant: Literal["direct", "gram"], sym: SymOp | None = None,
               gram_restart: GramRestart = "auto",
               final: FinalProduct | None = None, lift: float = 1.0) -> Tensor | None:
    """Run the NS iterations on an already normalized wide batch, keeping its memory layout.

    The iteration of :func:`newton_schulz` without its normalization, orientation and dtype
    handling: ``X_{k+1} = p_k(X_k)`` for every ``(a_k, b_k, c_k)`` of ``table``, direct or Gram
    (module docstring), in ``x0``'s dtype.

    Args:
      x0: ``(B, m, n)`` with ``m <= n``, ``lift`` times a batch with singular values at most 1;
        contiguous, or a transposed view of a contiguous ``(B, n, m)`` batch (a tall matrix
        iterated in place of its transpose: no transposed copy is made, see :func:`left_product`).
      table: ``(a, b, c)`` triples (:func:`~dmuon.newton_schulz.coefficients.ns_coefficient_table`).
      variant: ``"direct"`` or ``"gram"``.
      sym, gram_restart: as in :func:`newton_schulz` (``"auto"`` resolves by ``x0.dtype``).
      final: the op of the LAST general product, ``final(p, x, *, alpha=1.0, beta=0.0, c=None)``
        with the contract of :func:`left_product` (its default): ``Q X_0`` in Gram, ``a X + Z X``
        of the last direct step (``alpha = 1/lift`` there while the lift lasts). A caller may
        write the result straight into its destinations (e.g. in another dtype) and return
        ``None``; ``ns_iterate`` then returns ``None``.
      lift: the range lift ``s`` of ``x0`` (a power of two; module docstring); the result is at
        natural scale whatever ``lift`` is.

    Returns:
      A new ``(B, m, n)`` tensor laid out like ``x0`` (or what ``final`` returned).
    """
    if variant not in ("direct", "gram"):
        raise ValueError(f"variant must be 'direct' or 'gram', got {variant!r}")
    if not (isinstance(lift, (int, float)) and lift > 0 and math.frexp(lift)[0] == 0.5):
        raise ValueError(f"lift must be a positive power of two (e.g. default_range_lift(dtype)), "
                         f"got {lift!r}")
    sym_op = sym_product if sym is None else sym
    fin = left_product if final is None else final
    if variant == "direct":
        return _direct(x0, table, sym_op, fin, float(lift))
    return _gram(x0, table, sym_op, resolve_gram_restart(gram_restart, x0.dtype), fin,
                 float(lift))


def newton_schulz(x: Tensor, *, steps: int = 5, coefficients: CoefficientSpec = "polar_express",
                  eps: float = 1e-7, dtype: torch.dtype | None = None,
                  variant: Literal["auto", "direct", "gram"] = "auto", safety: float = 1.01,
                  sym: SymOp | None = None,
                  gram_restart: GramRestart = "auto",
                  normalize: bool = True) -> Tensor:
    """Approximately orthogonalize every matrix of ``x`` (its polar factor ``U V^T``).

    Args:
      x: ``(..., m, n)`` with ``ndim >= 2``; leading dims index independent matrices. Not mutated.
      steps: number of iterations (exactly this many are run).
      coefficients: schedule name (``"polar_express"``, ``"you"``, ``"jordan"``) or a table of
        ``(a, b, c)`` triples; see :func:`~dmuon.newton_schulz.coefficients.ns_coefficient_table`.
      eps: added to the Frobenius norm before dividing (``X / (||X||_F + eps)``, per matrix).
      dtype: compute dtype of the iteration; ``None`` -> :func:`default_ns_dtype` of ``x.device``
        (fp16 on CUDA, fp32 on CPU). bf16 and fp64 work. Normalization is done in at least fp32.
      variant: ``"direct"``, ``"gram"`` or ``"auto"`` (the cheaper by
        :func:`~dmuon.newton_schulz.cost.choose_ns_variant`, ties -> direct).
      safety: Polar Express safety factor (ignored by the other schedules).
      sym: the symmetric-product op, ``sym(a, b=None, *, alpha=1, beta=0, c=None, gamma=0)
        = alpha a b^T + beta c + gamma I`` on ``(B, m, k)`` batches in the compute dtype (contract:
        :func:`sym_product`, the default). It computes EVERY product whose result is symmetric:
        ``X X^T``, ``b A + c A^2`` and, in Gram, ``Z Q + a Q``, ``A Z + a A``, ``Z R + a R``;
        only ``Z X`` (direct) and ``Q X_0`` (Gram) are general products (``torch.bmm``). GPU
        triangle kernels plug in here (:func:`dmuon.kernels.syrk.make_sym_op`).
      gram_restart: Gram restart period (re-materialize ``X`` every this many iterations);
        ``"auto"`` (default): :func:`default_gram_restart` of the compute dtype (3 for fp16, else
        2); ``None`` or 0 disables restarts. Ignored by direct.
      normalize: ``True`` (default): ``X_0 = frobenius_normalize(x, eps, dtype)``. ``False``:
        ``x`` already is ``X_0`` (scaled so that its singular values are at most 1, e.g. by
        :func:`frobenius_normalize` fused into a caller's gather) and is only cast to the
        compute dtype (and range-lifted in fp16); ``eps`` is then unused.

    Returns:
      A new contiguous tensor with ``x``'s shape and dtype.

    Raises:
      ValueError: ``x.ndim < 2``, an unknown variant, a bad schedule (see the coefficients module),
        a negative ``eps``, a non-floating compute dtype or a bad ``gram_restart``.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(
            f"newton_schulz needs a matrix or a batch of matrices (ndim >= 2), got shape "
            f"{tuple(x.shape)}; reshape to (m, n) (e.g. via as_matrix_shape) or route this "
            "tensor to AdamW (vectors and scalars are not orthogonalized)")
    plan = ns_plan(x.shape[-2], x.shape[-1], x.device, steps=steps, coefficients=coefficients,
                   eps=eps, dtype=dtype, variant=variant, safety=safety,
                   gram_restart=gram_restart)
    if sym is not None and not callable(sym):
        raise TypeError(f"sym must be a callable (see sym_product) or None, got {type(sym).__name__}")
    return ns_run(x, plan, sym=sym, normalize=normalize)


class NSPlan(NamedTuple):
    """What :func:`newton_schulz` decides for one matrix shape on one device, from its settings
    alone (:func:`ns_plan`): a caller that runs the same shapes at every step decides once and
    runs :func:`ns_run`."""

    table: list  # the (a, b, c) triples
    dtype: torch.dtype  # the compute dtype
    eps: float
    gram_restart: Optional[int]  # resolved for dtype (None: never)
    lift: float  # the range lift of dtype
    variant: str  # "direct" or "gram" ("auto" left for an empty matrix: never run)


def ns_plan(m: int, n: int, device: torch.device | str, *, steps: int = 5,
            coefficients: CoefficientSpec = "polar_express", eps: float = 1e-7,
            dtype: torch.dtype | None = None,
            variant: Literal["auto", "direct", "gram"] = "auto", safety: float = 1.01,
            gram_restart: GramRestart = "auto") -> NSPlan:
    """:func:`newton_schulz`'s decisions for ``(m, n)`` matrices on ``device`` (its arguments,
    validated, with the same errors)."""
    if variant not in ("auto", "direct", "gram"):
        raise ValueError(f"variant must be 'auto', 'direct' or 'gram', got {variant!r}")
    if not (eps >= 0.0):
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    table = ns_coefficient_table(coefficients, steps, safety=safety)
    cdtype = default_ns_dtype(device) if dtype is None else dtype
    if not cdtype.is_floating_point:
        raise ValueError(f"compute dtype must be floating point, got {cdtype}")
    restart = resolve_gram_restart(gram_restart, cdtype)
    if variant == "auto" and m * n > 0:
        variant = choose_ns_variant(min(m, n), max(m, n), steps, gram_restart=restart)
    return NSPlan(table, cdtype, eps, restart, default_range_lift(cdtype), variant)


def ns_run(x: Tensor, plan: NSPlan, *, sym: SymOp | None = None,
           normalize: bool = True) -> Tensor:
    """:func:`newton_schulz` of ``x`` (``(..., m, n)``, ``ndim >= 2``) by ``plan`` (its
    :func:`ns_plan` for ``(m, n)`` on ``x``'s device)."""
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must be floating point, got {x.dtype}")
    shape = x.shape
    m, n = shape[-2], shape[-1]
    tall = m > n
    if x.numel() == 0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    xb = x.reshape(-1, m, n)
    if tall:
        xb = xb.mT
    cdtype, lift = plan.dtype, plan.lift
    if normalize:
        x0 = frobenius_normalize(xb, plan.eps, cdtype, lift=lift)
    elif lift != 1.0:
        x0 = (xb.to(torch.promote_types(xb.dtype, torch.float32)) * lift).to(cdtype)
    else:
        x0 = xb.to(cdtype)
    out = ns_iterate(x0, plan.table, variant=plan.variant, sym=sym,
                     gram_restart=plan.gram_restart, lift=lift)
    if tall:
        out = out.mT
    return out.to(x.dtype).contiguous().reshape(shape)
