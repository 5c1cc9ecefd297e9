"""``benchmarks/state_memory.py --largest``'s search (pure): it finds the deepest model that fits
within a few tries even when a shallow model's peak is not yet linear in its depth (measured on
the H200: 0.86 GiB per layer between 2 and 6 layers, 0.68 between 159 and 161)."""
from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from state_memory import next_depth  # noqa: E402


def _search(peak, cap, probes=(2, 6), max_layers=256, max_tries=8):
    tries = {n: (peak(n) <= cap, peak(n)) for n in probes}
    for _ in range(max_tries):
        n = next_depth(tries, cap, max_layers)
        if n is None:
            break
        assert n not in tries, (n, sorted(tries))
        tries[n] = (peak(n) <= cap, peak(n) if peak(n) <= cap else None)
    return tries


@pytest.mark.parametrize("per_layer,start", [(0.68, 2.26), (0.65, 2.26), (0.9063, 2.63)])
def test_finds_the_boundary_in_a_few_tries(per_layer, start):
    cap = 139.8
    # shallow models pay more per layer (workspace, buffers that stop growing), as measured
    peak = lambda n: start + per_layer * n + 1.1 * (1 - math.exp(-n / 4))  # noqa: E731
    want = max(n for n in range(1, 400) if peak(n) <= cap)
    tries = _search(peak, cap, max_tries=4)  # the two probes, then at most 4 tries (it takes 3)
    best = max(k for k, (ok, _) in tries.items() if ok)
    assert best == want and not tries[want + 1][0], (want, sorted(tries))


def test_stops_at_the_cap_and_when_nothing_fails():
    tries = _search(lambda n: 0.01 * n, 139.8, probes=(1, 2), max_layers=3)
    assert sorted(tries) == [1, 2, 3]
    assert next_depth({1: (True, 1.0), 2: (False, None)}, 10.0, 64) is None


def test_a_bracket_stops_the_search_early():
    """``--bracket 3``: a failing depth at most 3 layers above the deepest fit ends the search."""
    assert next_depth({72: (True, 50.0), 150: (True, 110.0), 153: (False, None)}, 139.8, 256,
                      bracket=3) is None
    assert next_depth({72: (True, 50.0), 150: (True, 110.0), 153: (False, None)}, 139.8,
                      256) == 151
    assert next_depth({72: (True, 50.0), 150: (True, 110.0), 160: (False, None)}, 139.8, 256,
                      bracket=3) == 155
