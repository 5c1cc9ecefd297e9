"""The shape scale of Muon's learning rate: ``W ← W − lr·s(m, n)·U`` (pure)."""
from __future__ import annotations

import math
from typing import Any, Mapping, TYPE_CHECKING, Sequence

from dmuon.newton_schulz.matrix_shape import as_matrix_shape

if TYPE_CHECKING:
    from dmuon.functional.matrix_view import MatrixView

__all__ = ["LR_SCALE_RULES", "ADJUST_LR_FN", "lr_scale_factor", "lr_scale_factors"]

LR_SCALE_RULES = ("moonlight", "jordan", "spectral", "none")

#: torch.optim.Muon's ``adjust_lr_fn`` values -> dmuon's ``lr_scale`` rule with the same shape
#: scale (torch's ``_adjust_lr``, 2.13 - 2.15: ``None`` is its default, ``"original"``)
ADJUST_LR_FN: Mapping[Any, str] = {
    None: "jordan", "original": "jordan", "match_rms_adamw": "moonlight",
    "spectral_unclamped": "spectral",
}


def lr_scale_factor(shape: Sequence[int], rule: str = "moonlight", batch_dims: int = 0) -> float:
    """The shape scale ``s`` that multiplies ``lr`` for a param of ``shape``.

    With ``(B, m, n) = as_matrix_shape(shape, batch_dims)`` (``m = shape[batch_dims]``,
    ``n`` = product of the remaining dims):

    * ``"moonlight"``: ``s = 0.2·sqrt(max(m, n))`` — gives the update the RMS of a typical AdamW update
      (Liu et al., "Muon is Scalable for LLM Training", 2025; ``torch.optim.Muon``'s
      ``adjust_lr_fn="match_rms_adamw"``).
    * ``"jordan"``: ``s = sqrt(max(1, m/n))`` (K. Jordan, Muon blog 2024; torch's ``"original"``).
    * ``"spectral"``: ``s = sqrt(m/n)`` (J. Bernstein, "Deriving Muon", 2025: the spectral-norm
      condition, ``"jordan"`` without the clamp at 1; torch 2.15's ``"spectral_unclamped"``).
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
    return _factor(rule, m, n)


def _factor(rule: str, m: int, n: int) -> float:
    if rule == "moonlight":
        return 0.2 * math.sqrt(max(m, n))
    if rule == "jordan":
        return math.sqrt(max(1.0, m / n)) if n > 0 else 1.0
    if rule == "spectral":
        return math.sqrt(m / n) if n > 0 else 1.0
    return 1.0


def lr_scale_factors(shape: Sequence[int], rule: str, view: "MatrixView") -> tuple[float, ...]:
    """The shape scale of each block of ``view`` (a :mod:`dmuon.functional.matrix_view` rule) of a
    param of ``shape``: ``s(m_i, n_i)`` by ``rule`` for block ``i`` of ``(B_i, m_i, n_i)``
    (``lr_scale_factor(shape, rule, k)`` is ``lr_scale_factors(shape, rule, Batch(k))[0]``).

    Raises:
        ValueError: unknown ``rule`` or a view that does not fit ``shape``.
    """
    if rule not in LR_SCALE_RULES:
        raise ValueError(f"lr_scale rule must be one of {LR_SCALE_RULES}, got {rule!r}")
    return tuple(_factor(rule, m, n) for _, m, n in view.blocks(shape))
