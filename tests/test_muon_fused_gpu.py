"""The fused (Triton) elementwise stages of Muon equal the reference foreach stages on CUDA.

``dmuon.kernels.muon_elementwise`` plugs into ``dmuon.functional.muon.update(elementwise=...)``.
Checked: the kernels alone against an fp64 formula (odd sizes, unaligned views, aliasing of the
Nesterov output with the gradient); whole ``update`` calls, fused vs the default path, on several
shapes (square, wide, tall, a batched expert stack), with and without donation, Nesterov and
weight decay, fp32 (<= 1e-6 relative) and bf16 params (state tolerance); fp64 masters fall back to
the reference bitwise; the stateful optimizer uses the fused stages on CUDA.
"""
from __future__ import annotations

import pytest
import torch

from dmuon.functional import muon

pytestmark = pytest.mark.gpu

# the library's own module must import (it handles a missing Triton itself): a broken module
# fails here instead of skipping every test
import dmuon.kernels.muon_elementwise as ew_mod  # noqa: E402
DEV = "cuda"

SHAPES = {"sq": (256, 256), "wide": (128, 640), "tall": (1000, 96), "odd": (37, 53),
          "experts": (3, 64, 200)}
BD = {"experts": 1}


def _fused():
    ew = ew_mod.fused_elementwise()
    if ew is None:
        pytest.skip("Triton / CUDA not available")
    return ew


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _tree(seed, dtype):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return {n: torch.randn(s, generator=g, device=DEV, dtype=torch.float32).to(dtype)
            for n, s in SHAPES.items()}


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("n,offset", [(4096 * 3, 0), (100003, 0), (5000, 1), (7, 3)])
def test_kernels_match_fp64_formula(nesterov, n, offset, monkeypatch):
    ew = _fused()

    def no_fallback(*a, **k):
        raise AssertionError("supported tensors must not fall back to the foreach stages")
    monkeypatch.setattr(ew_mod, "foreach_momentum_", no_fallback)
    monkeypatch.setattr(ew_mod, "foreach_apply_", no_fallback)
    gen = torch.Generator(device=DEV).manual_seed(n + offset)
    base = [torch.randn(n + offset, generator=gen, device=DEV) for _ in range(4)]
    b, g, p, u = (t[offset:] for t in base)   # offset 1: not 16-byte aligned
    mu, decay, alpha = 0.95, 1 - 0.02 * 0.1, -0.37
    b64, g64, p64, u64 = (t.double() for t in (b, g, p, u))
    b_ref = mu * b64 + g64
    x_ref = g64 + mu * b_ref
    p_ref = p64 * decay + alpha * u64
    g_before = g.clone()
    x = torch.full_like(g, float("nan"))
    ew.momentum([b], [g], [x] if nesterov else None, mu)
    assert _rel(b, b_ref) <= 1e-6
    assert torch.equal(g, g_before)
    if nesterov:
        assert torch.isfinite(x).all() and _rel(x, x_ref) <= 1e-6
        # Nesterov input formed in the gradient's own storage
        b2, g2 = (t.clone() for t in base[:2])
        b2, g2 = b2[offset:], g2[offset:]
        b2.copy_(b64.float()), g2.copy_(g64.float())
        ew.momentum([b2], [g2], [g2], mu)
        assert _rel(b2, b_ref) <= 1e-6 and _rel(g2, x_ref) <= 1e-6
    ew.apply([p], [u], decay, [alpha])
    assert _rel(p, p_ref) <= 1e-6
    torch.cuda.synchronize()


def _run(ew, dtype, donate, nesterov, wd, steps=3, grad_dtype=None):
    hp = muon.MuonHParams(lr=0.03, weight_decay=wd, nesterov=nesterov, ns_dtype=torch.float32)
    params = _tree(0, dtype)
    state = muon.init(params)
    seen = []

    def ortho(xs):  # a smooth stand-in for NS (Lipschitz, so the stages' rounding stays visible)
        seen.append([x.clone() for x in xs])
        return [torch.tanh(x.float() * 0.5) for x in xs]

    for step in range(steps):
        grads = _tree(100 + step, grad_dtype or dtype)
        params, state = muon.update(grads, state, params, hp, batch_dims=BD, donate=donate,
                                    donate_grads=donate, orthogonalize=ortho, elementwise=ew)
    return params, state.momentum, seen


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_update_fused_equals_reference_fp32(donate, nesterov, wd, monkeypatch):
    ew = _fused()
    calls = []
    monkeypatch.setattr(ew_mod, "foreach_momentum_", lambda *a: calls.append("fallback"))
    monkeypatch.setattr(ew_mod, "foreach_apply_", lambda *a: calls.append("fallback"))
    p_f, m_f, x_f = _run(ew, torch.float32, donate, nesterov, wd)
    assert calls == [], "every fp32 contiguous tensor must take the fused kernels"
    p_r, m_r, x_r = _run(None, torch.float32, donate, nesterov, wd)
    for n in SHAPES:
        assert _rel(p_f[n], p_r[n]) <= 1e-6, n
        assert _rel(m_f[n], m_r[n]) <= 1e-6, n
        assert p_f[n].shape == SHAPES[n] and p_f[n].dtype == torch.float32
    for a, b in zip(x_f, x_r):
        for xa, xb in zip(a, b):
            assert xa.shape == xb.shape and _rel(xa, xb) <= 1e-6


def test_update_fused_bf16_grads_fp32_masters():
    ew = _fused()
    p_f, m_f, _ = _run(ew, torch.float32, True, True, 0.1, grad_dtype=torch.bfloat16)
    p_r, m_r, _ = _run(None, torch.float32, True, True, 0.1, grad_dtype=torch.bfloat16)
    for n in SHAPES:
        assert _rel(p_f[n], p_r[n]) <= 1e-6 and _rel(m_f[n], m_r[n]) <= 1e-6, n


@pytest.mark.parametrize("donate", [True, False])
def test_update_fused_bf16_params(donate):
    ew = _fused()
    p_f, m_f, _ = _run(ew, torch.bfloat16, donate, True, 0.1)
    p_r, m_r, _ = _run(None, torch.bfloat16, donate, True, 0.1)
    for n in SHAPES:
        assert p_f[n].dtype == torch.bfloat16
        assert _rel(p_f[n], p_r[n]) <= 1e-2, n   # reference rounds to bf16 after every op
        assert _rel(m_f[n], m_r[n]) <= 1e-2, n


def test_fp64_and_noncontiguous_fall_back_bitwise():
    ew = _fused()
    gen = torch.Generator(device=DEV).manual_seed(5)
    b = torch.randn(64, 48, generator=gen, device=DEV, dtype=torch.float64)
    g = torch.randn(64, 48, generator=gen, device=DEV, dtype=torch.float64)
    bt = torch.randn(48, 64, generator=gen, device=DEV).mT      # non-contiguous fp32
    gt = torch.randn(64, 48, generator=gen, device=DEV)
    ins = [b, g, bt, gt]
    ref = [t.clone() for t in ins]
    xs_f = [torch.empty_like(g), torch.empty_like(gt)]
    xs_r = [torch.empty_like(g), torch.empty_like(gt)]
    ew.momentum([ins[0], ins[2]], [ins[1], ins[3]], xs_f, 0.9)
    muon.foreach_momentum_([ref[0], ref[2]], [ref[1], ref[3]], xs_r, 0.9)
    for a, r in zip(ins + xs_f, ref + xs_r):
        assert torch.equal(a, r)


def test_update_with_real_ns_close_to_reference():
    ew = _fused()
    hp = muon.MuonHParams(lr=0.02, weight_decay=0.01)
    out = {}
    for name, e in (("fused", ew), ("ref", None)):
        params, state = _tree(1, torch.float32), None
        state = muon.init(params)
        for step in range(3):
            params, state = muon.update(_tree(200 + step, torch.float32), state, params, hp,
                                        batch_dims=BD, donate=True, donate_grads=True,
                                        elementwise=e)
        out[name] = (params, state.momentum)
    for n in SHAPES:
        assert _rel(out["fused"][0][n], out["ref"][0][n]) <= 1e-3, n   # bf16 NS in between
        assert _rel(out["fused"][1][n], out["ref"][1][n]) <= 1e-6, n


def test_stateful_optimizer_picks_fused_on_cuda():
    import inspect

    from dmuon.functional.muon_options import KNOBS
    from dmuon.stateful.optimizer import muon as opt_mod
    # default: fused on CUDA when Triton imports (an execution knob since issue 45: its default
    # is KNOBS', optimizer.set_elementwise changes it; it is no constructor option any more)
    assert KNOBS["elementwise"] == "auto" and "elementwise" not in inspect.signature(
        opt_mod.Muon.__init__).parameters
    assert ew_mod.fused_elementwise() is not None
