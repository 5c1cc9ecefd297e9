"""Byte accounting container of schedules: logical payload bytes and collective counts per lane
and rank (the conventions are those of :mod:`dmuon.functional.schedule`, which fills it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

__all__ = ["Traffic", "LANES"]

#: The lanes of the stateful executor (one process group and stream each).
LANES: tuple[str, ...] = ("unshard", "reduce", "replicate")


@dataclass(frozen=True)
class Traffic:
    """Logical payload bytes and collective counts per lane and global rank (``r * G + s``).

    Attributes:
      world_size: G * R.
      sent, received: ``lane -> tuple of bytes per rank``; always the executor's :data:`LANES`, plus
        ``"split"`` when a schedule holds explicit-group ops (split Newton–Schulz).
      collectives: ``lane -> tuple of the number of collectives each rank takes part in``.

    ``lanes=None`` in the methods below means every lane present.
    """

    world_size: int
    sent: Mapping[str, tuple[int, ...]]
    received: Mapping[str, tuple[int, ...]]
    collectives: Mapping[str, tuple[int, ...]]

    @staticmethod
    def zero(world_size: int) -> "Traffic":
        z = {lane: (0,) * world_size for lane in LANES}
        return Traffic(world_size, dict(z), dict(z), dict(z))

    @property
    def lanes(self) -> tuple[str, ...]:
        """The lanes present: :data:`LANES` first, then any others in first-seen order."""
        return tuple(self.sent)

    def __add__(self, other: "Traffic") -> "Traffic":
        if other.world_size != self.world_size:
            raise ValueError("cannot add Traffic of different world sizes")
        keys = tuple(dict.fromkeys(self.lanes + other.lanes))
        zero = (0,) * self.world_size

        def add(a, b):
            return {k: tuple(x + y for x, y in zip(a.get(k, zero), b.get(k, zero))) for k in keys}
        return Traffic(self.world_size, add(self.sent, other.sent),
                       add(self.received, other.received),
                       add(self.collectives, other.collectives))

    def scaled(self, k: int) -> "Traffic":
        def mul(a):
            return {lane: tuple(k * x for x in a[lane]) for lane in a}
        return Traffic(self.world_size, mul(self.sent), mul(self.received), mul(self.collectives))

    def _lanes(self, lanes: Iterable[str] | None) -> Iterable[str]:
        return self.lanes if lanes is None else lanes

    def rank_sent(self, rank: int, lanes: Iterable[str] | None = None) -> int:
        return sum(self.sent[lane][rank] for lane in self._lanes(lanes))

    def rank_received(self, rank: int, lanes: Iterable[str] | None = None) -> int:
        return sum(self.received[lane][rank] for lane in self._lanes(lanes))

    def total_sent(self, lanes: Iterable[str] | None = None) -> int:
        return sum(sum(self.sent[lane]) for lane in self._lanes(lanes))

    def total_received(self, lanes: Iterable[str] | None = None) -> int:
        return sum(sum(self.received[lane]) for lane in self._lanes(lanes))

    def mean_sent(self, lanes: Iterable[str] | None = None) -> float:
        return self.total_sent(lanes) / self.world_size

    def mean_received(self, lanes: Iterable[str] | None = None) -> float:
        return self.total_received(lanes) / self.world_size

    def for_rank(self, rank: int) -> dict[str, dict[str, int]]:
        """``{lane: {"collectives", "sent_bytes", "received_bytes"}}`` of one rank: the same shape
        as the torch executor's ``counters()`` (plus ``"split"`` where present)."""
        return {lane: {"collectives": self.collectives[lane][rank],
                       "sent_bytes": self.sent[lane][rank],
                       "received_bytes": self.received[lane][rank]} for lane in self.lanes}
