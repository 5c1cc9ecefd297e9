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
  sooner at the same tokens); ``"tokens"`` keys it by tokens per GPU alone. Two widths were
  measured (hidden 2048 and 8B's 4096), so the keys differ between and beyond them; the grid
  reports both.

The fit (:func:`dmuon.tools.calibration.fit_idle_points`, beside the other calibrations): the
measurements (:data:`MEASURED`) are dmuon's own overlap against its sequential step at world 1,
so per measured setup the idle share is the one at which the projector's W=1 step with overlap
saves the measured share (bisection; a measured loss fits 0: the model never slows the
backward, so it cannot go below "nothing hidden"), with the steps projected for the measured
setup and model on the machine model (default :data:`dmuon.tools.calibration.H200_W1`, the HF
Llama 1.1B-ish of the world-1 runs). At B1 the measured step is host-bound (its forward's and backward's host time
equal their GPU time), which the projector does not model: the idle share there holds that too.
"""
from __future__ import annotations

import bisect
from typing import Mapping, Sequence

from dmuon.tools.machine import Machine, interp_log2

__all__ = ["MEASURED", "MEASURED_SOURCE", "idle_share", "overlap_key", "overlapped_finish"]

#: Issue 47, dmuon's own overlap measured on one H100 (torch 2.11), HF Llama at world 1,
#: ``Muon.set_ns_overlap("on")`` with the graph replay against ``"off"`` in the same process:
#: ``saved_share`` is the step time it saved over the step without it (negative: lost);
#: ``model``: the measured model's shapes (absent: the 1.1B of the world-1 runs, hidden 2048,
#: 16 layers). Session 11's runs of main (4ff4b92), one fresh process each: B1 x T2048 the mean of
#: two (+4.46 %, +4.75 %; session 9's +15.7 % was on a step whose host work was larger: off
#: 186 ms there, 141 ms now).
MEASURED: tuple[dict, ...] = (
    {"micro_batch": 4, "seq": 2048, "saved_share": -0.049},
    {"micro_batch": 1, "seq": 2048, "saved_share": 0.046},
    {"micro_batch": 1, "seq": 4096, "saved_share": -0.070,
     "model": {"hidden": 4096, "intermediate": 14336, "layers": 8, "heads": 32, "kv_heads": 8,
               "vocab": 32000}},
)
MEASURED_SOURCE = ("issue 47: one H100, HF Llama, dmuon's NS overlap (graph replay) on vs off at "
                   "world 1, main 4ff4b92, a fresh process per run: 1.1B -4.9 % at B4 x T2048 "
                   "(lost), +4.6 % at B1 x T2048 (mean of +4.46 and +4.75); Llama-3.1-8B layer "
                   "shapes, 8 layers, -7.0 % at B1 x T4096 "
                   "(benchmarks/results/ns_overlap_world1_h100_session11_fresh.json)")


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
