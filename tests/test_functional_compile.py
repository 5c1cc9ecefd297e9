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
    chain_of = lambda lr: muon.transform(_muon(lr))  # noqa: E731 (a new chain per lr)
    return {
        "muon.update": (muon.init, lambda p, s, g, lr: muon.update(g, s, p, _muon(lr))),
        "adamw.update": (adamw.init, lambda p, s, g, lr: adamw.update(g, s, p, _adamw(lr))),
        "chain": (lambda p: chain_of(0.02).init(p),
                  lambda p, s, g, lr: T.update_params(chain_of(lr), g, s, p)),
    }


@pytest.mark.slow  # ~35 s of tracing on 2 cores; the default tier runs the two tests below
@pytest.mark.parametrize("name,n_leaves", [("muon.update", 1), ("muon.update", 2),
                                           ("adamw.update", 2), ("chain", 2)])
def test_changing_float_lr_is_right_on_every_step_past_the_recompile_limit(dynamo_limit, name,
                                                                           n_leaves):
    init, step = _runs()[name]
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter)
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
    # no graph break: the first call's graph, then one with the lr a symbol (dynamo's automatic
    # dynamic float) that serves every later value
    assert counter.frame_count <= 2, f"{name}: {counter.frame_count} graphs for {STEPS} lrs"


def _breaking_orthogonalizer(xs):
    """A user's ``orthogonalize=`` hook that breaks the graph (a print, a ``.item()``, ...)."""
    torch._dynamo.graph_break()
    return [x / x.norm(dim=(-2, -1), keepdim=True) for x in xs]


def test_leaves_built_while_tracing_cross_a_graph_break(dynamo_limit):
    """``muon.update`` builds its ``Leaves`` in the traced frame; a graph break inside the chain
    makes dynamo run ``run_inplace`` eagerly on that object. Before, it raised ``ValueError:
    length mismatch: [2, 1]`` from ``Leaves.close`` on the first call (the stand-in spec's dict
    metadata); the same object reached the eager fallback past the recompile limit."""
    p0 = _params(1)

    def step(p, s, g, lr):
        return muon.update(g, s, p, _muon(lr), orthogonalize=_breaking_orthogonalizer)

    compiled = torch.compile(step, backend=CompileCounter())
    p, s, q, sq = dict(p0), muon.init(p0), dict(p0), muon.init(p0)
    for t in range(2):
        g, lr = _grads(p0, t), torch.tensor(_lr(t), dtype=F64)  # a tensor: no recompile
        p, s = compiled(p, s, g, lr)
        q, sq = step(q, sq, g, lr)
        for a, b in ((p["w0"], q["w0"]), (s.momentum["w0"], sq.momentum["w0"])):
            assert float((a - b).abs().max() / b.abs().max()) < 1e-12, t


def _sched(t):
    return 0.02 * (1 - t / 10)


@pytest.mark.parametrize("how", [
    "muon tensor lr",  # the slow tier traces the others (~5 s each on 2 cores)
    pytest.param("muon schedule", marks=pytest.mark.slow),
    pytest.param("adamw tensor lr", marks=pytest.mark.slow)])
def test_tensor_or_scheduled_lr_compiles_to_one_graph(dynamo_limit, how):
    p0 = _params(2)
    if how.startswith("muon"):
        init = muon.init
        hp = _muon(_sched) if how == "muon schedule" else None
        step = lambda p, s, g, lr: muon.update(g, s, p, hp or _muon(lr))  # noqa: E731
    else:
        init = adamw.init
        step = lambda p, s, g, lr: adamw.update(g, s, p, _adamw(lr))  # noqa: E731
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    p, s, q, sq = dict(p0), init(p0), dict(p0), init(p0)
    for t in range(STEPS):
        g, lr = _grads(p0, t), torch.tensor(_lr(t), dtype=F64)
        p, s = compiled(p, s, g, lr)
        q, sq = step(q, sq, g, lr)
        for k in q:
            assert float((p[k] - q[k]).abs().max() / q[k].abs().max()) < 1e-12, (how, t, k)
    assert counter.frame_count == 1, f"{how}: {counter.frame_count} graphs for {STEPS} steps"
