"""What one ``dmuon.Muon.step()`` did on a rank (pure data): :class:`StepStats` (collectives and
bytes per lane, NS time, owned matrices, host syncs) and :func:`lane_delta`, the per-lane counts
of one step from the executor's cumulative counters."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

__all__ = ["StepStats", "lane_delta"]


@dataclass
class StepStats:
    """What one ``Muon.step()`` did on this rank (see the module docstring)."""

    step: int
    lanes: dict[str, dict[str, int]]
    owned_matrices: int
    owned_elements: int
    dedicated_matrices: int
    adamw_params: int
    ns_ms: Optional[float]
    ns_mode: str
    ns_calls: int
    host_syncs: int
    adamw_impl: str
    device: str

    @property
    def collectives(self) -> int:
        """Collectives issued on all lanes."""
        return sum(c["collectives"] for c in self.lanes.values())

    @property
    def payload_bytes(self) -> int:
        """Payload bytes sent plus received on all lanes."""
        return sum(c["sent_bytes"] + c["received_bytes"] for c in self.lanes.values())

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (with the totals)."""
        d = asdict(self)
        d["collectives"] = self.collectives
        d["payload_bytes"] = self.payload_bytes
        return d


def lane_delta(now: Mapping[str, Mapping[str, int]], prev: Mapping[str, Mapping[str, int]]
               ) -> dict[str, dict[str, int]]:
    """``{lane: {counter: now - prev}}``: the counts between two snapshots of cumulative per-lane
    counters (a lane or counter missing from ``prev`` counts from 0)."""
    lanes = {}
    for lane, c in now.items():
        p = prev.get(lane, {})
        lanes[lane] = {k: v - p.get(k, 0) for k, v in c.items()}
    return lanes
