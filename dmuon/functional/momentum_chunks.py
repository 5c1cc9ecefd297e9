"""How the owners' step walks a stored (encoded or offloaded) momentum, decided purely: the
step's chunks (:func:`step_chunks`), offloading, which copies in the backward starts ahead of the
step (:func:`within_room`) and, on CUDA, how many bytes of copies back the next step starts at once
(:func:`next_out_budget`). The stateful layer
(:mod:`dmuon.stateful.optimizer.state_storage`, :mod:`~dmuon.stateful.optimizer.offload_copies`)
runs the copies and the decoding."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

__all__ = ["step_chunks", "within_room", "next_out_budget"]


def step_chunks(names: Sequence[str], staged: Sequence[str], nbytes: Mapping[str, int],
                chunk_bytes: int) -> list[list[int]]:
    """Positions of ``names`` in chunks: those already staged first (in ``staged``'s order: the
    backward's reduce order), then the others in order, greedily packed up to ``chunk_bytes`` of
    working momentum (``nbytes[name]`` each; a larger matrix is a chunk of its own)."""
    pos = {n: i for i, n in enumerate(names)}
    first = [n for n in staged if n in pos]
    seen = set(first)
    out: list[list[int]] = []
    size = 0
    for n in first + [n for n in names if n not in seen]:
        b = nbytes[n]
        if out and size + b <= chunk_bytes:
            out[-1].append(pos[n])
            size += b
        else:
            out.append([pos[n]])
            size = b
    return out


def within_room(nbytes: Mapping[str, int], room: int) -> list[str]:
    """The names of ``nbytes`` (``{name: bytes}``, in order) up to the first that does not fit in
    what is left of ``room`` bytes: the offloaded copies the backward starts ahead of the step
    within ``prefetch_bytes`` (``room``: that budget less the bytes already staged)."""
    out = []
    for n, b in nbytes.items():
        if b > room:
            break
        out.append(n)
        room -= b
    return out


def next_out_budget(budget: Optional[int], nbytes: int, deferred: bool, copy_ms: float,
                    past_end_ms: float) -> Optional[int]:
    """The bytes of copies back the next step starts at once (pure): the last step started
    ``nbytes`` at once (``budget`` allowed; ``deferred``: it held some back), whose copies took
    ``copy_ms`` from the first one's start and ended ``past_end_ms`` after the step's end
    (negative: before it). Copies that ran past the end are held back next time; when the copies
    ended early and some were held back, the room left is given to them. ``None``: no limit."""
    if copy_ms <= 0.0 or nbytes <= 0:
        return budget
    rate = nbytes / copy_ms  # bytes per ms
    if past_end_ms > 0.0:
        return max(0, int(nbytes - past_end_ms * rate))
    if deferred:
        return int(nbytes - past_end_ms * rate)
    return budget
