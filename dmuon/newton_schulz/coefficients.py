"""Coefficient schedules of the quintic Newton–Schulz iteration.

Each iteration applies the odd polynomial ``p(s) = a*s + b*s**3 + c*s**5`` to every singular value
of the (normalized) matrix: ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``. A *schedule* is the
sequence of ``(a, b, c)`` triples, one per iteration.

Named schedules:

* ``"jordan"`` — Keller Jordan's tuned quintic ``(3.4445, -4.7750, 2.0315)``, the same triple every
  iteration (K. Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024,
  https://kellerjordan.github.io/posts/muon/). It does not converge to 1: after 5 steps singular
  values land roughly in ``[0.7, 1.2]`` by design.
* ``"you"`` — Jiacheng You's per-iteration table of **5** triples
  (https://x.com/YouJiacheng/status/1905861218138804534, used in the modded-nanogpt speedrun records
  and in Dion). The published table has exactly 5 rows, so it supports ``steps <= 5``.
* ``"polar_express"`` — the degree-5 Polar Express table of N. Amsel, D. Persson, C. Musco,
  R. M. Gower, "The Polar Express: Optimal Matrix Sign Methods and Their Application to the Muon
  Algorithm", 2025, arXiv:2505.16932 (Algorithm 1; lower bound ``l = 1e-3`` on the normalized
  spectrum). The paper lists 8 rows; its last row ``(1.875, -1.25, 0.375)`` is the fixed point the
  optimal polynomials reach, and the paper's code repeats it for every further iteration, so this
  schedule accepts any ``steps`` (a documented part of the published schedule, not a truncation).
  The safety factor ``s`` is applied as the paper does: every row but the last becomes
  ``(a/s, b/s**3, c/s**5)``, i.e. ``p(x/s)``; default ``s = 1.01``.

A user table is a sequence of ``(a, b, c)`` triples: a single triple repeats for every iteration;
a longer table of length ``L`` supplies the first ``steps`` rows and needs ``steps <= L``. A flat
triple of numbers ``(a, b, c)`` — ``torch.optim.Muon``'s ``ns_coefficients``, e.g. its default
``(3.4445, -4.775, 2.0315)`` — is that single triple: the same ``(a, b, c)`` every iteration.
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence, Union

__all__ = ["CoefficientSpec", "ns_coefficient_table", "NAMED_SCHEDULES"]

#: a schedule name, a table of ``(a, b, c)`` rows, or one flat ``(a, b, c)`` (torch's spelling)
CoefficientSpec = Union[str, Sequence[tuple[float, float, float]], tuple[float, float, float]]

_JORDAN = ((3.4445, -4.7750, 2.0315),)

_YOU = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# Amsel et al. 2025, Algorithm 1 (degree 5, l = 1e-3), before the safety factor.
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

NAMED_SCHEDULES = ("jordan", "you", "polar_express")


def _check_steps(steps: int) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps (the number of Newton-Schulz iterations) must be an int >= 1, "
                         f"got {steps!r}")
    return steps


def _check_table(table: Sequence, what: str) -> tuple[tuple[float, float, float], ...]:
    if isinstance(table, (str, bytes)) or not isinstance(table, Sequence):
        raise ValueError(f"{what} must be a schedule name {NAMED_SCHEDULES} or a sequence of "
                         f"(a, b, c) triples, got {type(table).__name__}")
    if len(table) == 0:
        raise ValueError(f"{what} is empty; give at least one (a, b, c) triple")
    if _is_number(table[0]):  # flat: torch.optim.Muon's ns_coefficients=(a, b, c)
        if len(table) != 3 or not all(_is_number(v) for v in table):
            raise ValueError(f"{what} {tuple(table)!r} is neither one flat (a, b, c) triple of "
                             "numbers nor a table of (a, b, c) rows")
        table = (tuple(table),)
    rows = []
    for i, row in enumerate(table):
        try:
            vals = tuple(float(v) for v in row)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what} row {i} = {row!r} is not a triple of numbers (a, b, c)") from e
        if len(vals) != 3:
            raise ValueError(f"{what} row {i} = {row!r} has {len(vals)} entries; each row must be "
                             "exactly (a, b, c) for p(s) = a s + b s^3 + c s^5")
        if not all(math.isfinite(v) for v in vals):
            raise ValueError(f"{what} row {i} = {row!r} contains a non-finite value")
        rows.append(vals)
    return tuple(rows)


def _is_number(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def ns_coefficient_table(spec: CoefficientSpec = "polar_express", steps: int = 5, *,
                         safety: float = 1.01) -> tuple[tuple[float, float, float], ...]:
    """The ``(a, b, c)`` triple of every one of ``steps`` Newton–Schulz iterations.

    Args:
      spec: ``"jordan"``, ``"you"``, ``"polar_express"`` (see the module docstring for values and
        references) or a user table of ``(a, b, c)`` triples (one triple repeats; a longer table
        must have at least ``steps`` rows); a flat ``(a, b, c)`` (torch's form) is one triple.
      steps: number of iterations, ``>= 1``; the returned tuple has exactly this length.
      safety: Polar Express safety factor ``s >= 1`` (rows but the last become
        ``(a/s, b/s**3, c/s**5)``); ignored by the other schedules.

    Returns:
      A tuple of ``steps`` float triples.

    Raises:
      ValueError: unknown name, ``steps < 1``, a table shorter than ``steps`` (never truncated
        silently), a row that is not 3 finite numbers, or a non-finite / ``< 1`` safety factor.
    """
    _check_steps(steps)
    if isinstance(spec, str):
        if spec == "jordan":
            return _JORDAN * steps
        if spec == "polar_express":
            if not (isinstance(safety, (int, float)) and math.isfinite(safety) and safety >= 1.0):
                raise ValueError(f"safety must be a finite float >= 1 (1.0 disables it), "
                                 f"got {safety!r}")
            s = float(safety)
            rows = [(a / s, b / s**3, c / s**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]]
            rows.append(_POLAR_EXPRESS_RAW[-1])
            rows += [_POLAR_EXPRESS_RAW[-1]] * max(0, steps - len(rows))
            return tuple(rows[:steps])
        if spec == "you":
            table, what = _YOU, "the 'you' schedule"
        else:
            raise ValueError(f"unknown Newton-Schulz schedule {spec!r}; use one of "
                             f"{NAMED_SCHEDULES} or a sequence of (a, b, c) triples")
    else:
        table, what = _check_table(spec, "coefficient table"), "the coefficient table"
    if len(table) == 1:
        return tuple(table) * steps
    if steps > len(table):
        raise ValueError(f"{what} has {len(table)} per-iteration rows but steps={steps}; "
                         f"use steps <= {len(table)} or give a longer table (tables are never "
                         "extended or truncated silently)")
    return tuple(table[:steps])
