"""What the last ``step()`` did on this rank (:class:`StepStats`: collectives and bytes per lane,
NS time from CUDA events read lazily, owned matrices, host syncs). Design notes:
docs/design/optimizer.md, "Step telemetry"."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from dmuon.functional.step_stats import StepStats, lane_delta
from dmuon.newton_schulz.timing import NSTimer, elapsed_ms

if TYPE_CHECKING:
    from dmuon.stateful.runtime.executor import Executor

__all__ = ["StepStats", "StepTelemetry"]


class StepTelemetry:
    """Collects :class:`StepStats`; owned by ``dmuon.Muon`` (``optimizer.telemetry``).

    Args:
      executor: the runtime's executor (its ``counters()`` are cumulative per lane).
      fixed: the fields of every step's :class:`StepStats` fixed at setup (device, owned
        matrices...).
    """

    def __init__(self, executor: "Executor", **fixed: Any):
        self.executor, self.fixed = executor, fixed
        self._prev = executor.counters()
        self.ns_timer: Optional[NSTimer] = None   # set by the NS hook; its spans are the NS time
        self._last: Optional[StepStats] = None
        self._step: Optional[tuple] = None  # the last step's (counters, previous ones, fields)
        self._spans: list = []  # the last step's NSTimer spans, unresolved

    # -- once per step ---------------------------------------------------------------------------
    def finish_step(self, **fields: Any) -> None:
        """Close the step: lane counters since the previous step, the NS spans, the fixed fields
        and the given ones (the stats are made from them when read: :meth:`last`)."""
        spans = self.ns_timer.take() if self.ns_timer is not None else []
        now = self.executor.counters()
        self._step, self._prev, self._spans = (now, self._prev, fields), now, spans
        self._last = None

    def last(self) -> Optional[StepStats]:
        """The last step's stats (None before the first step). On CUDA this waits for that step's
        NS events (a host sync, only here); ``ns_ms`` is None when no NS ran."""
        if self._last is None and self._step is not None:
            now, prev, fields = self._step
            self._last = StepStats(lanes=lane_delta(now, prev), ns_ms=None,
                                   ns_calls=len(self._spans), **self.fixed, **fields)
        st = self._last
        if st is not None and st.ns_ms is None and self._spans:
            st.ns_ms = elapsed_ms(self._spans)
            self._spans = []
        return st
