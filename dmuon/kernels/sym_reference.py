"""The reference symmetric product ``alpha a b^T + beta c + gamma I`` (torch / BLAS) and the
operand checks every backend of :mod:`dmuon.kernels.syrk` and :mod:`dmuon.kernels.syrk_tma` shares."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from dmuon.newton_schulz.iteration import sym_product

__all__ = ["sym_abt_torch"]


def _check(a: Tensor, b: Tensor, c: Optional[Tensor]) -> None:
    if a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"sym_abt expects batched 3-D operands (B, m, k); got a{tuple(a.shape)}, "
                         f"b{tuple(b.shape)}. Reshape with x.reshape(-1, m, k) first.")
    if a.shape != b.shape:
        raise ValueError(f"sym_abt needs a and b of the same shape (B, m, k) so that a @ b^T is "
                         f"square; got a{tuple(a.shape)} and b{tuple(b.shape)}")
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a and b must share dtype and device; got {a.dtype}/{a.device} and "
                         f"{b.dtype}/{b.device}")
    if c is not None and c.shape != (a.shape[0], a.shape[1], a.shape[1]):
        raise ValueError(f"c must have shape (B, m, m) = {(a.shape[0], a.shape[1], a.shape[1])}, "
                         f"got {tuple(c.shape)}")


def sym_abt_torch(a: Tensor, b: Optional[Tensor] = None, *, alpha: float = 1.0, beta: float = 0.0,
                  c: Optional[Tensor] = None, gamma: float = 0.0) -> Tensor:
    """``alpha a b^T + beta c + gamma I`` with cuBLAS / CPU BLAS (full product).

    The functional core's reference op (:func:`dmuon.newton_schulz.iteration.sym_product`) after
    the shape checks of this module, so the torch backend rounds exactly like ``newton_schulz``
    with its default hook. With ``b`` given it is symmetric and ``a @ b`` is computed (equal to
    ``a @ b^T``; on a bf16 ``b`` symmetric only up to rounding, ``a @ b.mT`` without
    re-symmetrizing was measured 2-3x less accurate in Gram NS).

    Args:
      a, b: ``(B, m, k)`` operands (``b=None`` means ``b = a``; a given ``b`` is ``(B, m, m)``).
      alpha, beta, gamma: scalars of the epilogue; ``c`` (``(B, m, m)``) is used when not None.

    Returns:
      A new ``(B, m, m)`` tensor of ``a``'s dtype.
    """
    _check(a, a if b is None else b, c)
    return sym_product(a, b, alpha=alpha, beta=beta, c=c, gamma=gamma)
