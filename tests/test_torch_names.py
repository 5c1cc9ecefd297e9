"""torch.optim.Muon's names where they mean what dmuon's mean, and every option checked when
``dmuon.Muon(...)`` is built (issue 36).

Before: torch's flat coefficient triple ``ns_coefficients=(3.4445, -4.775, 2.0315)`` was accepted
at construction and failed on every rank at the first ``step()`` (so did ``"you"`` with
``ns_steps=6``); ``eps=`` / ``adjust_lr_fn=`` were ``TypeError`` s; ``replicate_async="no"`` was
silently ``True``; ``dmuon.Muon(model, 0.02)`` was a ``TypeError``.
"""
from __future__ import annotations

import math

import pytest
import torch
from dist_utils import catch, run_ranks
from models import make_batches, make_model, muon_predicate

from dmuon.functional import muon as fmuon
from dmuon.functional.lr_scale import lr_scale_factor
from dmuon.newton_schulz.coefficients import ns_coefficient_table

TORCH_TRIPLE = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's default ns_coefficients


# ----------------------------------------------------------------------------- pure
def test_torch_flat_triple_is_a_constant_schedule():
    assert ns_coefficient_table(TORCH_TRIPLE, 5) == ns_coefficient_table("jordan", 5)
    assert ns_coefficient_table(list(TORCH_TRIPLE), 3) == (TORCH_TRIPLE,) * 3
    fmuon.validate_hparams(fmuon.MuonHParams(ns_coefficients=TORCH_TRIPLE))
    g = {"w": torch.randn(6, 4, dtype=torch.float64)}
    p = {"w": torch.randn(6, 4, dtype=torch.float64)}
    hp = dict(ns_dtype=torch.float64)
    a, _ = fmuon.update(g, fmuon.init(p), p, fmuon.MuonHParams(ns_coefficients=TORCH_TRIPLE, **hp))
    b, _ = fmuon.update(g, fmuon.init(p), p, fmuon.MuonHParams(ns_coefficients="jordan", **hp))
    assert torch.equal(a["w"], b["w"])


@pytest.mark.parametrize("bad,needle", [
    (dict(ns_coefficients="bogus"), "ns_coefficients"),
    (dict(ns_coefficients="you", ns_steps=6), "ns_steps=6"),
    (dict(ns_coefficients=((1.0, 2.0),)), "(a, b, c)"),
    (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
    (dict(nesterov="yes"), "nesterov"),
    (dict(ns_eps=float("nan")), "ns_eps"),
    (dict(lr=True), "lr"),
    # torch's value under dmuon's name: say so
    (dict(lr_scale="original"), "adjust_lr_fn"),
])
def test_validate_hparams_catches_what_step_would(bad, needle):
    with pytest.raises((ValueError, TypeError), match=None) as e:
        fmuon.validate_hparams(fmuon.MuonHParams(**bad))
    assert needle in str(e.value), str(e.value)


def test_torch_adjust_lr_fn_values_map_where_the_math_is_the_same():
    from dmuon.functional.muon_options import ADJUST_LR_FN, resolve_torch_names

    # torch.optim.Muon's _adjust_lr (2.15), for 2-D shapes (A, B) = shape
    torch_scale = {None: lambda A, B: math.sqrt(max(1, A / B)),
                   "original": lambda A, B: math.sqrt(max(1, A / B)),
                   "match_rms_adamw": lambda A, B: 0.2 * math.sqrt(max(A, B)),
                   "spectral_unclamped": lambda A, B: math.sqrt(A / B)}
    assert set(ADJUST_LR_FN) == set(torch_scale)
    for value, fn in torch_scale.items():
        for shape in [(64, 16), (16, 64), (32, 32), (3, 7)]:
            ours = lr_scale_factor(shape, ADJUST_LR_FN[value])
            assert math.isclose(ours, fn(*shape), rel_tol=1e-15), (value, shape)
    hp = fmuon.MuonHParams()._asdict()
    out = resolve_torch_names(hp, eps=1e-8, adjust_lr_fn="match_rms_adamw")
    assert out["ns_eps"] == 1e-8 and out["lr_scale"] == "moonlight" and "eps" not in out
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        resolve_torch_names(hp, adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match="ns_eps"):  # two spellings, two values
        resolve_torch_names(dict(hp, ns_eps=1e-6), eps=1e-8)
    assert resolve_torch_names(dict(hp, ns_eps=1e-8), eps=1e-8)["ns_eps"] == 1e-8


# ----------------------------------------------------------------------------- dmuon.Muon
def _prepare(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    model = make_model()
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, muon_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model, opt, rank, world, steps=2):
    import dmuon
    for ids in make_batches(steps, 4):
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()
    return dmuon.get_model_state_dict(model)


BAD = {
    "coef_name": dict(ns_coefficients="bogus"),
    "coef_steps": dict(ns_coefficients="you", ns_steps=6),
    "coef_row": dict(ns_coefficients=((1.0, 2.0),)),
    "nesterov": dict(nesterov="yes"),
    "replicate_async": dict(replicate_async="no"),
    "persistent": dict(persistent_grad_buffers="yes"),
    "adjust_lr_fn": dict(adjust_lr_fn="sqrt"),
    "lr_scale": dict(lr_scale="adamw"),
    "eps": dict(eps=-1.0),
    "both_eps": dict(eps=1e-8, ns_eps=1e-6),
    "positional": "positional",
}


def _worker(rank, world):
    import dmuon
    out = {}
    model = _prepare(rank, world)
    for key, kw in BAD.items():
        if kw == "positional":  # torch's positional order (lr, weight_decay, ...) is not ours
            out[key] = catch(lambda: dmuon.Muon(model, 0.02, 0.1))
        else:
            out[key] = catch(lambda: dmuon.Muon(model, **kw))
    # positional lr and torch's names: one spelling in param_groups
    def groups():
        g = dmuon.Muon(model, 0.03, eps=1e-8, adjust_lr_fn="original").param_groups[0]
        return (g["lr"], g["ns_eps"], g["lr_scale"], "eps" in g, "adjust_lr_fn" in g)
    out["groups"] = _result(groups)
    # the flat triple trains exactly like the named schedule it spells
    hp = dict(ns_dtype=torch.float64, ns_steps=5)
    out["flat"] = _result(lambda: _train(
        model, dmuon.Muon(model, ns_coefficients=TORCH_TRIPLE, **hp), rank, world))
    other = _prepare(rank, world)
    out["named"] = _train(other, dmuon.Muon(other, ns_coefficients="jordan", **hp), rank, world)
    return out


def _result(fn):
    """``fn()``, or the exception it raised as ``("raised", type, message)``."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return ("raised", type(e).__name__, str(e))


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("key", sorted(BAD))
def test_a_bad_option_raises_at_construction_on_every_rank(results, key):
    for r in results:
        kind, msg = r[key]
        assert kind in ("ValueError", "TypeError"), (key, kind, msg)
    needle = {"coef_name": "ns_coefficients", "coef_steps": "ns_steps=6", "coef_row": "(a, b, c)",
              "nesterov": "nesterov", "replicate_async": "replicate_async",
              "persistent": "persistent_grad_buffers", "adjust_lr_fn": "match_rms_adamw",
              "lr_scale": "lr_scale", "eps": "eps", "both_eps": "ns_eps",
              "positional": "by name"}[key]
    assert needle in results[0][key][1], results[0][key]


def test_positional_lr_and_torch_names(results):
    for r in results:
        assert r["groups"] == (0.03, 1e-8, "jordan", False, False)


def test_flat_triple_trains_like_the_named_schedule(results):
    for r in results:
        assert r["flat"].keys() == r["named"].keys()
        assert all(torch.equal(r["flat"][k], r["named"][k]) for k in r["flat"])


# ----------------------------------------------------------------------------- same math as torch
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw",
                                          "spectral_unclamped"])
def test_torch_names_give_torch_optim_muons_update(adjust_lr_fn):
    """torch.optim.Muon (its NS run in fp64, eps=0) and dmuon's functional Muon given torch's
    values through dmuon.functional.muon_options agree to fp64 rounding: the aliases mean the same,
    and the momentum conventions (torch's EMA buffer, dmuon's sum) give the same update."""
    import torch.optim._muon as torch_muon

    from dmuon.functional.muon_options import resolve_torch_names
    if adjust_lr_fn == "spectral_unclamped" and "spectral_unclamped" not in open(
            torch_muon.__file__).read():
        pytest.skip(f"torch {torch.__version__} has no adjust_lr_fn='spectral_unclamped' (2.15 has)")

    def fp64_ns(grad, ns_coefficients, ns_steps, eps):  # torch's iteration without the bf16 cast
        a, b, c = ns_coefficients
        x = grad.double()
        x = x.T if grad.size(0) > grad.size(1) else x
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            A = x @ x.T
            x = a * x + (b * A + c * A @ A) @ x
        return (x.T if grad.size(0) > grad.size(1) else x).to(grad.dtype)

    g = torch.Generator().manual_seed(3)
    shapes = {"tall": (12, 5), "wide": (5, 12), "square": (7, 7)}
    init = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
             for _ in range(4)]
    theirs = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = torch.optim.Muon(list(theirs.values()), lr=1e-2, weight_decay=0.1, eps=0.0,
                           adjust_lr_fn=adjust_lr_fn)
    orig = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = fp64_ns
    try:
        for gr in grads:
            for k, p in theirs.items():
                p.grad = gr[k].clone()
            opt.step()
    finally:
        torch_muon._zeropower_via_newtonschulz = orig
    # torch's defaults where dmuon's differ, passed under torch's names where they have them
    hp = resolve_torch_names(dict(fmuon.MuonHParams()._asdict(), lr=1e-2, weight_decay=0.1,
                                  ns_coefficients=TORCH_TRIPLE, ns_dtype=torch.float64),
                             eps=0.0, adjust_lr_fn=adjust_lr_fn)
    ours, state = {k: v.clone() for k, v in init.items()}, None
    state = fmuon.init(ours)
    for gr in grads:
        ours, state = fmuon.update(gr, state, ours, fmuon.MuonHParams(**hp))
    for k in shapes:
        moved = (theirs[k].detach() - init[k]).abs().max()
        assert (ours[k] - theirs[k].detach()).abs().max() <= 1e-12 * moved, k
