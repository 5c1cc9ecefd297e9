"""Tall matrices iterate in their own layout: no transposed copies, same numbers.

``ns_iterate`` on a transposed view of a contiguous tall batch must give what the contiguous wide
copy gives (fp64: to rounding; the products are the same sums), return the result in the
transposed layout, and ``left_product``'s ``final`` hook must see the last general product.
The scale-and-cast gather/scatter's CPU fallback must equal ``frobenius_normalize``.
"""
from __future__ import annotations

import pytest
import torch

from dmuon.newton_schulz.coefficients import ns_coefficient_table
from dmuon.newton_schulz.iteration import (frobenius_denominator, frobenius_normalize,
                                            left_product, newton_schulz, ns_iterate)
from dmuon.kernels.scale_cast import scale_cast_

TABLE = ns_coefficient_table("polar_express", 5)


@pytest.mark.parametrize("variant", ["direct", "gram"])
@pytest.mark.parametrize("restart", [None, 2])
def test_transposed_layout_iterates_without_copies(variant, restart):
    g = torch.Generator().manual_seed(11)
    tall = torch.randn(3, 40, 12, generator=g, dtype=torch.float64)       # (B, long, short)
    x0_t = frobenius_normalize(tall, 1e-7, torch.float64).mT              # transposed view
    assert not x0_t.is_contiguous() and x0_t.mT.is_contiguous()
    x0_w = x0_t.contiguous()                                              # wide copy
    y_t = ns_iterate(x0_t, TABLE, variant=variant, gram_restart=restart)
    y_w = ns_iterate(x0_w, TABLE, variant=variant, gram_restart=restart)
    assert y_t.mT.is_contiguous() and not y_t.is_contiguous(), "result must stay transposed"
    assert y_w.is_contiguous()
    torch.testing.assert_close(y_t, y_w, rtol=0, atol=1e-13)
    # and newton_schulz of the tall matrix is the transpose of that
    torch.testing.assert_close(newton_schulz(tall, dtype=torch.float64, variant=variant,
                                             gram_restart=restart), y_w.mT, rtol=0, atol=1e-13)


def test_left_product_layouts_and_final_hook():
    g = torch.Generator().manual_seed(2)
    p = torch.randn(2, 5, 5, generator=g, dtype=torch.float64)
    x = torch.randn(2, 9, 5, generator=g, dtype=torch.float64).mT          # transposed (2, 5, 9)
    c = torch.randn(2, 9, 5, generator=g, dtype=torch.float64).mT
    ref = p @ x + 0.5 * c
    out = left_product(p, x, beta=0.5, c=c)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)
    assert out.mT.is_contiguous()
    torch.testing.assert_close(left_product(p, x.contiguous()), p @ x, rtol=0, atol=1e-13)
    seen = []

    def final(q, xx, *, alpha=1.0, beta=0.0, c=None):
        seen.append((q.shape, alpha, beta, c is None))
        return None
    x0 = frobenius_normalize(torch.randn(2, 6, 20, generator=g, dtype=torch.float64), 0.0,
                             torch.float64)
    assert ns_iterate(x0, TABLE, variant="gram", final=final) is None
    assert seen == [((2, 6, 6), 1.0, 0.0, True)]                          # Q X_0, once
    seen.clear()
    assert ns_iterate(x0, TABLE, variant="direct", final=final) is None
    assert len(seen) == 1 and seen[0][1:3] == (1.0, TABLE[-1][0]) and not seen[0][3]  # a X + Z X
    # with a range lift s the last product drops it (alpha = 1/s), unless a restart did already
    seen.clear()
    ns_iterate(x0 * 8, TABLE, variant="direct", final=final, lift=8.0)
    ns_iterate(x0 * 8, TABLE, variant="gram", final=final, lift=8.0, gram_restart=None)
    ns_iterate(x0 * 8, TABLE, variant="gram", final=final, lift=8.0, gram_restart=3)
    assert [t[1:3] for t in seen] == [(1 / 8, TABLE[-1][0] / 8), (1 / 8, 0.0), (1.0, 0.0)]
    torch.testing.assert_close(left_product(p, x, alpha=0.25, beta=0.5, c=c),
                               0.25 * (p @ x) + 0.5 * c, rtol=0, atol=1e-13)
    torch.testing.assert_close(left_product(p, x, alpha=0.25), 0.25 * (p @ x), rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="variant"):
        ns_iterate(x0, TABLE, variant="auto")


def test_scale_cast_fallback_equals_frobenius_normalize():
    g = torch.Generator().manual_seed(5)
    src = torch.randn(4, 30, 7, generator=g)
    den = frobenius_denominator(src, 1e-7, torch.bfloat16)
    got = scale_cast_(torch.empty(4, 30, 7, dtype=torch.bfloat16), src, den)
    assert torch.equal(got, frobenius_normalize(src, 1e-7, torch.bfloat16))
    back = scale_cast_(torch.empty(4, 30, 7), got)
    assert torch.equal(back, got.float())
    with pytest.raises(ValueError, match="contiguous"):
        scale_cast_(torch.empty(4, 7, 30), src.mT)
    with pytest.raises(ValueError, match="differ"):
        scale_cast_(torch.empty(4, 30, 8), src)
