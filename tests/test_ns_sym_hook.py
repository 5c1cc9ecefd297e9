"""The ``sym=`` hook of ``newton_schulz`` (CPU): its reference op, that only products with a
symmetric result reach it, that a triangle-only implementation gives the same NS, and the
``normalize=False`` entry used by the batched engine.

References are independent fp64 formulas (``alpha a b^T + beta c + gamma I`` written out) and the
unhooked functional NS.
"""
from __future__ import annotations

import pytest
import torch

from dmuon.newton_schulz.iteration import frobenius_normalize, newton_schulz, sym_product

F64 = torch.float64


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _sym_pair(gen, bsz, m, k):
    """``a`` (B, m, k) and a symmetric ``s`` (B, m, m) commuting with ``a a^T`` (a polynomial)."""
    a = torch.randn(bsz, m, k, dtype=F64, generator=gen)
    gm = a @ a.mT / k
    return a, gm, gm @ gm - 0.5 * gm


def test_sym_product_matches_formula():
    gen = torch.Generator().manual_seed(0)
    a, gm, s = _sym_pair(gen, 3, 9, 14)
    eye = torch.eye(9, dtype=F64)
    torch.testing.assert_close(sym_product(a), a @ a.mT, rtol=0, atol=1e-12)
    got = sym_product(a, alpha=-1.5, beta=2.0, c=s, gamma=0.25)
    torch.testing.assert_close(got, -1.5 * a @ a.mT + 2.0 * s + 0.25 * eye, rtol=0, atol=1e-12)
    got = sym_product(gm, s, alpha=0.5, beta=-3.0, c=gm)
    torch.testing.assert_close(got, 0.5 * gm @ s.mT - 3.0 * gm, rtol=0, atol=1e-12)
    # beta == 0 never reads c (a NaN c must not leak), and inputs are left alone
    nan_c = torch.full_like(s, float("nan"))
    before = a.clone()
    out = sym_product(a, c=nan_c, beta=0.0, gamma=1.0)
    assert not torch.isnan(out).any()
    assert torch.equal(a, before)


def _triangle_sym(a, b=None, *, alpha=1.0, beta=0.0, c=None, gamma=0.0):
    """A different implementation of the contract, like a SYRK kernel: compute the upper
    triangle only (row by row, from rows of a and b) and mirror it."""
    bb = a if b is None else b
    m = a.shape[-2]
    out = torch.zeros(a.shape[0], m, m, dtype=a.dtype)
    for i in range(m):
        row = alpha * (a[:, i:i + 1, :] @ bb[:, i:, :].mT)[:, 0, :]
        if c is not None and beta != 0.0:
            row = row + beta * c[:, i, i:]
        row[:, 0] += gamma
        out[:, i, i:] = row
        out[:, i:, i] = row
    return out


@pytest.mark.parametrize("variant", ["direct", "gram"])
@pytest.mark.parametrize("restart", [None, 2])
@pytest.mark.parametrize("shape", [(2, 10, 37), (37, 10), (12, 12)])
def test_triangle_hook_gives_same_ns(variant, restart, shape):
    x = torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    ref = newton_schulz(x, dtype=F64, variant=variant, gram_restart=restart)
    got = newton_schulz(x, dtype=F64, variant=variant, gram_restart=restart, sym=_triangle_sym)
    assert _rel(got, ref) < 1e-12
    got32 = newton_schulz(x.float(), dtype=torch.float32, variant=variant, gram_restart=restart,
                          sym=_triangle_sym)
    assert _rel(got32, ref) < 1e-4


@pytest.mark.parametrize("variant", ["direct", "gram"])
def test_only_symmetric_products_reach_the_hook(variant):
    """Each call's exact result (fp64) must be symmetric, else a triangle kernel would be wrong."""
    seen = []

    def checking_sym(a, b=None, **kw):
        full = a @ (a if b is None else b).mT
        seen.append((full - full.mT).abs().max().item() / full.abs().max().item())
        return sym_product(a, b, **kw)

    x = torch.randn(3, 16, 60, dtype=F64, generator=torch.Generator().manual_seed(2))
    newton_schulz(x, dtype=F64, variant=variant, gram_restart=2, sym=checking_sym)
    assert seen and max(seen) < 1e-12, seen


def test_normalize_false_takes_a_normalized_input():
    x = torch.randn(4, 20, 52, generator=torch.Generator().manual_seed(3))
    for dt in (torch.float32, torch.bfloat16):
        x0 = frobenius_normalize(x, 1e-7, dt)
        for variant in ("direct", "gram"):
            a = newton_schulz(x, dtype=dt, variant=variant)
            b = newton_schulz(x0, dtype=dt, variant=variant, normalize=False).to(x.dtype)
            assert torch.equal(a, b), (dt, variant)
    # out= writes into a donated (here transposed) view with the same bits
    buf = torch.empty(4, 52, 20, dtype=torch.bfloat16)
    frobenius_normalize(x, 1e-7, torch.bfloat16, out=buf.mT)
    assert torch.equal(buf.mT, frobenius_normalize(x, 1e-7, torch.bfloat16))
    # the norm runs in fp32 at least: an fp64 input keeps fp64 accuracy of the scale
    n = frobenius_normalize(x.double(), 0.0, F64).norm(dim=(-2, -1))
    torch.testing.assert_close(n, torch.ones(4, dtype=F64), rtol=0, atol=1e-14)


def test_bad_hook_raises():
    with pytest.raises(TypeError, match="sym"):
        newton_schulz(torch.randn(4, 6), sym="triton")
