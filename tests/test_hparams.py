"""Hyper-parameters as values or schedules, as a researcher uses them: a function of the step in
``scale_by_learning_rate`` / ``MuonHParams``, a 0-d tensor (``torch.compile`` traces it, so a
scheduled train step compiles once), an lr / weight-decay sweep under ``torch.vmap``, the step a
tensor, every state loading with ``torch.load(weights_only=True)``."""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

from dmuon.functional import adamw, muon
from dmuon.functional import transforms as T
from dmuon.newton_schulz import NSConfig

F64 = torch.float64


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(),
                         nn.Linear(16, 4, bias=False)).to(F64)


def _data(n=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=g, dtype=F64), torch.randn(32, 4, generator=g, dtype=F64))
            for _ in range(n)]


def _loss(model):
    return lambda p, x, y: nn.functional.mse_loss(functional_call(model, p, (x,)), y)


def _sched(t):
    return 0.05 * (1 - t / 20)


def test_schedules_equal_the_values_of_each_step():
    model, data = _model(), _data()
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = _loss(model)
    # scale_by_learning_rate(fn): the schedule at the count of updates before this one
    by_fn = T.chain(T.trace_momentum(0.9), T.orthogonalize(NSConfig(ns_dtype=F64)),
                    T.scale_by_learning_rate(_sched))
    p, st = dict(p0), by_fn.init(p0)
    q = dict(p0)
    sq = None
    for step, (x, y) in enumerate(data):
        g = grad(loss)(p, x, y)
        u, st = by_fn.update(g, st, p)
        p = T.apply_updates(p, u)
        fixed = T.chain(T.trace_momentum(0.9), T.orthogonalize(NSConfig(ns_dtype=F64)),
                        T.scale_by_learning_rate(_sched(step)))
        sq = fixed.init(q) if sq is None else sq
        u, sq = fixed.update(grad(loss)(q, x, y), sq, q)
        q = T.apply_updates(q, u)
        assert all(torch.equal(p[n], q[n]) for n in p)
    assert isinstance(st.states[2].count, torch.Tensor) and int(st.states[2].count) == len(data)
    # MuonHParams: lr / momentum / weight_decay as schedules or 0-d tensors
    hp_fn = muon.MuonHParams(lr=_sched, weight_decay=lambda t: 0.1 + 0 * t, ns_dtype=F64)
    hp_t = muon.MuonHParams(lr=torch.tensor(0.05, dtype=F64), weight_decay=0.1, ns_dtype=F64)
    s_fn, s_t, s_f = muon.init(p0), muon.init(p0), muon.init(p0)
    a, b, c = dict(p0), dict(p0), dict(p0)
    for step, (x, y) in enumerate(data[:3]):
        g = grad(loss)(a, x, y)
        a, s_fn = muon.update(g, s_fn, a, hp_fn)
        c, s_f = muon.update(g, s_f, c, hp_fn._replace(lr=_sched(step), weight_decay=0.1))
        assert all(torch.equal(a[n], c[n]) for n in a)
    s_c, c = muon.init(p0), dict(p0)
    for x, y in data[:3]:
        g = grad(loss)(b, x, y)
        b, s_t = muon.update(g, s_t, b, hp_t)
        c, s_c = muon.update(g, s_c, c, hp_t._replace(lr=0.05))
    assert max(float((b[n] - c[n]).abs().max()) for n in b) < 1e-15  # a tensor: its own rounding
    assert isinstance(s_fn.step, torch.Tensor) and int(s_fn.step) == 3
    with pytest.raises(ValueError, match="lr"):
        muon.validate_hparams(muon.MuonHParams(lr=torch.tensor(-1.0)))


def test_compiled_train_step_with_a_scheduled_lr_compiles_once():
    model, data = _model(), _data(12)
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = _loss(model)
    chain = muon.transform(muon.MuonHParams(lr=_sched, momentum=0.9, weight_decay=0.01,
                                            ns_dtype=F64))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def train_step(params, state, x, y):
        return T.update_params(chain, grad(loss)(params, x, y), state, params)

    compiled = torch.compile(train_step, backend=backend, fullgraph=True)
    torch._dynamo.reset()
    p, st, q, sq = dict(p0), chain.init(p0), dict(p0), chain.init(p0)
    for x, y in data:
        p, st = compiled(p, st, x, y)
        q, sq = train_step(q, sq, x, y)
    assert len(graphs) == 1, f"{len(graphs)} graphs for {len(data)} steps"
    assert max(float((p[n] - q[n]).abs().max()) for n in p) < 1e-12
    torch._dynamo.reset()


def test_lr_and_weight_decay_sweep_under_vmap():
    model, data = _model(), _data(4)
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = _loss(model)

    def train(lr, wd, params):
        chain = muon.transform(muon.MuonHParams(lr=lr, weight_decay=wd, ns_dtype=F64))
        state = chain.init(params)
        for x, y in data:
            params, state = T.update_params(chain, grad(loss)(params, x, y), state, params)
        return params

    lrs = torch.tensor([0.01, 0.02, 0.05], dtype=F64)
    wds = torch.tensor([0.0, 0.1, 0.3], dtype=F64)
    stacked = {n: v.expand(3, *v.shape).clone() for n, v in p0.items()}
    swept = torch.vmap(train)(lrs, wds, stacked)
    for i in range(3):
        one = train(float(lrs[i]), float(wds[i]), dict(p0))
        assert max(float((swept[n][i] - one[n]).abs().max()) for n in one) < 1e-12


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_every_state_loads_with_weights_only():
    params = {"w": torch.randn(4, 3), "v": torch.randn(5, 4)}
    states = [
        muon.init(params), adamw.init(params),
        muon.transform(muon.MuonHParams(lr=_sched)).init(params),
        adamw.transform(adamw.AdamWHParams()).init(params),
        T.partition({"a": muon.transform(), "b": adamw.transform()},
                    lambda n, p: "a" if n == "w" else "b").init(params),
    ]
    for st in states:
        back = _roundtrip(st)
        assert type(back) is type(st)
        assert str(back) == str(st)
    assert isinstance(muon.init(params).step, torch.Tensor)
    assert isinstance(adamw.init(params).step, torch.Tensor)


def test_hparams_key_tells_every_value_apart():
    """A variant's chain is reused by ``dmuon.Muon``'s owners while ``hparams_key`` is equal: a
    changed value (a scheduler's lr, ``-0.0``, an int for a float) changes the key, and a tensor
    or a schedule (it may change in place) has none, so its chain is built at every step."""
    key = muon.hparams_key
    base = muon.MuonHParams(lr=0.02)
    assert key(base) == key(muon.MuonHParams(lr=0.02))
    assert hash(key(base)) == hash(key(muon.MuonHParams(lr=0.02)))
    for other in (base._replace(lr=0.021), base._replace(weight_decay=-0.0),
                  base._replace(ns_steps=6), base._replace(ns_dtype=torch.float64),
                  base._replace(momentum=0.95 + 1e-16 if 0.95 + 1e-16 != 0.95 else 0.9500001),
                  base._replace(ns_coefficients=[(3.0, -3.0, 1.0)] * 5)):
        assert key(other) != key(base), other
    assert key(base._replace(ns_coefficients=[(3.0, -3.0, 1.0)])) != \
        key(base._replace(ns_coefficients=[(3, -3.0, 1.0)]))
    assert key(base._replace(lr=torch.tensor(0.02))) is None
    assert key(base._replace(lr=lambda t: 0.02)) is None


def test_shape_scale_decides_each_shape_once(monkeypatch):
    """The shape-scale stage keeps each (shape, view)'s scales: a chain run for several steps asks
    lr_scale_factors once per shape, with the bits of a chain built afresh at every step."""
    from dmuon.functional.stages import shape_scale
    calls = []
    real = shape_scale.lr_scale_factors
    monkeypatch.setattr(shape_scale, "lr_scale_factors",
                        lambda *a: calls.append(a[0]) or real(*a))
    g = torch.Generator().manual_seed(0)
    p0 = {"a": torch.randn(4, 6, generator=g, dtype=F64), "b": torch.randn(6, 4, generator=g,
                                                                           dtype=F64)}
    grads = [{n: torch.randn(t.shape, generator=g, dtype=F64) for n, t in p0.items()}
             for _ in range(3)]
    hp = muon.MuonHParams(lr=0.05, ns_dtype=F64)
    kept = muon.transform(hp)
    p, st, q, sq = dict(p0), kept.init(p0), dict(p0), kept.init(p0)
    for gr in grads:
        p, st = T.update_params(kept, gr, st, p)
    assert sorted(calls) == [(4, 6), (6, 4)]  # once per shape, not per step
    for gr in grads:
        q, sq = T.update_params(muon.transform(hp), gr, sq, q)
    assert all(torch.equal(p[n], q[n]) for n in p)
