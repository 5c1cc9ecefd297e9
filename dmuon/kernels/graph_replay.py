"""A function run as a CUDA graph while its inputs recur: :class:`RecurringGraphs`.

Per slot (the NS overlap's: a hook group), a call with a key (what the graph would bake in: the
numbers the function's Python reads, the storage it reads and writes) runs the function eagerly
the first time; when the slot's key recurs at two calls in a row, the function is captured once
(:func:`~dmuon.kernels.ns_engine.capture_graph`: no synchronization, no emptied cache) and the
graph replayed while the key recurs. A key of ``None`` never captures. The graphs of all slots
share one memory pool, which is safe in any replay order because a capture is kept only when every
result it returns lies outside the pool (in the caller's own buffers). A new graph's first replay
is compared bit for bit with an eager run of the same call, whose results are returned; a capture
that fails, returns results in the pool or differs from the eager run leaves that slot eager for
good, said once in the log.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Iterable, Optional

import torch

from dmuon.kernels.ns_engine import capture_graph
from dmuon.kernels.streams import side_stream

__all__ = ["RecurringGraphs"]

logger = logging.getLogger(__name__)


class RecurringGraphs:
    """Graphs per slot (module docstring); ``max_captures`` per slot, eager after that."""

    def __init__(self, max_captures: int = 4):
        self.max_captures = max_captures
        self.slots: dict = {}  # {slot: (key, graph or None, results)}
        self.captures: dict = {}  # {slot: graphs captured}
        self.retired: list = []  # graphs never replayed again, kept (the pool's use count)
        self.pool: Any = None

    def __call__(self, slot: Hashable, key: Optional[Hashable], fn: Callable[[], Any],
                 results: Callable[[Any], Iterable[torch.Tensor]],
                 outside: Callable[[], set[int]], device: torch.device) -> tuple[Any, bool]:
        """``(fn()'s results, whether a graph replay made them)`` on the current stream.
        ``results(out)``: the tensors of ``out``; ``outside()``: storage pointers not in the pool
        (made before the capture: the caller's buffers; asked only at a capture)."""
        seen, graph, out = self.slots.get(slot, (None, None, None))
        if key is not None and key == seen and graph is not None:
            graph.replay()
            return out, True
        if graph is not None:  # another key now: never replayed again
            self.retired.append(graph)
        self.slots[slot] = (key, None, None)
        if key is None or key != seen or self.captures.get(slot, 0) >= self.max_captures:
            return fn(), False
        try:  # the key recurred: capture once (nothing runs), then replay
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph, out = capture_graph(fn, self.pool, side_stream(device, "ns_capture"))
        except Exception as e:  # noqa: BLE001 - eager, as before, for this slot from now on
            return self._eager(slot, fn, f"its CUDA graph capture failed: {e}")
        ours = outside()
        if any(t.data_ptr() not in ours for t in results(out)):
            self.retired.append(graph)
            return self._eager(slot, fn, "the function's results lie in the graphs' pool")
        self.captures[slot] = self.captures.get(slot, 0) + 1
        graph.replay()  # checked once against the eager run (one host sync per capture)
        got = [t.clone() for t in results(out)]
        ref = fn()
        if not all(torch.equal(a, b) for a, b in zip(got, results(ref))):
            self.retired.append(graph)
            return self._eager(slot, lambda: ref, "its CUDA graph's results differed from the "
                               "eager run's (please report this)")
        self.slots[slot] = (key, graph, out)
        return ref, False

    def _eager(self, slot: Hashable, fn: Callable[[], Any], why: str) -> tuple[Any, bool]:
        self.captures[slot] = self.max_captures
        logger.warning("dmuon: %r runs eagerly from now on (%s)", slot, why)
        return fn(), False
