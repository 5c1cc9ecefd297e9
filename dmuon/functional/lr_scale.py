"""The shape scale of Muon's learning rate: ``W ← W − lr·s(m, n)·U`` (pure)."""
from __future__ import annotations

import math
from typing import Sequence

from dmuon.functional.matrix_shape import as_matrix_shape

__all__ = ["LR_SCALE_RULES", "lr_scale_factor"]

LR_SCALE_RULES = ("moonlight", "jordan", "none")


def lr_scale_factor(shape: Sequence[int], rule: str = "moonlight", batch_dims: int = 0) -> float:
    """The shape scale ``s`` that multiplies ``lr`` for a param of ``shape``.

    With ``(B, m, n) = as_matrix_shape(shape, batch_dims)`` (``m = shape[batch_dims]``,
    ``n`` = product of the remaining dims):

    * ``"moonlight"``: ``s = 0.2·sqrt(max(m, n))`` — gives the update the RMS of a typical AdamW update
      (Liu et al., "Muon is Scalable for LLM Training", 2025; ``torch.optim.Muon``'s
      ``adjust_lr_fn="match_rms_adamw"``).
    * ``"jordan"``: ``s = sqrt(max(1, m/n))`` (K. Jordan, Muon blog 2024; torch's ``"original"``).
    * ``"none"``: ``s = 1``.

    Args:
        shape: the param's shape.
        rule: one of ``LR_SCALE_RULES``.
        batch_dims: leading dims that index independent matrices (each gets the same ``s``).

    Returns:
        ``s`` as a Python float.

    Raises:
        ValueError: unknown ``rule`` (the message lists the choices) or a shape that is not a matrix.
    """
    if rule not in LR_SCALE_RULES:
        raise ValueError(f"lr_scale rule must be one of {LR_SCALE_RULES}, got {rule!r}")
    _, m, n = as_matrix_shape(shape, batch_dims)
    if rule == "moonlight":
        return 0.2 * math.sqrt(max(m, n))
    if rule == "jordan":
        return math.sqrt(max(1.0, m / n)) if n > 0 else 1.0
    return 1.0
