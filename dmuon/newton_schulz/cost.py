"""Exact flop counts of direct and Gram Newton–Schulz, and the "auto" choice between them.

Counting convention (deterministic integers, what both the owner plan and the GPU path obey):

* a product of an ``(p, k)`` and a ``(k, q)`` matrix costs ``2*p*k*q`` flops;
* symmetric products (``X X^T``, ``A A``) are counted **in full**, as a general matmul would do
  them (a SYRK-style kernel that halves them changes wall time, not this count);
* element-wise work (normalization, ``a*I + ...`` scalings, casts) is not counted.

With ``m <= n`` the short and long side (the iteration runs on the wide orientation), ``T`` steps
and ``S`` Gram segments (``S = 1 + R`` where ``R`` is the number of restarts, see below):

* direct, per step: ``A = X X^T`` (``2 m^2 n``), ``A A`` (``2 m^3``), ``B X`` (``2 m^2 n``)::

      direct(m, n, T) = T * (4 m^2 n + 2 m^3)

* Gram: ``A_0 = X_0 X_0^T`` once (``2 m^2 n``), ``X = Q X_0`` at the end (``2 m^2 n``), and per
  restart ``X = Q X`` plus ``A = X X^T`` (``4 m^2 n``). Inside a segment of ``L`` iterations every
  iteration forms ``A^2`` (``2 m^3``); all but the segment's first update ``Q`` (``Q = P`` needs no
  product there; ``2 m^3``); all but its last update ``A`` (two products, ``4 m^3``)::

      gram(m, n, T, S) = 4 S m^2 n + 2 m^3 * (4 T - 3 S)

* difference: ``direct - gram = (T - S) * (4 m^2 n - 6 m^3)``. So whatever the restart period,
  Gram is cheaper exactly when ``n / m > 3/2`` (and ``S < T``); at ``n = 1.5 m`` they tie and
  ``"auto"`` picks direct.

Restarts: with period ``gram_restart = k`` the Gram iteration re-materializes ``X`` before every
iteration ``i`` with ``i > 0`` and ``i % k == 0``, so ``R = ceil(T / k) - 1`` and ``S = ceil(T / k)``;
``None`` (or 0) means never (``S = 1``).
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["NSCost", "DEFAULT_GRAM_RESTART", "ns_cost", "choose_ns_variant", "gram_segments",
           "direct_flops", "gram_flops"]

#: Default Gram restart period: re-materialize ``X`` and recompute ``A = X X^T`` every 2 iterations.
DEFAULT_GRAM_RESTART = 2

_VARIANTS = ("auto", "direct", "gram")


class NSCost(NamedTuple):
    """Which Newton–Schulz variant runs and its total flop count over all ``batch`` matrices."""
    variant: str
    flops: int


def _pos_int(name: str, v: object, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


def gram_segments(steps: int, gram_restart: int | None = DEFAULT_GRAM_RESTART) -> int:
    """Number ``S`` of restart segments of a ``steps``-iteration Gram run (``restarts = S - 1``)."""
    _pos_int("steps", steps, 1)
    if gram_restart is None or gram_restart == 0:
        return 1
    k = _pos_int("gram_restart", gram_restart, 1)
    return -(-steps // k)


def direct_flops(m: int, n: int, steps: int) -> int:
    """Flops of direct NS on one ``m x n`` matrix: ``T (4 s^2 l + 2 s^3)``, ``s, l = min, max``."""
    s, l = min(m, n), max(m, n)
    return steps * (4 * s * s * l + 2 * s**3)


def gram_flops(m: int, n: int, steps: int, gram_restart: int | None = DEFAULT_GRAM_RESTART) -> int:
    """Flops of Gram NS on one ``m x n`` matrix: ``4 S s^2 l + 2 s^3 (4 T - 3 S)``."""
    s, l = min(m, n), max(m, n)
    seg = gram_segments(steps, gram_restart)
    return 4 * seg * s * s * l + 2 * s**3 * (4 * steps - 3 * seg)


def choose_ns_variant(m: int, n: int, steps: int = 5, *,
                      gram_restart: int | None = DEFAULT_GRAM_RESTART) -> str:
    """``"gram"`` if its flop count is strictly smaller than direct's, else ``"direct"``.

    Symmetric in ``(m, n)``; with this counting Gram wins iff ``max/min > 1.5`` and it restarts
    less often than every iteration.
    """
    _pos_int("m", m, 0)
    _pos_int("n", n, 0)
    _pos_int("steps", steps, 1)
    if gram_flops(m, n, steps, gram_restart) < direct_flops(m, n, steps):
        return "gram"
    return "direct"


def ns_cost(m: int, n: int, steps: int = 5, *, variant: str = "auto", batch: int = 1,
            gram_restart: int | None = DEFAULT_GRAM_RESTART) -> NSCost:
    """Variant and exact total flops of orthogonalizing ``batch`` matrices of shape ``m x n``.

    Args:
      m, n: matrix sides (either orientation; the cost uses ``min`` and ``max``).
      steps: Newton–Schulz iterations.
      variant: ``"direct"``, ``"gram"`` or ``"auto"`` (:func:`choose_ns_variant`).
      batch: number of independent matrices (``B`` of :func:`as_matrix_shape`).
      gram_restart: Gram restart period (see the module docstring).

    Returns:
      ``NSCost(variant, flops)`` with ``variant`` resolved to ``"direct"`` or ``"gram"`` and
      ``flops`` a Python int (``batch`` times the per-matrix count).
    """
    _pos_int("m", m, 0)
    _pos_int("n", n, 0)
    _pos_int("steps", steps, 1)
    _pos_int("batch", batch, 0)
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
    if variant == "auto":
        variant = choose_ns_variant(m, n, steps, gram_restart=gram_restart)
    per = (direct_flops(m, n, steps) if variant == "direct"
           else gram_flops(m, n, steps, gram_restart))
    return NSCost(variant, batch * per)
