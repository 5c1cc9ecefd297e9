"""One definition of the math: ``muon.update`` / ``adamw.update`` are their chains of stages run in
place, bitwise; the optax form of a chain shares every stage's rounding but the last one's; fused
implementations plug into a stage; NS is timed by the orthogonalizer object, not by a callback."""
from __future__ import annotations

import pytest
import torch

from dmuon.functional import adamw, muon
from dmuon.functional import transforms as T
from dmuon.functional.lr_scale import lr_scale_factors
from dmuon.functional.matrix_view import Batch, Heads, Split
from dmuon.newton_schulz.batched import BatchedNS
from dmuon.newton_schulz.config import NSConfig
from dmuon.newton_schulz.timing import NSTimer, elapsed_ms

SHAPES = {"a": (16, 8), "b": (8, 24), "e": (3, 6, 10), "h": (12, 10), "s": (10, 5)}
VIEWS = {"e": Batch(1), "h": Heads(3), "s": Split((4, 6))}


def _tree(seed, shapes=SHAPES, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g, dtype=dtype) for n, s in shapes.items()}


def _equal(x, y):
    return all(torch.equal(x[n], y[n]) for n in x)


@pytest.mark.parametrize("nesterov,wd,rule", [(True, 0.1, "moonlight"), (False, 0.0, "jordan"),
                                              (True, 0.0, "none")])
def test_muon_update_is_its_chain_in_place(nesterov, wd, rule):
    hp = muon.MuonHParams(lr=0.03, momentum=0.9, nesterov=nesterov, weight_decay=wd, lr_scale=rule)
    opt = muon.transform(hp, view=VIEWS)
    p_u, p_c, p_o = _tree(0), _tree(0), _tree(0)
    s_u, s_c, s_o = muon.init(p_u), opt.init(p_c), opt.init(p_o)
    for step in range(3):
        g = _tree(10 + step)
        if step == 1:
            g["b"] = None
        p_u, s_u = muon.update(g, s_u, p_u, hp, view=VIEWS)
        p_c, s_c = T.update_params(opt, g, s_c, p_c)
        u, s_o = opt.update(g, s_o, p_o)
        p_o = T.apply_updates(p_o, u)
        assert _equal(p_c, p_u) and _equal(s_c.states[0].momentum, s_u.momentum)
        # the optax form: the same stages, bitwise, up to the last one's rounding
        assert _equal(s_o.states[0].momentum, s_u.momentum)
        assert max(float((p_o[n] - p_u[n]).abs().max()) for n in p_u) < 1e-6
    # donated: the same objects, the same values
    p_d, s_d = _tree(0), opt.init(_tree(0))
    keep = dict(p_d)
    for step in range(3):
        g = _tree(10 + step)
        if step == 1:
            g["b"] = None
        p_d, s_d = T.update_params(opt, g, s_d, p_d, donate=True)
    assert all(p_d[n] is keep[n] for n in keep) and _equal(p_d, p_u)


@pytest.mark.parametrize("impl", adamw.IMPLS)
def test_adamw_update_is_its_chain_in_place(impl):
    hp = adamw.AdamWHParams(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    shapes = {"w": (5, 4), "v": (7,), "s": ()}
    opt = adamw.transform(hp)
    p_u, p_c = _tree(1, shapes), _tree(1, shapes)
    s_u, s_c = adamw.init(p_u), opt.init(p_c)
    for step in range(4):
        g = _tree(20 + step, shapes)
        p_u, s_u = adamw.update(g, s_u, p_u, hp, impl=impl)
        p_c, s_c = T.update_params(opt, g, s_c, p_c)
        adam = s_c.states[0]
        if impl == "fused":  # one kernel for the whole chain: same math, other rounding
            assert max(float((p_c[n] - p_u[n]).abs().max()) for n in p_u) < 1e-6
        else:  # CPU: foreach runs torch's per-tensor ops, so both equal the chain
            assert _equal(p_c, p_u) and _equal(adam.mu, s_u.mu) and _equal(adam.nu, s_u.nu)
        assert adam.step == s_u.step == step + 1


def test_adamw_groups_by_dtype():
    # foreach lists and the fused kernel take one dtype: the chain runs per group of leaves
    hp = adamw.AdamWHParams(lr=1e-2, weight_decay=0.1)
    shapes = {"w": (5, 4), "v": (7,), "d": (3, 3)}
    out = {}
    for impl in adamw.IMPLS:
        p = _tree(8, shapes)
        p["d"] = p["d"].double()
        st = adamw.init(p)
        for step in range(3):
            g = {n: t.to(p[n].dtype) for n, t in _tree(30 + step, shapes).items()}
            p, st = adamw.update(g, st, p, hp, impl=impl)
        assert p["d"].dtype == st.mu["d"].dtype == torch.float64
        out[impl] = p, st
    assert _equal(out["foreach"][0], out["reference"][0])
    assert _equal(out["foreach"][1].nu, out["reference"][1].nu)
    assert max(float((out["fused"][0][n] - out["reference"][0][n]).abs().max()) for n in shapes) < 1e-6


def test_fused_stage_implementations_are_used():
    calls = []

    def momentum(bs, gs, xs, mu):
        calls.append("momentum")
        muon.foreach_momentum_(bs, gs, xs, mu)

    def apply(ps, us, decay, alphas):
        calls.append("apply")
        muon.foreach_apply_(ps, us, decay, alphas)

    ew = muon.MuonElementwise(momentum=momentum, apply=apply)
    hp = muon.MuonHParams(weight_decay=0.1)
    p = _tree(2)
    ref, _ = muon.update(_tree(3), muon.init(p), p, hp, view=VIEWS)
    out, _ = muon.update(_tree(3), muon.init(p), p, hp, view=VIEWS, elementwise=ew)
    assert calls == ["momentum", "apply"] and _equal(out, ref)
    calls.clear()
    opt = muon.transform(hp, view=VIEWS, elementwise=ew)
    opt.update(_tree(3), opt.init(p), p)  # the optax form runs the momentum implementation too
    assert calls == ["momentum"]


def test_pending_scale_folds_into_the_applying_stage():
    # Split((4, 6)) of (10, 5) has two block shapes: each block is scaled by its own s; the others
    # fold s into alpha = -lr*s of one fused add, as the historical update did
    hp = muon.MuonHParams(lr=0.02, lr_scale="moonlight")
    seen = []
    opt = muon.transform(hp, view=VIEWS, elementwise=muon.MuonElementwise(
        momentum=muon.foreach_momentum_,
        apply=lambda ps, us, d, alphas: (seen.extend(alphas), muon.foreach_apply_(ps, us, d, alphas))))
    p = _tree(4)
    T.update_params(opt, _tree(5), opt.init(p), p)
    s = [lr_scale_factors(SHAPES[n], "moonlight", VIEWS.get(n, Batch(0))) for n in "aehs"]
    assert len(set(s[3])) == 2  # the Split's blocks: (4, 5) and (6, 5)
    s = [muon.lr_scale_factor(SHAPES["a"]), muon.lr_scale_factor(SHAPES["b"]), s[1][0], s[2][0]]
    assert seen == [-0.02 * s[0], -0.02 * s[1], -0.02 * s[2], -0.02 * s[3], -0.02]


def test_ns_of_decides_the_owners_ns_for_each_choice():
    """dmuon.functional.muon_options.ns_of (pure): what Muon.set_ns_engine runs per choice and
    device; a given engine is itself; anything else raises."""
    from dmuon.functional.muon_options import ns_of

    class Engine:  # stands in for dmuon.kernels.ns_engine.NSEngine
        pass

    mine = Engine()
    assert ns_of(mine, "cpu", Engine) is mine and ns_of(mine, "cuda", Engine) is mine
    assert ns_of("auto", "cpu", Engine) is BatchedNS and ns_of("auto", "cuda", Engine) is Engine
    assert ns_of("engine", "cpu", Engine) is Engine and ns_of("engine", "cuda", Engine) is Engine
    assert ns_of("functional", "cuda", Engine) is BatchedNS
    with pytest.raises(ValueError, match="ns_engine must be"):
        ns_of("fast", "cpu", Engine)


def test_stateful_ns_hook_hands_core_objects_that_time_themselves():
    from dmuon.functional.stages.orthogonalize import OrthogonalizerFor
    from dmuon.functional.muon_options import ns_of
    from dmuon.kernels.ns_engine import NSEngine

    class Tel:
        ns_timer = None

    class Hook:  # what dmuon.Muon.set_ns_engine decides: the NS of each choice, timed
        def __init__(self, choice, tel):
            tel.ns_timer = self.timer = NSTimer()
            self.of = OrthogonalizerFor(ns_of(choice, "cpu", NSEngine), timer=self.timer)

        def for_step(self, device_type, hp):
            return self.of(NSConfig.from_hparams(hp), [])

        mode = property(lambda self: self.timer.mode)

    tel = Tel()
    hook = Hook("auto", tel)
    hp = muon.MuonHParams(ns_dtype=torch.float64)
    ortho = hook.for_step("cpu", hp)
    assert isinstance(ortho, BatchedNS) and tel.ns_timer is hook.timer and hook.mode == "none"
    p = _tree(6, dtype=torch.float64)
    ref, _ = muon.update(_tree(7, dtype=torch.float64), muon.init(p), p, hp)
    out, _ = muon.update(_tree(7, dtype=torch.float64), muon.init(p), p, hp, orthogonalize=ortho)
    assert _equal(out, ref)
    spans = hook.timer.take()
    assert len(spans) == 1 and elapsed_ms(spans) > 0 and hook.mode == "functional"
    assert hook.timer.take() == [] and elapsed_ms([]) is None
    eng = Hook("engine", tel).for_step("cpu", hp)
    assert isinstance(eng, NSEngine) and eng.timer is tel.ns_timer
    muon.update(_tree(7, dtype=torch.float64), muon.init(p), p, hp, orthogonalize=eng,
                donate_grads=True)
    assert len(tel.ns_timer.take()) == 1 and tel.ns_timer.mode == "eager"


def test_orthogonalizer_twin_computes_the_same_on_objects_of_its_own_untimed():
    """``OrthogonalizerFor.twin`` (the NS overlap's per-group NS): for a class, its own instance;
    for a given engine, the engine's twin; untimed; the same results; refused when wrapped."""
    from dmuon.functional.stages.orthogonalize import OrthogonalizerFor
    from dmuon.kernels.ns_engine import NSEngine

    cfg = NSConfig(ns_dtype=torch.float64)
    xs = [torch.randn(2, 6, 4, dtype=torch.float64)]
    for ns in (BatchedNS, NSEngine, NSEngine(cfg, sym_backend="torch")):
        base = OrthogonalizerFor(ns, timer=NSTimer())
        twin = base.twin()
        a, b = base(cfg, ["w"]), twin(cfg, ["w"])
        assert a is not b and b.timer is None and a.timer is base.timer
        assert torch.equal(list(a([x.clone() for x in xs]))[0], list(b([x.clone() for x in xs]))[0])
    with pytest.raises(ValueError, match="wrapped"):
        OrthogonalizerFor(BatchedNS, wrap=lambda run, names: run).twin()


def test_untimed_orthogonalizers_record_nothing():
    timer = NSTimer()
    xs = [torch.randn(2, 6, 4, dtype=torch.float64)]
    cfg = NSConfig(ns_dtype=torch.float64)
    assert torch.equal(BatchedNS(cfg)(xs)[0], BatchedNS(cfg, timer=timer)(xs)[0])
    assert len(timer.spans) == 1 and timer.mode == "functional"
    BatchedNS(cfg, timer=timer)([])
    assert len(timer.spans) == 1  # nothing to orthogonalize: no span
