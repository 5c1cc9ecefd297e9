"""Tests of the Newton–Schulz flop model and the direct/Gram choice.

Independent reference: ``torch.utils.flop_counter.FlopCounterMode`` counting the matmuls that
``newton_schulz`` really issues (it also counts ``2*p*k*q`` per product and ignores element-wise ops),
plus hand-derived closed forms.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.flop_counter import FlopCounterMode

from dmuon.newton_schulz.iteration import newton_schulz
from dmuon.newton_schulz.cost import (DEFAULT_GRAM_RESTART, NSCost, choose_ns_variant,
                                      direct_flops, gram_flops, gram_segments, ns_cost)


def _measured(shape, steps, variant, restart):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as fc:
        newton_schulz(g, steps=steps, coefficients="jordan", variant=variant, gram_restart=restart)
    return fc.get_total_flops()


@pytest.mark.parametrize("shape", [(3, 16, 50), (50, 16), (24, 24), (2, 2, 9, 31)])
@pytest.mark.parametrize("steps", [1, 2, 5, 7])
@pytest.mark.parametrize("variant,restart", [("direct", 2), ("gram", None), ("gram", 1),
                                             ("gram", 2), ("gram", 3)])
def test_counts_match_flop_counter(shape, steps, variant, restart):
    *lead, m, n = shape
    batch = 1
    for d in lead:
        batch *= d
    cost = ns_cost(m, n, steps, variant=variant, batch=batch, gram_restart=restart)
    assert cost == NSCost(variant, _measured(shape, steps, variant, restart))


def test_closed_forms_by_hand():
    m, n = 64, 256
    # direct: per step X X^T (2 m^2 n) + A A (2 m^3) + B X (2 m^2 n)
    assert direct_flops(m, n, 5) == 5 * (2 * m * m * n + 2 * m**3 + 2 * m * m * n)
    # gram, restart every 2 -> segments [0,1], [2,3], [4]: 3 segments, 2 restarts
    seg = 3
    expect = (2 * m * m * n + 2 * m * m * n            # A_0 and final Q X_0
              + 2 * (2 * m * m * n + 2 * m * m * n)    # each restart: Q X, X X^T
              + 5 * 2 * m**3                           # A^2 every step
              + (5 - seg) * 2 * m**3                   # Q updates (not the first of a segment)
              + (5 - seg) * 4 * m**3)                  # A updates (not the last of a segment)
    assert gram_flops(m, n, 5, 2) == expect == 12 * m * m * n + 22 * m**3
    assert gram_flops(m, n, 5, None) == 4 * m * m * n + 34 * m**3
    assert gram_flops(n, m, 5, 2) == gram_flops(m, n, 5, 2)
    assert direct_flops(n, m, 5) == direct_flops(m, n, 5)


def test_segments():
    assert DEFAULT_GRAM_RESTART == 2
    assert [gram_segments(t, 2) for t in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]
    assert gram_segments(5, None) == gram_segments(5, 0) == gram_segments(5, 9) == 1
    assert gram_segments(5, 1) == 5


def test_results_are_exact_python_ints():
    c = ns_cost(8192, 28672, 5, batch=80)
    assert type(c.flops) is int and c.variant == "gram"
    assert c.flops == 80 * gram_flops(8192, 28672, 5)
    assert ns_cost(0, 10).flops == 0 and ns_cost(10, 10, batch=0).flops == 0


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 5000), n=st.integers(1, 5000), steps=st.integers(1, 12),
       restart=st.sampled_from([None, 1, 2, 3, 4]), batch=st.integers(0, 7))
def test_auto_is_the_cheaper_and_ties_go_direct(m, n, steps, restart, batch):
    d = ns_cost(m, n, steps, variant="direct", batch=batch, gram_restart=restart)
    g = ns_cost(m, n, steps, variant="gram", batch=batch, gram_restart=restart)
    a = ns_cost(m, n, steps, variant="auto", batch=batch, gram_restart=restart)
    assert a.flops == min(d.flops, g.flops)
    per_d, per_g = direct_flops(m, n, steps), gram_flops(m, n, steps, restart)
    assert a.variant == choose_ns_variant(m, n, steps, gram_restart=restart)
    assert a.variant == ("gram" if per_g < per_d else "direct")
    assert choose_ns_variant(n, m, steps, gram_restart=restart) == a.variant
    # closed form of the difference
    s, l = min(m, n), max(m, n)
    seg = gram_segments(steps, restart)
    assert per_d - per_g == (steps - seg) * (4 * s * s * l - 6 * s**3)


def test_crossover_at_aspect_ratio_one_and_a_half():
    for m in (2, 64, 100, 1024):
        for n in range(m, 2 * m + 1):
            want = "gram" if 2 * n > 3 * m else "direct"
            assert choose_ns_variant(m, n, 5) == want, (m, n)
    assert choose_ns_variant(64, 96) == "direct"        # exactly 1.5: tie -> direct
    assert choose_ns_variant(64, 97) == "gram"
    assert choose_ns_variant(4096, 14336) == "gram"     # Llama MLP
    assert choose_ns_variant(4096, 4096) == "direct"
    assert choose_ns_variant(64, 1000, 5, gram_restart=1) == "direct"  # restarting every step ties


@pytest.mark.parametrize("kwargs,match", [
    (dict(m=-1, n=4), "m must"), (dict(m=4, n=4, steps=0), "steps"),
    (dict(m=4, n=4, variant="fast"), "variant"), (dict(m=4, n=4, batch=-2), "batch"),
    (dict(m=4, n=4, gram_restart=-1), "gram_restart"), (dict(m=4.0, n=4), "m must"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ns_cost(**kwargs)
