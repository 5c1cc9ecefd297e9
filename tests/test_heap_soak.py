"""A training loop's Python heap does not grow per step (issue 46, "slow creep").

The loop of ``benchmarks/heap_soak.py`` (its small model, 2 gloo ranks, an ``LambdaLR`` schedule:
a float lr that changes every step; here also ``clip_grad_norm_``, ``last_step_stats()`` every
step and a ``no_grad`` forward every 10 steps). Measured on this machine (1,000 steps,
``benchmarks/results/heap_soak_2026-12-06.json``): the heap grows during the first ~80 steps
(dmuon ~1,600 blocks, FSDP2 ~550: first-use allocations), then neither grows (steps 200 -> 1000:
dmuon +0.06 to +0.12 blocks per step, FSDP2 -0.13; gc-tracked objects flat in both after a
one-time +10 / +60); counted from step 1, the warm-up reads as 1.7 against 0.5 blocks per step,
the shape of the issue's "9.8 against 5.3".

* default tier (a part of ``reliability_spawn.py``'s world-2 spawn): steps 23 to 30 of dmuon add
  no object the collector tracks (``len(gc.get_objects())``: exact, not noisy). A planted leak of
  one dict per step (a list in the telemetry appended at every ``finish_step``) fails it.
* slow: from step 300 to 480, dmuon's tracked objects and allocator blocks
  (``sys.getallocatedblocks()``, noisy by tens of blocks) per step exceed plain FSDP2 + AdamW's by
  at most 0.02 and ``BLOCK_MARGIN`` (FSDP2's blocks counted as at least 0: noise around 0).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dist_utils import run_ranks
from reliability_spawn import results

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

FEATURES = ("clip", "stats", "eval")
BLOCK_MARGIN = 1.0   # blocks per step above FSDP2's


def _soak(rank: int, world: int, kinds: tuple, steps: int, warmup: int) -> dict:
    import heap_soak
    return {kind: heap_soak.soak_rank(rank, world, kind, steps, warmup, features=FEATURES,
                                      intervals=2) for kind in kinds}


def _per_step(points: list, at: int) -> tuple[float, float]:
    """Blocks and gc objects per step from ``points[at]`` to the last point."""
    (s0, b0, n0), (s1, b1, n1) = points[at], points[-1]
    return (b1 - b0) / (s1 - s0), (n1 - n0) / (s1 - s0)


def _short_soak(rank: int, world: int) -> dict:
    """The default tier's part, in the issue-39 reliability spawn (``reliability_spawn.py``)."""
    return _soak(rank, world, ("dmuon",), 30, 16)


def test_dmuon_steps_add_no_tracked_objects_after_warmup(tmp_path_factory):
    for rank, res in enumerate(results(2, "heap", tmp_path_factory)):
        d = res["dmuon"]
        # the last interval (steps 23 -> 30): the one right after a point's full collection
        # re-creates the cyclic garbage in flight that the collection freed (+10 objects, once)
        (_, _, n0), (_, _, n1) = d["points"][-2], d["points"][-1]
        assert n1 - n0 <= 1, (rank, d["points"], d["type_growth"])


@pytest.mark.slow  # ~70 s: two 480-step runs
def test_dmuon_heap_grows_no_more_per_step_than_fsdp2():
    # measured from step 300 to 480: the allocator's block count moves by tens of blocks either
    # way (dmuon over 200-step windows: +31, -20), so the 60-step window used before (180 -> 240)
    # read that noise as -0.05 .. +1.47 blocks per step (session 14: 2 of 3 runs over the 1.0
    # margin at 7a0ea1d and later), while dmuon 200 -> 600 is -0.10 .. +0.03 at both 1e0437a and
    # c31dd18 (no growth); 180 steps keep the margin and the claim
    results = run_ranks(_soak, 2, ("fsdp2", "dmuon"), 480, 120, timeout=300)
    for rank, res in enumerate(results):
        (db, dn), (fb, fn) = (_per_step(res[k]["points"], 2) for k in ("dmuon", "fsdp2"))
        # FSDP2's own count is noise around 0 (-0.55 to +0.42 in six runs): a shrink there does
        # not lower dmuon's bound (one run had FSDP2 -0.45 and dmuon +0.7, the rest -0.73..+0.07)
        assert dn <= fn + 0.02 and db <= max(fb, 0.0) + BLOCK_MARGIN, (rank, res)
