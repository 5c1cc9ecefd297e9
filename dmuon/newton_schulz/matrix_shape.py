"""How a parameter of any rank is seen as a batch of matrices.

Muon orthogonalizes matrices. A tensor of shape ``shape`` whose first ``batch_dims`` dimensions are
independent (e.g. an MoE expert stack ``(E, out, in)`` with ``batch_dims=1``) is viewed as
``B = prod(shape[:batch_dims])`` matrices of ``m = shape[batch_dims]`` rows and
``n = prod(shape[batch_dims + 1:])`` columns (a convolution kernel ``(out, in, kh, kw)`` becomes
``out x (in*kh*kw)``).
"""
from __future__ import annotations

import math
from typing import Sequence

__all__ = ["as_matrix_shape"]


def as_matrix_shape(shape: Sequence[int], batch_dims: int = 0) -> tuple[int, int, int]:
    """Return ``(B, m, n)`` for a tensor of ``shape`` with ``batch_dims`` leading batch dimensions.

    Args:
      shape: the tensor's shape (any sequence of non-negative ints, e.g. ``torch.Size``).
      batch_dims: how many leading dimensions index independent matrices (``0``: one matrix).

    Returns:
      ``(B, m, n)`` with ``B = prod(shape[:batch_dims])`` (1 if ``batch_dims == 0``),
      ``m = shape[batch_dims]`` and ``n = prod(shape[batch_dims + 1:])``.

    Raises:
      ValueError: if ``batch_dims`` is negative or fewer than 2 dimensions remain after the batch
        dimensions (a vector or scalar is not a matrix: route it to AdamW instead), or if a size is
        negative.
    """
    dims = tuple(int(d) for d in shape)
    if isinstance(batch_dims, bool) or int(batch_dims) != batch_dims or batch_dims < 0:
        raise ValueError(f"batch_dims must be a non-negative int, got {batch_dims!r}")
    batch_dims = int(batch_dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {dims} has a negative size")
    if len(dims) - batch_dims < 2:
        raise ValueError(
            f"shape {dims} with batch_dims={batch_dims} leaves {len(dims) - batch_dims} matrix "
            "dimension(s); a matrix needs at least 2. Use fewer batch_dims, or route this "
            "parameter to AdamW (vectors and scalars are not orthogonalized)."
        )
    b = math.prod(dims[:batch_dims])
    m = dims[batch_dims]
    n = math.prod(dims[batch_dims + 1:])
    return b, m, n
