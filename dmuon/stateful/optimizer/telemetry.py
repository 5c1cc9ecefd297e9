"""What the last ``step()`` did on this rank (:class:`StepStats`: collectives and bytes per lane,
NS time from CUDA events read lazily, owned matrices, host syncs). Design notes:
docs/design/optimizer.md, "Step telemetry"."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from dmuon.newton_schulz.timing import NSTimer, elapsed_ms

if TYPE_CHECKING:
    from dmuon.stateful.runtime.executor import Executor

__all__ = ["StepStats", "StepTelemetry"]


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


@dataclass
class _Record:
    stats: StepStats
    spans: list = field(default_factory=list)      # NSTimer spans, unresolved


class StepTelemetry:
    """Collects :class:`StepStats`; owned by ``dmuon.Muon`` (``optimizer.telemetry``).

    Args:
      executor: the runtime's executor (its ``counters()`` are cumulative per lane).
      device: where the optimizer's math runs (CUDA: NS timed with events).
    """

    def __init__(self, executor: "Executor", device: torch.device):
        self.executor = executor
        self.device = torch.device(device)
        self._prev = self._snapshot()
        self.ns_timer: Optional[NSTimer] = None   # set by the NS hook; its spans are the NS time
        self._last: Optional[_Record] = None

    def _snapshot(self) -> dict[str, dict[str, int]]:
        return self.executor.counters()

    # -- once per step ---------------------------------------------------------------------------
    def finish_step(self, **fields: Any) -> None:
        """Close the step: lane counters since the previous step, the NS spans, the given fields."""
        now = self._snapshot()
        lanes = {}
        for lane, c in now.items():
            p = self._prev.get(lane, {})
            lanes[lane] = {k: v - p.get(k, 0) for k, v in c.items()}
        self._prev = now
        spans = self.ns_timer.take() if self.ns_timer is not None else []
        stats = StepStats(lanes=lanes, ns_ms=None, ns_calls=len(spans), device=str(self.device),
                          **fields)
        self._last = _Record(stats, spans)

    def last(self) -> Optional[StepStats]:
        """The last step's stats (None before the first step). On CUDA this waits for that step's
        NS events (a host sync, only here); ``ns_ms`` is None when no NS ran."""
        rec = self._last
        if rec is None:
            return None
        st = rec.stats
        if st.ns_ms is None and rec.spans:
            st.ns_ms = elapsed_ms(rec.spans)
            rec.spans = []
        return st
