"""How long an orthogonalizer's calls took, recorded by the orthogonalizer itself, read afterwards.

Whoever wants NS timed (``dmuon.Muon``'s telemetry) gives the orthogonalizer an :class:`NSTimer`
(``BatchedNS(config, timer=...)``, ``NSEngine.timer = ...``) and reads :meth:`NSTimer.take` after
the step: the math never calls back into its caller. On CUDA a span is a pair of CUDA events on the
current stream of the inputs' device (nothing waits for them until :func:`elapsed_ms`); elsewhere
the host clock around the call.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["NSTimer", "elapsed_ms"]


class NSTimer:
    """The spans of timed calls, oldest first, and the mode of the last one.

    Attributes:
        spans: per call, a ``(start, end)`` pair of CUDA events or the host milliseconds.
        mode: how the last timed call ran (the orthogonalizer's word: ``"functional"``,
            ``"graph"``, ``"eager"``; ``"none"`` before any).
    """

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.mode = "none"

    def run(self, device: torch.device, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, with its span recorded."""
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            out = fn(*args, **kwargs)
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self.spans.append((start, end))
        else:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.spans.append((time.perf_counter() - t0) * 1e3)
        return out

    def take(self) -> list[Any]:
        """The spans recorded since the last ``take`` (and forget them)."""
        spans, self.spans = self.spans, []
        return spans


def elapsed_ms(spans: Sequence[Any]) -> Optional[float]:
    """Total milliseconds of ``spans`` (``None`` for none); waits for CUDA events to complete."""
    if not spans:
        return None
    total = 0.0
    for s in spans:
        if isinstance(s, tuple):
            start, end = s
            end.synchronize()
            total += start.elapsed_time(end)
        else:
            total += s
    return total
