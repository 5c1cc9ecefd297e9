"""Owner Newton–Schulz overlapped with the backward, in the projector: the model and its
calibration (issue 47).

With overlap on (``StepSetup(ns_overlap=True)``, ``python -m dmuon project ... --ns-overlap``), a
hook group's owner update (NS and the element-wise Muon stages of the matrices a rank owns in
that group) may start when the group's gradient reduce lands, on a side stream below the
backward's priority. The model, stated:

* **Rate.** While the backward computes, owner work progresses at ``idle`` seconds of work per
  second: the share of the GPU the backward leaves idle, net of whatever the two streams cost
  each other (the backward is not slowed in the model; the calibration below measures the net
  gain, so a slowdown of the backward's kernels is already subtracted from it). Where the
  backward's compute waits (for a gather, for the last reduces) and after it, owner work runs at
  the full rate 1.
* **Order.** A rank runs its groups' work first come, first served by landing time (the end of
  the group's reduce on the projected rank's timeline, its HSDP stage-2 included); split units
  are not modeled (the projector refuses ``ns_overlap`` with ``max_split > 1``).
* **Idle share.** ``idle`` is interpolated in ``log2`` of a key, clamped at the ends, between
  points fitted on measurements (:data:`MEASURED`): by default the key is one layer's projected
  backward seconds (``Machine.ns_overlap_key = "layer_backward_s"``: a wider layer fills the GPU
  sooner at the same tokens); ``"tokens"`` keys it by tokens per GPU alone, the optimistic
  choice for models wider than the measured one. Only one model width (hidden 2048) was
  measured, so the two keys agree on it and differ off it; the grid reports both.

The fit (:func:`dmuon.tools.calibration.fit_idle_points`, beside the other calibrations): in the
measurement the NS of all 112 matrices was launched on a side stream after the forward, so all
of it could overlap the whole backward: at world 1 the hidden seconds are ``min(NS, idle *
backward)``, hence ``idle = hidden share * sequential step / backward``, with the step and the backward projected for the measured setup on the machine model
(:data:`dmuon.tools.calibration.H200_W1`, the HF Llama 1.1B-ish of the world-1 runs).
"""
from __future__ import annotations

import bisect
from typing import Mapping, Sequence

from dmuon.tools.machine import Machine, interp_log2

__all__ = ["MEASURED", "MEASURED_SOURCE", "idle_share", "overlap_key", "overlapped_finish"]

#: Issue 47, measured on one H100 (torch 2.11), HF Llama 1.1B (hidden 2048, 16 layers): the NS of
#: its 112 matrices on a side stream launched after the forward, the backward on the default
#: stream; ``hidden_share``: the step time overlap saved, over the sequential step.
MEASURED: tuple[dict, ...] = (
    {"micro_batch": 4, "seq": 2048, "hidden_share": 0.01},
    {"micro_batch": 1, "seq": 2048, "hidden_share": 0.10},
    {"micro_batch": 1, "seq": 1024, "hidden_share": 0.05},
)
MEASURED_SOURCE = ("issue 47: one H100, HF Llama 1.1B, NS of its 112 matrices on a side stream "
                   "after the forward: overlap hides 1 % of the sequential step at B4 x T2048, "
                   "10 % at B1 x T2048, 5 % at B1 x T1024")


def overlap_key(machine: Machine, tokens: int, layer_backward_s: float) -> float:
    """The value :func:`idle_share` looks up: tokens per GPU or one layer's backward seconds
    (``machine.ns_overlap_key``)."""
    if machine.ns_overlap_key == "tokens":
        return float(tokens)
    if machine.ns_overlap_key == "layer_backward_s":
        return float(layer_backward_s)
    raise ValueError(f"Machine.ns_overlap_key must be 'tokens' or 'layer_backward_s', got "
                     f"{machine.ns_overlap_key!r}")


def idle_share(machine: Machine, key: float) -> float:
    """The share of the GPU owner work gets while the backward computes (module docstring)."""
    points = dict(machine.ns_overlap_idle)[machine.ns_overlap_key]
    return min(1.0, max(0.0, interp_log2(list(points), key)))


def overlapped_finish(work: Mapping[float, float], busy: Sequence[tuple[float, float]],
                      idle: float) -> float:
    """When a rank's owner work ends: ``work`` is ``{landing time: seconds of work}``; ``busy``
    the backward's compute intervals (sorted, disjoint), in which work runs at ``idle``; outside
    them at rate 1. Work is done first come, first served."""
    starts = [b[0] for b in busy]
    t = 0.0
    for landed in sorted(work):
        left = work[landed]
        t = max(t, landed)
        while left > 1e-15:
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t < busy[i][1]:          # inside a compute interval
                rate, until = idle, busy[i][1]
            else:                                  # a gap, or after the backward
                rate, until = 1.0, (starts[i + 1] if i + 1 < len(starts) else float("inf"))
            if rate <= 0.0:
                t = until
                continue
            step = min(left / rate, until - t)
            t += step
            left -= step * rate
    return t
