"""Tests of the functional AdamW (dmuon.functional.adamw) against torch.optim.AdamW."""
import collections

import optree
import pytest
import torch

from dmuon.functional import adamw

SHAPES = {"w1": (7, 5), "b1": (5,), "emb": (3, 4, 2), "scalar": ()}


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}


def _grads(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_bitwise_equal_to_torch_adamw(wd):
    hp = adamw.AdamWHParams(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd)
    params = _params()
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=hp.lr, betas=hp.betas, eps=hp.eps,
                            weight_decay=hp.weight_decay, foreach=False)
    state = adamw.init(params)
    for step in range(10):
        grads = _grads(step)
        for k, p in ref.items():
            p.grad = grads[k].clone()
        opt.step()
        params, state = adamw.update(grads, state, params, hp)
        for k, p in ref.items():
            assert torch.equal(params[k], p.detach()), (step, k)
            assert torch.equal(state.mu[k], opt.state[p]["exp_avg"]), (step, k)
            assert torch.equal(state.nu[k], opt.state[p]["exp_avg_sq"]), (step, k)
    assert state.step == 10


def test_none_grad_leaves_leaf_and_moments_unchanged():
    params = _params()
    state = adamw.init(params)
    params, state = adamw.update(_grads(0), state, params)
    grads = _grads(1)
    grads["b1"] = None
    new_params, new_state = adamw.update(grads, state, params)
    assert new_params["b1"] is params["b1"]
    assert new_state.mu["b1"] is state.mu["b1"] and new_state.nu["b1"] is state.nu["b1"]
    assert not torch.equal(new_params["w1"], params["w1"])
    assert new_state.step == 2


def test_purity_and_donation():
    hp = adamw.AdamWHParams(lr=1e-2, weight_decay=0.1)
    params = _params()
    state = adamw.init(params)
    params, state = adamw.update(_grads(0), state, params, hp)  # non-zero moments
    grads = _grads(1)
    snap = optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x,
                           (grads, state, params))
    out_p, out_s = adamw.update(grads, state, params, hp)
    for a, b in zip(optree.tree_leaves((grads, state, params)), optree.tree_leaves(snap)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    for k in params:
        assert out_p[k] is not params[k]
    # Donation: same objects, updated in place, equal to the pure result.
    d_p, d_s = adamw.update(grads, state, params, hp, donate=True)
    for k in params:
        assert d_p[k] is params[k] and d_s.mu[k] is state.mu[k] and d_s.nu[k] is state.nu[k]
        assert torch.equal(d_p[k], out_p[k])
        assert torch.equal(d_s.mu[k], out_s.mu[k]) and torch.equal(d_s.nu[k], out_s.nu[k])
        assert not torch.equal(params[k], snap[2][k])
    assert d_s.step == out_s.step == 2


def test_nested_pytree_and_state_is_pytree():
    Pair = collections.namedtuple("Pair", "a b")
    params = {"block": [torch.ones(3), Pair(torch.zeros(2, 2), torch.ones(1))]}
    state = adamw.init(params)
    grads = optree.tree_map(torch.ones_like, params)
    new_params, new_state = adamw.update(grads, state, params)
    assert optree.tree_structure(new_params) == optree.tree_structure(params)
    leaves, spec = optree.tree_flatten(new_state)
    assert leaves[0] == 1 and len(leaves) == 1 + 2 * 3
    assert isinstance(optree.tree_unflatten(spec, leaves), adamw.AdamWState)


def test_low_precision_grads_run_in_param_dtype():
    params = {"w": torch.randn(4, 3, dtype=torch.float64)}
    g16 = {"w": torch.randn(4, 3).bfloat16()}
    out, st = adamw.update(g16, adamw.init(params), params)
    ref, _ = adamw.update({"w": g16["w"].double()}, adamw.init(params), params)
    assert out["w"].dtype == torch.float64 and st.mu["w"].dtype == torch.float64
    assert torch.equal(out["w"], ref["w"])


def test_bad_input_raises():
    params = _params()
    state = adamw.init(params)
    with pytest.raises(ValueError, match="betas"):
        adamw.update(_grads(0), state, params, adamw.AdamWHParams(betas=(1.0, 0.9)))
    with pytest.raises(ValueError, match="lr"):
        adamw.update(_grads(0), state, params, adamw.AdamWHParams(lr=-1.0))
    with pytest.raises(ValueError, match="structure"):
        adamw.update({"w1": torch.zeros(7, 5)}, state, params)
    bad = _grads(0)
    bad["w1"] = torch.zeros(5, 7)
    with pytest.raises(ValueError, match="shape"):
        adamw.update(bad, state, params)


def test_parameters_requiring_grad_can_be_donated():
    w = torch.nn.Parameter(torch.randn(4, 6))
    before = w.detach().clone()
    out, _ = adamw.update({"w": torch.randn(4, 6)}, adamw.init({"w": w}), {"w": w}, donate=True)
    assert out["w"] is w and not torch.equal(w.detach(), before)
    pure, _ = adamw.update({"w": torch.randn(4, 6)}, adamw.init({"w": w}), {"w": w})
    assert not pure["w"].requires_grad
