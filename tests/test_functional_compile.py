"""The functional core under ``torch.compile``, as a researcher compiles it: ``muon.update``,
``adamw.update`` and a chain (``transforms.update_params``) called every step with a Python float
lr that changes (a hand-written decay), and with a 0-d tensor lr or a schedule.

Before (issue 46): a changing float lr recompiled every step (a range check on the float broke
the graph, a float alpha was a dict key); once dynamo's recompile limit was reached, the eager
fallback raised ``ValueError: length mismatch: [2, 1]`` (one param; ``unhashable type: 'list'``
with two) from ``Leaves.close``: a ``Leaves`` built in a compiled frame crossed the graph break
holding dynamo's stand-in for optree's ``PyTreeSpec``, whose dict metadata the real optree
unflatten does not read.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from dmuon.functional import adamw, muon
from dmuon.functional import transforms as T

F64 = torch.float64
STEPS = 6


@pytest.fixture
def dynamo_limit():
    """A fresh dynamo with ``recompile_limit = 2`` (restored afterwards)."""
    old = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 2
    yield
    torch._dynamo.config.recompile_limit = old
    torch._dynamo.reset()


def _params(n_leaves=1):
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (6, 6)][:n_leaves]
    return {f"w{i}": torch.randn(*s, generator=g, dtype=F64) for i, s in enumerate(shapes)}


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=g, dtype=F64) for k, v in params.items()}


def _lr(step):
    return 0.02 * (1 - step / 10)  # a float that changes every step


def _muon(lr):
    return muon.MuonHParams(lr=lr, weight_decay=0.1, ns_dtype=F64)


def _adamw(lr):
    return adamw.AdamWHParams(lr=lr, weight_decay=0.1)


def _runs():
    """name -> (init(params), step(params, state, grads, lr) -> (params, state))."""
    chain_of = lambda lr: muon.transform(_muon(lr))  # noqa: E731 (a new chain per lr, as a user does)
    return {
        "muon.update": (muon.init, lambda p, s, g, lr: muon.update(g, s, p, _muon(lr))),
        "adamw.update": (adamw.init, lambda p, s, g, lr: adamw.update(g, s, p, _adamw(lr))),
        "chain": (lambda p: chain_of(0.02).init(p),
                  lambda p, s, g, lr: T.update_params(chain_of(lr), g, s, p)),
    }


_BROKEN = pytest.mark.xfail(strict=True, reason="issue 46: the eager fallback after dynamo's "
                            "recompile limit raises 'length mismatch' from Leaves.close")


@pytest.mark.parametrize("name,n_leaves", [
    pytest.param("muon.update", 1, marks=_BROKEN), pytest.param("muon.update", 2, marks=_BROKEN),
    ("adamw.update", 2), ("chain", 2)])
def test_changing_float_lr_is_right_on_every_step_past_the_recompile_limit(dynamo_limit, name,
                                                                           n_leaves):
    init, step = _runs()[name]
    compiled = torch.compile(step, backend=CompileCounter())
    p0 = _params(n_leaves)
    p, s = dict(p0), init(p0)
    q, sq = dict(p0), init(p0)
    for t in range(STEPS):
        g = _grads(p0, t)
        p, s = compiled(p, s, g, _lr(t))
        q, sq = step(q, sq, g, _lr(t))
        for k in q:  # traced scalars round their own way (AdamW's bias correction in tensors)
            err = float((p[k] - q[k]).abs().max() / q[k].abs().max())
            assert err < 1e-12, f"{name} step {t}: {k} off eager by {err:.3g}"
