"""The ``orthogonalize=`` hook and ``donate_grads`` of ``dmuon.functional.muon.update``, and the
in-place ``NSEngine.orthogonalize_`` the stateful Muon plugs into it."""
from __future__ import annotations

import pytest
import torch

from dmuon.functional import muon
from dmuon.newton_schulz.iteration import newton_schulz
from dmuon.kernels.ns_engine import NSEngine
from dmuon.newton_schulz.config import NSConfig

SHAPES = {"a": (8, 12), "b": (12, 8), "c": (8, 12), "e": (3, 6, 10), "s": (5, 5)}
BD = {"a": 0, "b": 0, "c": 0, "e": 1, "s": 0}


def _tree(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g, dtype=dtype) for n, s in SHAPES.items()}


def _clone(t):
    return {n: v.clone() for n, v in t.items()}


def _old_loop(grads, mom, params, hp):
    """The per-tensor formulation (independent of update's foreach code), in place."""
    mu, lr, wd = hp.momentum, hp.lr, hp.weight_decay
    xs, names = [], []
    for n, p in params.items():
        g = grads[n].to(p.dtype)
        b = mom[n].mul_(mu).add_(g)
        x = g.add(b, alpha=mu) if hp.nesterov else b
        xs.append(x.reshape(muon.as_matrix_shape(p.shape, BD[n])))
        names.append(n)
    us = muon.orthogonalize_batched(xs, NSConfig.from_hparams(hp))
    for n, u in zip(names, us):
        p = params[n]
        if wd:
            p.mul_(1 - lr * wd)
        p.add_(u.reshape(p.shape), alpha=-lr * muon.lr_scale_factor(p.shape, hp.lr_scale, BD[n]))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("donate", [True, False])
def test_default_path_bitwise_equals_per_tensor_loop(nesterov, donate):
    hp = muon.MuonHParams(lr=0.03, weight_decay=0.1, nesterov=nesterov)
    p_ref, p = _tree(0), _tree(0)
    m_ref = {n: torch.zeros_like(v) for n, v in p_ref.items()}
    state = muon.init(p)
    for step in range(3):
        g = _tree(10 + step)
        g_copy = _clone(g)
        _old_loop(g, m_ref, p_ref, hp)
        p, state = muon.update(g, state, p, hp, batch_dims=BD, donate=donate)
        for n in g:
            assert torch.equal(g[n], g_copy[n]), "grads must be untouched without donate_grads"
    for n in p:
        assert torch.equal(p[n], p_ref[n]), n
        assert torch.equal(state.momentum[n], m_ref[n]), n


@pytest.mark.parametrize("nesterov", [True, False])
def test_hook_functional_and_inplace_are_bitwise_default(nesterov):
    hp = muon.MuonHParams(lr=0.02, weight_decay=0.05, nesterov=nesterov)
    calls = []

    def functional(xs):
        calls.append([tuple(x.shape) for x in xs])
        return muon.orthogonalize_batched(xs, NSConfig.from_hparams(hp))

    def inplace(xs):  # overwrites its inputs, as the stateful layer's engine does
        us = muon.orthogonalize_batched(xs, NSConfig(ns_steps=hp.ns_steps))
        for x, u in zip(xs, us):
            x.copy_(u)
        return xs

    runs = {}
    for name, hook, dg in [("default", None, False), ("functional", functional, False),
                           ("inplace", inplace, True)]:
        p = _tree(1)
        state = muon.init(p)
        for step in range(3):
            g = _tree(20 + step)
            g_before = _clone(g)
            p, state = muon.update(g, state, p, hp, batch_dims=BD, donate=True,
                                   donate_grads=dg, orthogonalize=hook)
            if not dg:
                assert all(torch.equal(g[n], g_before[n]) for n in g)
        runs[name] = (p, state)
    assert len(calls) == 3 and calls[0] == [(1, 8, 12), (1, 12, 8), (1, 8, 12), (3, 6, 10),
                                            (1, 5, 5)]
    for name in ("functional", "inplace"):
        for n in SHAPES:
            assert torch.equal(runs[name][0][n], runs["default"][0][n]), (name, n)
            assert torch.equal(runs[name][1].momentum[n], runs["default"][1].momentum[n]), name


def test_donate_grads_uses_grad_storage_and_skips_none():
    p = _tree(2)
    g = _tree(3)
    g["s"] = None
    seen = []

    def hook(xs):
        seen.extend(x.data_ptr() for x in xs)
        return muon.orthogonalize_batched(xs)

    p0 = _clone(p)
    muon.update(g, muon.init(p), p, donate=True, donate_grads=True, orthogonalize=hook)
    assert seen == [g[n].data_ptr() for n in ("a", "b", "c", "e")]
    assert torch.equal(p["s"], p0["s"])
    # lower-precision grads are converted first: the caller's tensor is not written
    gb = {n: v.to(torch.bfloat16) for n, v in _tree(4).items()}
    gb_before = _clone(gb)
    muon.update(gb, muon.init(p), p, donate=True, donate_grads=True, orthogonalize=hook)
    assert all(torch.equal(gb[n], gb_before[n]) for n in gb)


def test_bad_hook_results_raise():
    p = _tree(5)
    with pytest.raises(ValueError, match="one tensor per input"):
        muon.update(_tree(6), muon.init(p), p, orthogonalize=lambda xs: xs[:-1])
    with pytest.raises(ValueError, match="one tensor per input"):
        muon.update(_tree(6), muon.init(p), p, orthogonalize=lambda xs: [x.mT for x in xs])


def test_engine_inplace_matches_functional_ns():
    eng = NSEngine(NSConfig(ns_steps=5, ns_dtype=torch.float64))
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, 16, 24, generator=g, dtype=torch.float64),
          torch.randn(1, 24, 16, generator=g, dtype=torch.float64),
          torch.randn(1, 9, 9, generator=g, dtype=torch.float64)]
    refs = [newton_schulz(x, dtype=torch.float64) for x in xs]
    for _ in range(2):  # second call: same storage key (still eager on CPU)
        srcs = [x.clone() for x in xs]
        ptrs = [s.data_ptr() for s in srcs] if _ == 0 else ptrs
        if _ == 1:
            for s, x in zip(keep, xs):
                s.copy_(x)
            srcs = keep
        out = eng.orthogonalize_(srcs, batch_dims=1)
        assert all(o is s for o, s in zip(out, srcs))
        for o, r in zip(out, refs):
            assert (o - r).norm() / r.norm() < 1e-10
        keep = srcs
    assert eng.last_mode == "eager"
    with pytest.raises(ValueError, match="contiguous"):
        eng.orthogonalize_([torch.randn(8, 6, dtype=torch.float64).mT])
