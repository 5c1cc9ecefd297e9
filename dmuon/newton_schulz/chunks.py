"""How a set of matrices is cut into batched Newton–Schulz calls: shape groups and chunks (pure).

The GPU engine (:mod:`dmuon.kernels.ns_engine`) runs one batched NS call per chunk. This module
only plans: it groups inputs by ``(min(m, n), max(m, n))`` and orientation (a tall matrix is
iterated in its own layout, so tall and wide inputs of one shape form separate chunks), picks each
group's variant by :func:`~dmuon.newton_schulz.cost.choose_ns_variant`, and splits groups so that no
chunk's compute-dtype iterate exceeds a byte cap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from dmuon.newton_schulz.matrix_shape import as_matrix_shape
from dmuon.newton_schulz.cost import choose_ns_variant

__all__ = ["NSEntry", "NSChunk", "plan_ns_chunks"]


@dataclass(frozen=True)
class NSEntry:
    """One input: its position, ``B`` matrices of ``m x n``, and where they sit in the chunk."""
    index: int
    batch: int
    m: int
    n: int
    offset: int


@dataclass(frozen=True)
class NSChunk:
    """One batched NS call: ``batch`` matrices ``short x long`` run with ``variant``.

    ``tall``: every entry is tall (``m > n``); the chunk's batch is then laid out
    ``(batch, long, short)`` like its sources and iterated as its transposed view, so neither the
    gather nor the scatter transposes anything (wide and tall inputs of one shape form separate
    chunks).
    """
    short: int
    long: int
    variant: str
    batch: int
    entries: tuple[NSEntry, ...]
    tall: bool = False


def plan_ns_chunks(shapes: Sequence[Sequence[int]], batch_dims: Sequence[int], *, steps: int,
                   gram_restart: Optional[int], itemsize: int,
                   max_chunk_bytes: Optional[int]) -> tuple[tuple[NSChunk, ...], tuple[int, ...]]:
    """Group inputs by shape and orientation, split groups into chunks (pure; deterministic order).

    Args:
      shapes, batch_dims: per input, its shape and number of leading batch dims.
      steps, gram_restart: passed to ``choose_ns_variant`` for each group's variant.
      itemsize: bytes per element of the compute dtype.
      max_chunk_bytes: cap on a chunk's iterate (``batch * short * long * itemsize``); an input
        larger than the cap forms a chunk of its own. ``None``: one chunk per group.

    Returns:
      ``(chunks, empty)``: the chunks in order of first appearance of their (wide shape,
      orientation), and the indices of inputs with no elements (their result is all zeros).
    """
    groups: dict[tuple[int, int, bool], list[tuple[int, int, int, int]]] = {}
    empty = []
    for i, (shape, bd) in enumerate(zip(shapes, batch_dims)):
        b, m, n = as_matrix_shape(shape, bd)
        if b * m * n == 0:
            empty.append(i)
            continue
        groups.setdefault((min(m, n), max(m, n), m > n), []).append((i, b, m, n))
    chunks = []
    for (s, l, tall), items in groups.items():
        variant = choose_ns_variant(s, l, steps, gram_restart=gram_restart)
        per = s * l * itemsize
        cur: list[NSEntry] = []
        size = 0
        for i, b, m, n in items:
            if cur and max_chunk_bytes is not None and (size + b) * per > max_chunk_bytes:
                chunks.append(NSChunk(s, l, variant, size, tuple(cur), tall))
                cur, size = [], 0
            cur.append(NSEntry(i, b, m, n, size))
            size += b
        chunks.append(NSChunk(s, l, variant, size, tuple(cur), tall))
    return tuple(chunks), tuple(empty)
