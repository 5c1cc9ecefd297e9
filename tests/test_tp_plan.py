"""Pure TP planning (:mod:`dmuon.functional.tp_plan`): NS roots balance the TP group, the bytes
per step follow the gather / scatter rule."""
from __future__ import annotations

import pytest

from dmuon.functional.tp_plan import ns_cost, tp_roots, tp_step_bytes


def test_roots_balance_and_are_deterministic():
    shapes = {"a": (64, 64), "b": (64, 64), "c": (32, 32), "d": (32, 32), "e": (16, 16)}
    roots = tp_roots(shapes, 2)
    assert roots == tp_roots(dict(shapes), 2)
    load = [sum(ns_cost(shapes[n]) for n in shapes if roots[n] == t) for t in range(2)]
    assert max(load) - min(load) <= ns_cost((16, 16))
    assert roots["a"] != roots["b"]
    assert tp_roots(shapes, 1) == {n: 0 for n in shapes}
    with pytest.raises(ValueError):
        tp_roots(shapes, 0)


def test_bytes_gather_to_root_scatter_back():
    shapes = {"w": (8, 6)}  # P = 48 elements, 4 bytes each
    got = tp_step_bytes(shapes, {"w": 1}, 2, {"w": 4})
    assert got == [24 * 4, 24 * 4]  # root gets the other half of x, the other its half of U
    got = tp_step_bytes(shapes, {"w": 0}, 4, {"w": 4})
    assert got == [3 * 12 * 4, 12 * 4, 12 * 4, 12 * 4]
    # the busiest index receives (T-1)/T P per matrix it roots
    assert max(got) == (4 - 1) * 48 * 4 // 4
