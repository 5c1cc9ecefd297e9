"""torch 2.15's public ``torch.optim.functional.muon`` fixes a call (names, in place, caller-owned
EMA buffers); ``dmuon.functional.torch_functional.muon`` takes the same call, and the two agree on
one device: to bf16 noise as shipped, to 1e-12 with both Newton–Schulz iterations in fp64."""
from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

F = pytest.importorskip("torch.optim.functional", reason="torch < 2.15: no public functional API")
if not hasattr(F, "muon"):
    pytest.skip("torch < 2.15: no torch.optim.functional.muon", allow_module_level=True)

from dmuon.functional import torch_functional as ours  # noqa: E402

SHAPES = [(24, 16), (16, 40), (32, 32)]
KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
          ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, adjust_lr_fn="match_rms_adamw",
          has_complex=False)


@contextlib.contextmanager
def _torch_ns_fp64():
    import torch.optim._muon as tm
    orig = tm._zeropower_via_newtonschulz

    def fp64(grad, ns_coefficients, ns_steps, eps):  # torch's iteration without its bf16 cast
        a, b, c = ns_coefficients
        x = grad.double()
        x = x.T if grad.size(0) > grad.size(1) else x
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            A = x @ x.T
            x = a * x + (b * A + c * A @ A) @ x
        return (x.T if grad.size(0) > grad.size(1) else x).to(grad.dtype)
    tm._zeropower_via_newtonschulz = fp64
    try:
        yield
    finally:
        tm._zeropower_via_newtonschulz = orig


def _run(fn, steps=6, eps=1e-7, **extra):
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    start = [p.clone() for p in ps]
    bufs = [torch.zeros_like(p) for p in ps]
    ids = [id(p) for p in ps] + [id(b) for b in bufs]
    for step in range(steps):
        gs = [torch.randn(s, generator=g, dtype=torch.float64) + 0.1 * p for s, p in zip(SHAPES, ps)]
        assert fn(ps, gs, bufs, eps=eps, **KW, **extra) is None
    assert [id(p) for p in ps] + [id(b) for b in bufs] == ids  # in place, caller-owned state
    return ps, bufs, start


def _rel(a, b, start):
    return max(float((x - y).abs().max() / (y - s).abs().max()) for x, y, s in zip(a, b, start))


def test_same_call_same_contract():
    theirs = inspect.signature(F.muon).parameters
    mine = inspect.signature(ours.muon).parameters
    assert list(theirs) == list(mine)[:len(theirs)]
    assert all(theirs[k].kind == mine[k].kind for k in theirs)
    assert set(mine) - set(theirs) == {"ns_dtype"}


def test_agrees_with_torch_functional_muon():
    p_t, b_t, start = _run(F.muon)
    p_o, b_o, _ = _run(ours.muon)  # bf16 NS, as torch's
    assert _rel(p_o, p_t, start) < 5e-2
    with _torch_ns_fp64():
        p_t, b_t, start = _run(F.muon, eps=1e-30)
    p_o, b_o, _ = _run(ours.muon, eps=1e-30, ns_dtype=torch.float64)
    assert _rel(p_o, p_t, start) < 1e-12
    assert max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(b_o, b_t)) < 1e-12
    with pytest.raises(RuntimeError, match="Foreach"):
        ours.muon([], [], [], foreach=True, eps=1e-7, **KW)
