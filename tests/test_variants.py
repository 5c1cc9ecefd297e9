"""Muon's variants as chains, against single-device references written from the papers' formulas
(matrix by matrix, fp64, two-pass norms): NorMuon (Li et al. 2025's reference ``normuon_update``),
Muon-Hyperball (Emerging-Optimizers' pre / post weight-update hooks), NorMuonH (their chain);
``variants.muon()`` is ``muon.update`` bitwise."""
from __future__ import annotations

import io

import pytest
import torch

from dmuon.functional import muon, variants
from dmuon.functional.matrix_view import Batch
from dmuon.functional import transforms as T
from dmuon.functional.stages import NEEDS, stage
from dmuon.newton_schulz.coefficients import ns_coefficient_table

F64 = torch.float64
SHAPES = {"a": (12, 8), "b": (6, 10), "e": (3, 5, 7)}
VIEWS = {"e": 1}
HP = muon.MuonHParams(lr=0.03, momentum=0.9, weight_decay=0.0, ns_dtype=F64,
                      ns_coefficients="jordan", lr_scale="jordan")


def _tree(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g, dtype=F64) for n, s in SHAPES.items()}


def _ns(x):  # Jordan's quintic, fp64, the matrix as given
    t = x.shape[0] > x.shape[1]
    x = x.T if t else x
    x = x / (x.norm() + HP.ns_eps)
    for a, b, c in ns_coefficient_table("jordan", HP.ns_steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if t else x


def _matrices(w):
    return [w] if w.ndim == 2 else list(w.unbind(0))


def _reference(kind, steps, wd=0.0, beta2=0.95, radius=None):
    """One process, matrix by matrix: the papers' formulas."""
    p = {n: [m.clone() for m in _matrices(w)] for n, w in _tree(0).items()}
    b = {n: [torch.zeros_like(m) for m in ms] for n, ms in p.items()}
    v = {n: [torch.zeros(m.shape[0], 1, dtype=F64) for m in ms] for n, ms in p.items()}
    R = {n: [m.norm() if radius is None else torch.tensor(radius, dtype=F64) for m in ms]
         for n, ms in p.items()}
    for step in range(steps):
        g = _tree(10 + step)
        for n in p:
            if step == 1 and n == "b":
                continue  # no gradient: skipped, state kept
            for i, gm in enumerate(_matrices(g[n])):
                W, B = p[n][i], b[n][i]
                B.mul_(HP.momentum).add_(gm)
                O = _ns(gm + HP.momentum * B)
                if "normuon" in kind:  # normuon_update: rows by their second moment, norm kept
                    vnorm = O.norm()
                    v[n][i].lerp_((O * O).mean(-1, keepdim=True), 1 - beta2)
                    O = O / (v[n][i].sqrt() + 1e-10)
                    O = O * (vnorm / (O.norm() + 1e-10))
                if "hyperball" in kind:  # pre hook, W − lr·u, post hook
                    u = O * (R[n][i] / O.norm().clamp_min(1e-8))
                    W = W - HP.lr * u
                    p[n][i] = W * (R[n][i] / W.norm().clamp_min(1e-8))
                else:
                    s = max(1.0, W.shape[0] / W.shape[1]) ** 0.5
                    p[n][i] = W * (1 - HP.lr * wd) - HP.lr * s * O
    return {n: ms[0] if len(ms) == 1 and SHAPES[n].__len__() == 2 else torch.stack(ms)
            for n, ms in p.items()}


def _run(chain, steps, inplace=True):
    p = _tree(0)
    st = chain.init(p)
    for step in range(steps):
        g = _tree(10 + step)
        if step == 1:
            g["b"] = None
        if inplace:
            p, st = T.update_params(chain, g, st, p)
        else:
            u, st = chain.update(g, st, p)
            p = T.apply_updates(p, u)
    return p, st


def _err(x, y):
    return max(float((x[n] - y[n]).abs().max() / y[n].abs().max()) for n in y)


@pytest.mark.parametrize("kind,wd", [("normuon", 0.1), ("muon_hyperball", 0.0),
                                     ("normuon_hyperball", 0.0)])
def test_variant_equals_its_single_device_reference(kind, wd):
    variant = getattr(variants, kind)()
    chain = variant(HP._replace(weight_decay=wd), batch_dims=VIEWS)
    ref = _reference(kind, 4, wd=wd)
    got, st = _run(chain, 4)
    assert _err(got, ref) < 1e-10, kind
    optax, _ = _run(chain, 4, inplace=False)  # the optax form: the same stages
    assert _err(optax, ref) < 1e-10, kind
    if "hyperball" in kind:  # each matrix keeps its first norm
        for n, w in got.items():
            for m, m0 in zip(_matrices(w), _matrices(_tree(0)[n])):
                assert abs(float(m.norm() / m0.norm()) - 1) < 1e-12
    assert set(chain.needs) <= set(NEEDS)


def test_fixed_radius_and_the_checks():
    chain = variants.muon_hyperball(radius=2.0)(HP, batch_dims=VIEWS)
    got, _ = _run(chain, 3)
    assert _err(got, _reference("muon_hyperball", 3, radius=2.0)) < 1e-10
    with pytest.raises(ValueError, match="weight_decay=0"):
        variants.muon_hyperball()(HP._replace(weight_decay=0.1))
    with pytest.raises(ValueError, match="beta2"):
        variants.normuon(beta2=1.0)(HP)
    with pytest.raises(ValueError, match="unknown|dmuon knows"):
        stage(lambda leaves, st: st, needs=("the_loss",))


def test_muon_variant_is_muon_update_bitwise():
    chain = variants.muon()(HP._replace(weight_decay=0.1), batch_dims=VIEWS)
    got, st = _run(chain, 3)
    p, s = _tree(0), muon.init(_tree(0))
    for step in range(3):
        g = _tree(10 + step)
        if step == 1:
            g["b"] = None
        p, s = muon.update(g, s, p, HP._replace(weight_decay=0.1), batch_dims=VIEWS)
    assert all(torch.equal(got[n], p[n]) for n in p)
    assert all(torch.equal(st.states[0].momentum[n], s.momentum[n]) for n in p)


def test_variant_states_load_weights_only():
    for kind in ("normuon", "muon_hyperball", "normuon_hyperball"):
        hp = HP._replace(lr=lambda t: 0.03 * 0.9 ** t)
        _, st = _run(getattr(variants, kind)()(hp, batch_dims=VIEWS), 2)
        buf = io.BytesIO()
        torch.save(st, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)
        assert str(back) == str(st)
    # the per-row second moment: one value per row of each matrix of the view
    st = variants.normuon()(HP, batch_dims=VIEWS).init(_tree(0))
    assert {n: tuple(t.shape) for n, t in st.states[2].second_moment.items()} == \
        {"a": (12,), "b": (6,), "e": (15,)}


@pytest.mark.parametrize("G,R", [(4, 1), (2, 2)])
def test_world_step_runs_a_variant_equal_to_one_process(G, R):
    """The pure distributed step (simulated ranks, the owners' chain) equals one process."""
    from dmuon.functional.buckets import hook_groups
    from dmuon.functional.program import step_program
    from dmuon.functional.step import world_step

    shapes = {f"layers.{i}.{p}.weight": s for i in range(2)
              for p, s in (("q", (6, 8)), ("o", (8, 6)), ("up", (10, 8)))}
    names = sorted(shapes)
    owners = {n: (k % G, (k // G) % R) for k, n in enumerate(names)}
    prog = step_program(owners, shapes, {n: "torch.float64" for n in names}, shard_size=G,
                        replicate_size=R, groups=hook_groups(names))
    W = G * R
    g = torch.Generator().manual_seed(W)
    full = {n: torch.randn(*s, generator=g, dtype=F64) for n, s in shapes.items()}
    for kind in ("normuon", "muon_hyperball", "normuon_hyperball"):
        variant = getattr(variants, kind)()
        chain = variant(HP)
        ref, ref_st = dict(full), chain.init(full)
        params = [{n: full[n].clone() for n in names if owners[n][0] == i % G} for i in range(W)]
        states = None
        for step in range(2):
            grads = [{n: torch.randn(*shapes[n], generator=g, dtype=F64) for n in names}
                     for _ in range(W)]
            params, states, _ = world_step(params, grads, prog, states, HP, transform=variant)
            avg = {n: sum(gr[n] for gr in grads) / W for n in names}
            ref, ref_st = T.update_params(chain, avg, ref_st, ref)
            for i in range(W):
                for n, v in params[i].items():
                    torch.testing.assert_close(v, ref[n], rtol=0, atol=1e-12)


def test_owner_step_groups_a_variant_by_the_policy_multipliers():
    from dmuon.functional.owner_step import owner_step
    p, g = _tree(0), _tree(1)
    mults = {"a": (0.5, 1.0), "e": (2.0, 1.0)}
    got, st = owner_step(g, None, p, HP._replace(weight_decay=0.1),
                         transform=variants.normuon(), views={"e": Batch(1)}, mults=mults)
    for n in p:
        lm, wm = mults.get(n, (1.0, 1.0))
        hp = HP._replace(lr=HP.lr * lm, weight_decay=0.1 * wm)
        one = variants.normuon()(hp, batch_dims=VIEWS if n == "e" else None)
        ref, _ = T.update_params(one, {n: g[n]}, one.init({n: p[n]}), {n: p[n]})
        assert torch.equal(got[n], ref[n]), n


def test_an_owner_without_a_quantity_raises_at_construction():
    """A stage needing the whole matrix cannot run on a tensor-parallel slice's owner."""
    from types import SimpleNamespace

    from dmuon.stateful.optimizer.owner import OwnerDriver as VariantRunner

    def whole(hp):
        spectral = stage(lambda leaves, st: st, needs=("whole_matrix",))
        return T.chain(variants.muon()(hp), spectral)

    rt = SimpleNamespace(matrices=SimpleNamespace(hp_mults={}),
                         tp_layouts={"layers.0.o_proj.weight": SimpleNamespace(dim=1)})
    with pytest.raises(ValueError, match="'whole_matrix'.*layers.0.o_proj.weight"):
        VariantRunner(whole, HP, rt)
    with pytest.raises(TypeError, match="transform must be"):
        VariantRunner(42, HP, rt)
