"""Newton–Schulz orthogonalization: the approximate polar factor ``U V^T`` of ``G = U S V^T``.

Both variants compute, for a schedule ``(a_k, b_k, c_k)`` (see :mod:`dmuon.functional.coefficients`),

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
(:mod:`dmuon.functional.ns_cost`).

**Restarts.** In low precision the recurrence for ``A`` drifts from ``Q X_0 (Q X_0)^T`` (rounding
errors are amplified by the large early coefficients; spurious negative eigenvalues and eigenvector
drift, as analysed by Dao, Zhang, Amsel, Chen, "Gram Newton-Schulz", 2026,
https://tridao.me/blog/2026/gram-newton-schulz/). Every ``gram_restart`` iterations (before every
iteration ``i > 0`` with ``i % gram_restart == 0``) the Gram variant re-materializes
``X_0 <- Q X_0``, recomputes ``A = X_0 X_0^T`` from it and resets ``Q = I``. Default period:
:data:`~dmuon.functional.ns_cost.DEFAULT_GRAM_RESTART` (2); ``None`` disables restarts.

References: K. Jordan, "Muon" (2024), https://kellerjordan.github.io/posts/muon/ ; N. Amsel et al.,
"The Polar Express" (2025), arXiv:2505.16932.
"""
from __future__ import annotations

from typing import Callable, Literal

import torch
from torch import Tensor

from dmuon.functional.coefficients import CoefficientSpec, ns_coefficient_table
from dmuon.functional.ns_cost import DEFAULT_GRAM_RESTART, choose_ns_variant

__all__ = ["default_ns_dtype", "newton_schulz"]

XXT = Callable[[Tensor], Tensor]


def default_ns_dtype(device: torch.device | str) -> torch.dtype:
    """The compute dtype used when ``dtype=None``: bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _default_xxt(x: Tensor) -> Tensor:
    return torch.bmm(x, x.mT)


def _poly_z(a_mat: Tensor, b: float, c: float, xxt: XXT | None) -> Tensor:
    """``b A + c A^2`` for a batch of symmetric ``A`` (``A^2 = A A^T`` may use the ``xxt`` hook)."""
    if xxt is None:
        return torch.baddbmm(a_mat, a_mat, a_mat, beta=b, alpha=c)
    return torch.add(xxt(a_mat) * c, a_mat, alpha=b)


def _direct(x: Tensor, table, xxt: XXT | None) -> Tensor:
    gram_fn = xxt or _default_xxt
    for a, b, c in table:
        a_mat = gram_fn(x)
        z = _poly_z(a_mat, b, c, xxt)
        x = torch.baddbmm(x, z, x, beta=a)
    return x


def _gram(x0: Tensor, table, xxt: XXT | None, restart: int | None) -> Tensor:
    gram_fn = xxt or _default_xxt
    steps = len(table)
    a_mat = gram_fn(x0)
    q = None
    for i, (a, b, c) in enumerate(table):
        if restart and i > 0 and i % restart == 0:
            x0 = torch.bmm(q, x0)
            a_mat = gram_fn(x0)
            q = None
        z = _poly_z(a_mat, b, c, xxt)
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = torch.baddbmm(q, z, q, beta=a)
        last_in_segment = i == steps - 1 or (restart and (i + 1) % restart == 0)
        if not last_in_segment:
            r = torch.baddbmm(a_mat, a_mat, z, beta=a)
            a_mat = torch.baddbmm(r, z, r, beta=a)
    return torch.bmm(q, x0)


def newton_schulz(x: Tensor, *, steps: int = 5, coefficients: CoefficientSpec = "polar_express",
                  eps: float = 1e-7, dtype: torch.dtype | None = None,
                  variant: Literal["auto", "direct", "gram"] = "auto", safety: float = 1.01,
                  xxt: Callable[[Tensor], Tensor] | None = None,
                  gram_restart: int | None = DEFAULT_GRAM_RESTART) -> Tensor:
    """Approximately orthogonalize every matrix of ``x`` (its polar factor ``U V^T``).

    Args:
      x: ``(..., m, n)`` with ``ndim >= 2``; leading dims index independent matrices. Not mutated.
      steps: number of iterations (exactly this many are run).
      coefficients: schedule name (``"polar_express"``, ``"you"``, ``"jordan"``) or a table of
        ``(a, b, c)`` triples; see :func:`~dmuon.functional.coefficients.ns_coefficient_table`.
      eps: added to the Frobenius norm before dividing (``X / (||X||_F + eps)``, per matrix).
      dtype: compute dtype of the iteration; ``None`` -> :func:`default_ns_dtype` of ``x.device``
        (bf16 on CUDA, fp32 on CPU). fp64 works. Normalization is done in at least fp32.
      variant: ``"direct"``, ``"gram"`` or ``"auto"`` (the cheaper by
        :func:`~dmuon.functional.ns_cost.choose_ns_variant`, ties -> direct).
      safety: Polar Express safety factor (ignored by the other schedules).
      xxt: optional batched ``t -> t @ t.mT`` for ``(B, p, q)`` tensors in the compute dtype; used
        for every symmetric product (``X X^T`` and ``A A``). GPU SYRK-style kernels plug in here.
      gram_restart: Gram restart period (re-materialize ``X`` every this many iterations);
        ``None`` or 0 disables restarts. Ignored by direct.

    Returns:
      A new contiguous tensor with ``x``'s shape and dtype.

    Raises:
      ValueError: ``x.ndim < 2``, an unknown variant, a bad schedule (see the coefficients module),
        a negative ``eps`` or a non-floating compute dtype.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(
            f"newton_schulz needs a matrix or a batch of matrices (ndim >= 2), got shape "
            f"{tuple(x.shape)}; reshape to (m, n) (e.g. via as_matrix_shape) or route this "
            "tensor to AdamW (vectors and scalars are not orthogonalized)")
    if variant not in ("auto", "direct", "gram"):
        raise ValueError(f"variant must be 'auto', 'direct' or 'gram', got {variant!r}")
    if not (eps >= 0.0):
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if gram_restart is not None and (isinstance(gram_restart, bool) or
                                     not isinstance(gram_restart, int) or gram_restart < 0):
        raise ValueError(f"gram_restart must be None or an int >= 0, got {gram_restart!r}")
    table = ns_coefficient_table(coefficients, steps, safety=safety)
    cdtype = default_ns_dtype(x.device) if dtype is None else dtype
    if not cdtype.is_floating_point:
        raise ValueError(f"compute dtype must be floating point, got {cdtype}")
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
    # Normalize in at least fp32 (and at least the compute precision), then cast.
    acc = torch.promote_types(torch.promote_types(x.dtype, cdtype), torch.float32)
    xa = xb.to(acc)
    norm = torch.linalg.vector_norm(xa, dim=(-2, -1), keepdim=True)
    x0 = (xa / (norm + eps)).to(cdtype)

    short, long_ = min(m, n), max(m, n)
    if variant == "auto":
        variant = choose_ns_variant(short, long_, steps, gram_restart=gram_restart)
    if variant == "direct":
        out = _direct(x0, table, xxt)
    else:
        out = _gram(x0, table, xxt, gram_restart or None)
    if tall:
        out = out.mT
    return out.to(x.dtype).contiguous().reshape(shape)
