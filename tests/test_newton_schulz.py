"""Tests of Newton–Schulz orthogonalization, coefficient schedules and matrix shapes (CPU, fast).

References are independent of the code under test: the fp64 SVD of the input, and the scalar
composed polynomial ``p_T(...p_1(s))`` applied to its singular values (NS acts on singular values
one by one and keeps singular vectors), evaluated in numpy.

Singular-value bands (``steps`` and normalized spectrum ``s / ||G||_F`` in ``[0.01, 1]``), computed
as min/max of the composed scalar polynomial over a 200k-point geometric grid of ``[0.01, 1]``:
jordan x5 -> [0.6818, 1.1344]; you x5 -> [0.9777, 1.0318]; polar_express x5 -> [0.8702, 1.1236]
(rounded outward to 4 decimals);
polar_express x8 -> [1 - 1e-14, 1 + 1e-14] (its 8th row is the fixed point 15/8, -10/8, 3/8).
Tolerances for direct vs Gram (relative Frobenius distance): fp64 1e-12, fp32 2e-5, bf16 0.08
(observed <= 3e-6 and <= 0.038 over 5 seeds and 3 schedules).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dmuon.newton_schulz.coefficients import ns_coefficient_table
from dmuon.newton_schulz.matrix_shape import as_matrix_shape
from dmuon.newton_schulz.iteration import default_ns_dtype, newton_schulz
from dmuon.newton_schulz.cost import choose_ns_variant

F64 = torch.float64
SCHEDULES = ("jordan", "you", "polar_express")
BANDS = {  # (schedule, steps) -> (lo, hi) for normalized spectrum in [0.01, 1]
    ("jordan", 5): (0.6818, 1.1344),
    ("you", 5): (0.9777, 1.0318),
    ("polar_express", 5): (0.8702, 1.1236),
    ("polar_express", 8): (1 - 1e-12, 1 + 1e-12),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _orth(gen: torch.Generator, p: int, k: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(p, k, dtype=F64, generator=gen))
    return q


def _with_spectrum(seed: int, m: int, n: int, s: np.ndarray) -> tuple[torch.Tensor, ...]:
    """G = U diag(s) V^T with random orthonormal U (m x r), V (n x r), r = min(m, n)."""
    gen = torch.Generator().manual_seed(seed)
    r = min(m, n)
    u, v = _orth(gen, m, r), _orth(gen, n, r)
    st_ = torch.as_tensor(s, dtype=F64)
    return u @ torch.diag(st_) @ v.T, u, st_, v


def _scalar_ns(s: np.ndarray, table) -> np.ndarray:
    x = np.asarray(s, dtype=np.float64)
    for a, b, c in table:
        x = a * x + b * x**3 + c * x**5
    return x


def _band_spectrum(r: int, lo: float = 0.01) -> np.ndarray:
    """Spectrum whose Frobenius-normalized values span [lo', 1/sqrt-ish] with lo' >= lo."""
    s = np.geomspace(1.0, 0.05, r)
    s[0] = 1.0
    s = s / np.linalg.norm(s)
    assert s.min() >= lo
    return s


# ---------------------------------------------------------------- reference: SVD + scalar poly
@pytest.mark.parametrize("variant", ["direct", "gram"])
@pytest.mark.parametrize("coef,steps", [("jordan", 1), ("jordan", 3), ("jordan", 7), ("you", 5),
                                        ("you", 2), ("polar_express", 5), ("polar_express", 11)])
@pytest.mark.parametrize("m,n", [(24, 80), (80, 24), (32, 32)])
def test_equals_polynomial_of_singular_values(variant, coef, steps, m, n):
    r = min(m, n)
    s = np.geomspace(3.0, 3e-3, r)
    g, u, s_t, v = _with_spectrum(7, m, n, s)
    out = newton_schulz(g, steps=steps, coefficients=coef, variant=variant, dtype=F64)
    s_norm = s / (np.linalg.norm(s) + 1e-7)
    expect = u @ torch.diag(torch.as_tensor(_scalar_ns(s_norm, ns_coefficient_table(coef, steps))))
    expect = expect @ v.T
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-10)


@pytest.mark.parametrize("coef,steps", sorted(BANDS))
def test_singular_values_in_schedule_band(coef, steps):
    lo, hi = BANDS[(coef, steps)]
    for seed, (m, n) in enumerate([(40, 120), (120, 40), (64, 64)]):
        g, u, _, v = _with_spectrum(seed, m, n, _band_spectrum(min(m, n)))
        out = newton_schulz(g, steps=steps, coefficients=coef, dtype=F64)
        sv = torch.linalg.svdvals(out)
        assert sv.min().item() >= lo - 1e-6 and sv.max().item() <= hi + 1e-6, (sv.min(), sv.max())
        # singular vectors are the polar factor's: U^T out V is diagonal (= the new singular values)
        core = u.T @ out @ v
        off = core - torch.diag(torch.diagonal(core))
        assert off.abs().max().item() < 1e-10


def test_jordan_band_is_reached_not_just_bounded():
    # the band is tight: a spread-out spectrum hits both ends of jordan's oscillation
    g, *_ = _with_spectrum(3, 64, 192, _band_spectrum(64))
    sv = torch.linalg.svdvals(newton_schulz(g, coefficients="jordan", dtype=F64))
    assert sv.min().item() < 0.75 and sv.max().item() > 1.1


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-12), (torch.float32, 1e-5)])
def test_polar_express_converges_to_polar_factor(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 48, 150, dtype=F64, generator=gen)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    assert _rel(newton_schulz(g, steps=8, dtype=dtype), polar) < tol
    assert _rel(newton_schulz(g, steps=5, dtype=F64), polar) > 1e-2  # 5 steps are visibly short


# ---------------------------------------------------------------- direct vs Gram, symmetries
@pytest.mark.parametrize("coef", SCHEDULES)
@pytest.mark.parametrize("dtype,tol", [(F64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 0.08)])
@pytest.mark.parametrize("shape", [(3, 40, 130), (2, 130, 40), (64, 96)])
def test_direct_equals_gram(coef, dtype, tol, shape):
    g = torch.randn(*shape, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    d = newton_schulz(g, coefficients=coef, variant="direct", dtype=dtype)
    gr = newton_schulz(g, coefficients=coef, variant="gram", dtype=dtype)
    assert _rel(gr, d) < tol


@pytest.mark.parametrize("restart", [None, 1, 2, 3, 7])
def test_gram_restart_period_is_exact_in_fp64(restart):
    g = torch.randn(2, 30, 100, dtype=F64, generator=torch.Generator().manual_seed(2))
    d = newton_schulz(g, steps=7, coefficients="jordan", variant="direct", dtype=F64)
    gr = newton_schulz(g, steps=7, coefficients="jordan", variant="gram", dtype=F64,
                       gram_restart=restart)
    assert _rel(gr, d) < 1e-12


def test_gram_restart_keeps_bf16_accurate():
    # without restarts the Gram recurrence diverges in bf16 for an ill-conditioned input
    g, *_ = _with_spectrum(4, 128, 512, np.geomspace(1.0, 1e-3, 128))
    ref = newton_schulz(g, dtype=F64, variant="direct")
    direct = newton_schulz(g, dtype=torch.bfloat16, variant="direct")
    gram = newton_schulz(g, dtype=torch.bfloat16, variant="gram")
    assert _rel(gram, ref) < 1.5 * _rel(direct, ref) + 0.02


@pytest.mark.parametrize("variant", ["direct", "gram", "auto"])
def test_transpose_equivariance(variant):
    g = torch.randn(2, 30, 90, dtype=F64, generator=torch.Generator().manual_seed(3))
    a = newton_schulz(g.mT, variant=variant, dtype=F64)
    b = newton_schulz(g, variant=variant, dtype=F64).mT
    torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-13), (torch.float32, 1e-5)])
def test_batched_equals_one_by_one(dtype, tol):
    g = torch.randn(5, 20, 70, dtype=F64, generator=torch.Generator().manual_seed(4))
    g[2] *= 100.0  # per-matrix normalization
    batched = newton_schulz(g, dtype=dtype)
    single = torch.stack([newton_schulz(g[i], dtype=dtype) for i in range(5)])
    assert _rel(batched, single) < tol
    # per-matrix normalization: with eps=0 the result is invariant to each matrix's scale
    assert _rel(newton_schulz(g, dtype=dtype, eps=0.0)[2],
                newton_schulz(g[2] / 100.0, dtype=dtype, eps=0.0)) < tol


def test_leading_dims():
    g = torch.randn(2, 3, 18, 40, dtype=F64, generator=torch.Generator().manual_seed(5))
    out = newton_schulz(g, dtype=F64)
    assert out.shape == g.shape
    flat = newton_schulz(g.reshape(6, 18, 40), dtype=F64).reshape(2, 3, 18, 40)
    torch.testing.assert_close(out, flat, rtol=0, atol=1e-13)
    torch.testing.assert_close(out[1, 2], newton_schulz(g[1, 2], dtype=F64), rtol=0, atol=1e-13)


def test_steps_changes_result_for_repeated_triple():
    g = torch.randn(20, 50, dtype=F64, generator=torch.Generator().manual_seed(6))
    outs = [newton_schulz(g, steps=k, coefficients="jordan", dtype=F64) for k in (3, 4, 5)]
    assert _rel(outs[0], outs[1]) > 1e-3 and _rel(outs[1], outs[2]) > 1e-3


def test_user_table_and_single_triple():
    g = torch.randn(16, 40, dtype=F64, generator=torch.Generator().manual_seed(7))
    cubic = newton_schulz(g, steps=6, coefficients=[(1.5, -0.5, 0.0)], dtype=F64)
    table = newton_schulz(g, steps=6, coefficients=[(1.5, -0.5, 0.0)] * 6, dtype=F64)
    torch.testing.assert_close(cubic, table, rtol=0, atol=0)
    you = newton_schulz(g, coefficients="you", dtype=F64)
    you_user = newton_schulz(g, coefficients=list(ns_coefficient_table("you", 5)), dtype=F64)
    torch.testing.assert_close(you, you_user, rtol=0, atol=0)


def test_auto_obeys_choose_ns_variant():
    for m, n in [(20, 64), (64, 20), (30, 30), (20, 30)]:
        g = torch.randn(m, n, dtype=F64, generator=torch.Generator().manual_seed(m * n))
        which = choose_ns_variant(m, n, 5)
        auto = newton_schulz(g, variant="auto", dtype=F64)
        torch.testing.assert_close(auto, newton_schulz(g, variant=which, dtype=F64), rtol=0, atol=0)
    assert choose_ns_variant(20, 64) == "gram" and choose_ns_variant(30, 30) == "direct"


def test_sym_hook_is_used_for_symmetric_products():
    calls = []

    def sym(a, b=None, *, alpha=1.0, beta=0.0, c=None, gamma=0.0):
        calls.append((tuple(a.shape), b is None))
        full = alpha * (a @ (a if b is None else b).mT)
        if c is not None:
            full = full + beta * c
        return full + gamma * torch.eye(a.shape[-2], dtype=a.dtype)

    g = torch.randn(2, 12, 50, dtype=F64, generator=torch.Generator().manual_seed(8))
    # direct: X X^T + polynomial per step; gram (restart 2, 5 steps -> segments 2, 2, 1):
    # 3 X X^T, 5 polynomials, 2 Q updates, 2 x 2 A updates
    for variant, n_xxt, n_total in [("direct", 5, 10), ("gram", 3, 3 + 5 + 2 + 4)]:
        calls.clear()
        out = newton_schulz(g, variant=variant, dtype=F64, sym=sym)
        assert sum(1 for _, is_xxt in calls if is_xxt) == n_xxt, (variant, calls)
        assert len(calls) == n_total, (variant, calls)
        torch.testing.assert_close(out, newton_schulz(g, variant=variant, dtype=F64),
                                   rtol=0, atol=1e-13)


# ---------------------------------------------------------------- dtypes, purity, edge cases
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32, F64])
@pytest.mark.parametrize("compute", [None, torch.float32, F64, torch.bfloat16])
def test_output_dtype_shape_and_input_untouched(in_dtype, compute):
    g = torch.randn(3, 10, 24, generator=torch.Generator().manual_seed(9)).to(in_dtype)
    before = g.clone()
    tall = g.mT
    out, out_t = newton_schulz(g, dtype=compute), newton_schulz(tall, dtype=compute)
    assert out.dtype == in_dtype and out.shape == g.shape and out.is_contiguous()
    assert out_t.dtype == in_dtype and out_t.shape == tall.shape and out_t.is_contiguous()
    assert torch.equal(g, before)
    assert torch.isfinite(out.float()).all()


def test_default_dtype():
    assert default_ns_dtype(torch.device("cpu")) == torch.float32
    assert default_ns_dtype(torch.device("cuda")) == torch.float16
    g = torch.randn(8, 20, dtype=F64, generator=torch.Generator().manual_seed(10))
    # dtype=None on CPU computes in fp32: equal to explicit fp32, not to fp64
    torch.testing.assert_close(newton_schulz(g), newton_schulz(g, dtype=torch.float32),
                               rtol=0, atol=0)
    assert not torch.equal(newton_schulz(g), newton_schulz(g, dtype=F64))


def test_zero_and_empty_inputs():
    z = newton_schulz(torch.zeros(4, 6))
    assert torch.equal(z, torch.zeros(4, 6))
    e = newton_schulz(torch.zeros(0, 4, 6))
    assert e.shape == (0, 4, 6)


@pytest.mark.parametrize("bad", [torch.randn(5), torch.tensor(1.0)])
def test_non_matrix_raises(bad):
    with pytest.raises(ValueError, match="ndim >= 2"):
        newton_schulz(bad)


def test_bad_arguments_raise():
    g = torch.randn(4, 6)
    with pytest.raises(ValueError, match="variant"):
        newton_schulz(g, variant="fast")
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(g, steps=0)
    with pytest.raises(ValueError, match="steps=6"):
        newton_schulz(g, steps=6, coefficients="you")
    with pytest.raises(ValueError, match="gram_restart"):
        newton_schulz(g, gram_restart=-1)
    with pytest.raises(ValueError, match="floating"):
        newton_schulz(g, dtype=torch.int32)


# ---------------------------------------------------------------- coefficient tables
def test_named_tables():
    assert ns_coefficient_table("jordan", 3) == ((3.4445, -4.7750, 2.0315),) * 3
    you = ns_coefficient_table("you", 5)
    assert len(you) == 5 and you[0] == (4.0848, -6.8946, 2.9270) and you[4] == (2.8366, -3.0525,
                                                                                1.2012)
    assert ns_coefficient_table("you", 2) == you[:2]
    pe = ns_coefficient_table("polar_express", 10)
    assert len(pe) == 10 and pe[7:] == ((1.875, -1.25, 0.375),) * 3  # paper: fixed point repeats
    raw = ns_coefficient_table("polar_express", 8, safety=1.0)
    assert raw[0] == (8.28721201814563, -23.595886519098837, 17.300387312530933)
    s = 1.05
    safe = ns_coefficient_table("polar_express", 8, safety=s)
    for (a, b, c), (ra, rb, rc) in zip(safe[:7], raw[:7]):
        assert math.isclose(a, ra / s) and math.isclose(b, rb / s**3) and math.isclose(c, rc / s**5)
    assert safe[7] == raw[7]


@pytest.mark.parametrize("spec,steps,match", [
    ("you", 6, "5 per-iteration rows"),
    ([(3.0, -3.0, 1.0), (2.0, -2.0, 1.0)], 3, "2 per-iteration rows"),
    ([(3.0, -3.0)], 2, "exactly"),
    ([(3.0, -3.0, 1.0, 0.0)], 2, "exactly"),
    ([(3.0, float("nan"), 1.0)], 2, "non-finite"),
    ([(3.0, float("inf"), 1.0)], 2, "non-finite"),
    ([], 2, "empty"),
    ("newton", 5, "unknown"),
    ("jordan", 0, "steps"),
    ([("a", 1, 2)], 1, "numbers"),
])
def test_bad_tables_raise(spec, steps, match):
    with pytest.raises(ValueError, match=match):
        ns_coefficient_table(spec, steps)
    with pytest.raises(ValueError, match=match):
        newton_schulz(torch.randn(3, 5), steps=steps, coefficients=spec)


def test_bad_safety_raises():
    for s in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="safety"):
            ns_coefficient_table("polar_express", 5, safety=s)


def test_longer_user_table_takes_first_rows():
    t = [(3.0, -3.0, 1.0), (2.0, -2.0, 1.0), (1.5, -0.5, 0.0)]
    assert ns_coefficient_table(t, 2) == tuple(t[:2])


# ---------------------------------------------------------------- matrix shapes
def test_as_matrix_shape():
    assert as_matrix_shape((8, 4)) == (1, 8, 4)
    assert as_matrix_shape(torch.Size([16, 3, 3, 3])) == (1, 16, 27)
    assert as_matrix_shape((4, 8, 16), batch_dims=1) == (4, 8, 16)
    assert as_matrix_shape((2, 3, 8, 5, 2), batch_dims=2) == (6, 8, 10)
    for bad, bd in [((8,), 0), ((), 0), ((4, 8), 1), ((4, 8), -1)]:
        with pytest.raises(ValueError):
            as_matrix_shape(bad, bd)


# ---------------------------------------------------------------- property test
@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 3), max_size=2), m=st.integers(1, 20), n=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_property_random_shapes(lead, m, n, seed):
    g = torch.randn(*lead, m, n, dtype=F64, generator=torch.Generator().manual_seed(seed))
    d = newton_schulz(g, variant="direct", dtype=F64)
    gr = newton_schulz(g, variant="gram", dtype=F64)
    assert d.shape == g.shape
    torch.testing.assert_close(gr, d, rtol=0, atol=1e-11)
    torch.testing.assert_close(newton_schulz(g.mT, dtype=F64), newton_schulz(g, dtype=F64).mT,
                               rtol=0, atol=1e-12)
    # every singular value of a full-rank-ish input ends up in polar_express's 5-step range
    sv = torch.linalg.svdvals(d)
    assert sv.max().item() <= 1.1236 + 1e-6


def test_batched_ns_decides_each_shape_once():
    """BatchedNS (the owners' NS) keeps each shape's NSPlan of its config: the same bits as
    deciding at every call, one plan per shape, decided again when the config is replaced."""
    from dmuon.newton_schulz.batched import BatchedNS, orthogonalize_batched
    from dmuon.newton_schulz.config import NSConfig
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 4, 6, generator=g), torch.randn(1, 6, 4, generator=g),
          torch.randn(3, 4, 6, generator=g)]
    ns = BatchedNS(NSConfig(ns_steps=4))
    for _ in range(2):
        for u, ref in zip(ns(xs), orthogonalize_batched(xs, NSConfig(ns_steps=4))):
            assert torch.equal(u, ref)
    assert sorted(k[:2] for k in ns._plans[1]) == [(4, 6), (6, 4)]
    ns.config = NSConfig(ns_steps=5)
    for u, ref in zip(ns(xs), orthogonalize_batched(xs, NSConfig(ns_steps=5))):
        assert torch.equal(u, ref)
    assert all(p.table == ns_coefficient_table("polar_express", 5) for p in ns._plans[1].values())
