"""Composable functional transforms: Muon and AdamW as chains equal their fused updates; partition,
swapped orthogonalizers and added stages; inputs untouched; the public surface matches the README."""
from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

import dmuon
from dmuon.functional import adamw, muon
from dmuon.functional import transforms as T
from dmuon.newton_schulz import NSConfig

ROOT = Path(__file__).resolve().parents[1]


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(16, 8, generator=g, dtype=torch.float64),
            "b": torch.randn(8, 24, generator=g, dtype=torch.float64),
            "experts": torch.randn(3, 6, 10, generator=g, dtype=torch.float64)}


def _grads(params, step: int, skip: str | None = None):
    g = torch.Generator().manual_seed(100 + step)
    return {n: None if n == skip else torch.randn(p.shape, generator=g, dtype=p.dtype)
            for n, p in params.items()}


def _rel(a, b) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm()) for n in a)


@pytest.mark.parametrize("nesterov,wd,rule", [(True, 0.1, "moonlight"), (False, 0.0, "jordan"),
                                              (True, 0.0, "none")])
def test_muon_chain_equals_fused_update(nesterov, wd, rule):
    hp = muon.MuonHParams(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=wd,
                          ns_dtype=torch.float64, lr_scale=rule)
    bd = {"experts": 1}
    p_fused = p_chain = _params()
    snapshot = {n: t.clone() for n, t in p_chain.items()}
    st_fused = muon.init(p_fused)
    opt = muon.transform(hp, batch_dims=bd)
    st_chain = opt.init(p_chain)
    for step in range(5):
        grads = _grads(p_fused, step, skip="b" if step == 2 else None)
        p_fused, st_fused = muon.update(grads, st_fused, p_fused, hp, batch_dims=bd)
        upd, st_chain = opt.update(grads, st_chain, p_chain)
        if step == 0:
            assert all(torch.equal(snapshot[n], _params()[n]) for n in snapshot)  # inputs untouched
        if step == 2:
            assert upd["b"] is None
        p_chain = T.apply_updates(p_chain, upd)
    assert _rel(p_chain, p_fused) < 1e-12
    assert _rel(st_chain.states[0].momentum, st_fused.momentum) < 1e-12
    assert _rel(p_chain, _params()) > 1e-3  # it moved


def test_adamw_chain_equals_fused_update():
    hp = adamw.AdamWHParams(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.05)
    p1 = p2 = {"w": torch.randn(5, 4, dtype=torch.float64), "v": torch.randn(7, dtype=torch.float64)}
    s1, opt = adamw.init(p1), adamw.transform(hp)
    s2 = opt.init(p2)
    for step in range(5):
        grads = {n: torch.randn_like(p) for n, p in p1.items()}
        p1, s1 = adamw.update(grads, s1, p1, hp)
        upd, s2 = opt.update(grads, s2, p2)
        p2 = T.apply_updates(p2, upd)
    assert _rel(p2, p1) < 1e-12
    assert s2.states[0].step == s1.step == 5


def test_partition_routes_like_separate_updates():
    params = {"w": torch.randn(12, 6, dtype=torch.float64), "bias": torch.randn(6, dtype=torch.float64)}
    mhp = muon.MuonHParams(lr=0.02, ns_dtype=torch.float64)
    ahp = adamw.AdamWHParams(lr=1e-3)
    opt = T.partition({"muon": muon.transform(mhp), "adamw": adamw.transform(ahp)},
                      lambda name, p: "muon" if p.ndim >= 2 else "adamw")
    state = opt.init(params)
    ms, as_ = muon.init({"w": params["w"]}), adamw.init({"bias": params["bias"]})
    ref = dict(params)
    for _ in range(3):
        grads = {n: torch.randn_like(p) for n, p in params.items()}
        upd, state = opt.update(grads, state, params)
        params = T.apply_updates(params, upd)
        w, ms = muon.update({"w": grads["w"]}, ms, {"w": ref["w"]}, mhp)
        b, as_ = adamw.update({"bias": grads["bias"]}, as_, {"bias": ref["bias"]}, ahp)
        ref = {**w, **b}
    assert _rel(params, ref) < 1e-12
    with pytest.raises(ValueError, match="label"):
        T.partition({"muon": muon.transform(mhp)}, lambda n, p: "adamw").init(params)


def test_swapped_orthogonalizer_and_added_stage_are_used():
    params = {"w": torch.randn(8, 8, dtype=torch.float64)}
    grads = {"w": torch.randn(8, 8, dtype=torch.float64)}
    calls = []

    def identity(xs):
        calls.append([tuple(x.shape) for x in xs])
        return xs

    hp = muon.MuonHParams(lr=0.1, momentum=0.5, nesterov=False, lr_scale="none")
    opt = muon.transform(hp, orthogonalizer=identity)
    upd, _ = opt.update(grads, opt.init(params), params)
    assert calls == [[(1, 8, 8)]]
    torch.testing.assert_close(upd["w"], -0.1 * grads["w"], rtol=0, atol=1e-15)  # momentum SGD

    jordan3 = muon.transform(hp, orthogonalizer=NSConfig(ns_steps=3, ns_coefficients="jordan",
                                                         ns_dtype=torch.float64))
    u3, _ = jordan3.update(grads, jordan3.init(params), params)
    u5, _ = muon.transform(hp._replace(ns_dtype=torch.float64)).update(grads, opt.init(params), params)
    assert float((u3["w"] - u5["w"]).norm()) > 1e-3  # the swap changed the orthogonalizer

    double = T.Transform(lambda p: T.EmptyState(), lambda u, s, p: ({n: 2 * v for n, v in u.items()}, s))
    opt2 = T.chain(muon.transform(hp, orthogonalizer=identity), double)
    u2, _ = opt2.update(grads, opt2.init(params), params)
    torch.testing.assert_close(u2["w"], -0.2 * grads["w"], rtol=0, atol=1e-15)


def test_research_example_runs(capsys):
    spec = importlib.util.spec_from_file_location("research_transforms",
                                                  ROOT / "examples" / "research_transforms.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main() == 0  # every variant's loss fell
    out = capsys.readouterr().out
    assert "muon_3step_jordan" in out and "muon_clipped" in out


def test_muon_takes_lr_by_position_and_the_rest_by_keyword():
    """lr by position as torch's optimizers take it; the rest by name (torch.optim.Muon's positional
    order would mislead: tests/test_torch_names.py checks the error says so)."""
    sig = inspect.signature(dmuon.Muon.__init__)
    params = list(sig.parameters.values())
    assert [p.name for p in params[:3]] == ["self", "model", "lr"]
    assert params[2].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert params[3].kind is inspect.Parameter.VAR_POSITIONAL  # raises, saying why
    # (the last: **deprecated, the former spellings for one release since issue 45)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[4:-1])
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
    with pytest.raises(TypeError, match="by name"):
        dmuon.Muon(torch.nn.Linear(2, 2), 0.02, 0.1)  # torch.optim.Muon's order would mislead
    assert "ns_steps" not in inspect.signature(dmuon.dedicate_params).parameters
