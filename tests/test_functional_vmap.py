"""The fused functional updates under ``torch.vmap`` over an lr sweep, as a researcher writes it:
``muon.update`` / ``adamw.update`` / ``transforms.update_params`` of a chain, vmapped over a
vector of lrs.

With the params (and state) batched -- expanded to ``(n, *shape)`` -- the sweep equals a Python
loop over the lrs. With unbatched params the stages' in-place writes cannot take a batched value;
before (issue 46) torch's in-place vmap error (or "output with shape [8, 4] doesn't match the
broadcast shape [3, 8, 4]") came from inside ``stages/leaves.py`` with no hint; now a
``ValueError`` says to expand the params.
"""
from __future__ import annotations

import optree
import pytest
import torch

from dmuon.functional import adamw, muon
from dmuon.functional import transforms as T

F64 = torch.float64
LRS = torch.tensor([0.01, 0.02, 0.05], dtype=F64)


def _params():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(8, 4, generator=g, dtype=F64),
            "b": torch.randn(6, 6, generator=g, dtype=F64)}


def _grads(step):
    g = torch.Generator().manual_seed(10 + step)
    return {k: torch.randn(v.shape, generator=g, dtype=F64) for k, v in _params().items()}


def _muon_hp(lr):
    return muon.MuonHParams(lr=lr, weight_decay=0.1, ns_dtype=F64)


def _adamw_hp(lr):
    return adamw.AdamWHParams(lr=lr, weight_decay=0.1)


def _chain(lr):
    return muon.transform(_muon_hp(lr))


# name -> (init(params), step(lr, params, state, grads) -> (params, state))
RUNS = {
    "muon.update": (muon.init, lambda lr, p, s, g: muon.update(g, s, p, _muon_hp(lr))),
    "adamw.update": (adamw.init, lambda lr, p, s, g: adamw.update(g, s, p, _adamw_hp(lr))),
    "update_params": (_chain(0.02).init,
                      lambda lr, p, s, g: T.update_params(_chain(lr), g, s, p)),
}


def _expand(tree, n):
    return optree.tree_map(lambda p: p.expand(n, *p.shape).clone(), tree)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_lr_sweep_with_batched_params_equals_a_loop(name):
    init, step = RUNS[name]
    n = len(LRS)
    p0 = _params()
    p, s = _expand(p0, n), _expand(init(p0), n)  # params and state carry the batch dim
    for t in range(3):
        p, s = torch.vmap(step, in_dims=(0, 0, 0, None))(LRS, p, s, _grads(t))
    for i, lr in enumerate(LRS.tolist()):
        q, sq = p0, init(p0)
        for t in range(3):
            q, sq = step(lr, q, sq, _grads(t))
        for k in q:
            err = float((p[k][i] - q[k]).abs().max() / q[k].abs().max())
            assert err < 1e-12, f"{name} lr {lr}: {k} off the loop by {err:.3g}"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_lr_sweep_with_unbatched_params_says_to_expand_them(name):
    init, step = RUNS[name]
    p0 = _params()
    with pytest.raises(ValueError, match=r"(?s)torch\.vmap.*not batched.*expand\(n, \*p\.shape\)"):
        torch.vmap(step, in_dims=(0, None, None, None))(LRS, p0, init(p0), _grads(0))
