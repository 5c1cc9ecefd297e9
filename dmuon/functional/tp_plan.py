"""Tensor parallelism's part of the plan (pure): which TP index runs each matrix's Newton–Schulz,
and the bytes the owners' TP group moves per step.

With TP degree ``T`` the ``T`` owners of a matrix's slices (one per TP index, at one dp
coordinate) gather their NS inputs to one of them, the *root*, which runs NS on the assembled
``(M, N)`` matrix and scatters each owner its slice of the result
(:mod:`dmuon.stateful.tensor_parallel`). Roots balance the NS work over the TP group.
"""
from __future__ import annotations

from typing import Mapping, Sequence

__all__ = ["ns_cost", "tp_roots", "tp_step_bytes"]


def ns_cost(shape: Sequence[int]) -> int:
    """Relative cost of one Newton–Schulz iteration on an ``(M, N)`` matrix: ``M N min(M, N)``."""
    m, n = (int(d) for d in shape)
    return m * n * min(m, n)


def tp_roots(shapes: Mapping[str, Sequence[int]], parts: int) -> dict[str, int]:
    """The root TP index of each matrix of one TP group: largest NS cost first, onto the least
    loaded index (ties: the lower index, then the name order of ``shapes``).

    Args:
      shapes: ``{name: full (M, N)}`` of the TP-sliced matrices one dp coordinate owns, in the
        model's order (the same on every rank of the TP group).
      parts: the TP degree ``T``.

    Returns:
      ``{name: t}`` with ``0 <= t < T``.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    load = [0] * parts
    roots: dict[str, int] = {}
    for n in sorted(shapes, key=lambda n: -ns_cost(shapes[n])):  # stable: model order on ties
        t = min(range(parts), key=lambda i: (load[i], i))
        roots[n] = t
        load[t] += ns_cost(shapes[n])
    return roots


def tp_step_bytes(shapes: Mapping[str, Sequence[int]], roots: Mapping[str, int], parts: int,
                  itemsize: Mapping[str, int]) -> list[int]:
    """Bytes each TP index of one TP group receives per step for the NS of its matrices: the
    root of a matrix of ``P`` bytes receives ``(T-1)/T P`` (the other slices of the NS input),
    every other index ``P/T`` (its slice of the result).

    Args:
      shapes: ``{name: full (M, N)}``.  roots: :func:`tp_roots`'s.  parts: ``T``.
      itemsize: ``{name: bytes per element}`` of the NS inputs (the master dtype).

    Returns:
      ``[bytes received by TP index t for t in range(T)]``.
    """
    out = [0] * parts
    for n, shape in shapes.items():
        m, k = (int(d) for d in shape)
        piece = m * k // parts * int(itemsize[n])
        for t in range(parts):
            out[t] += piece * (parts - 1) if t == roots[n] else piece
    return out
