"""A ``step()`` that fails part-way (issue 46): an exception raised inside ``dmuon.Muon.step``
after some of its state changed (a simulated OOM in the second momentum chunk, or inside
Newton–Schulz), caught by the user, then ``step()`` (or the whole iteration) again.

Before: the retry was accepted and the state silently diverged from a clean run. Now: the failing
step raises on every rank (the outcome is agreed at the end of every step), the optimizer is marked
broken on every rank where anything changed anywhere, every later ``step()`` raises naming the
failure and the loads that clear the mark, and after a reload training equals a clean run. A
failure before anything changed, on every rank, is retried exactly (no mark).

One spawn of 2 gloo ranks (fp64) runs every case: the failure on rank 0 only and on both ranks,
in the default fp32 storage and in bf16 / offloaded momentum (slow tier; the default tier runs the
fp32 case on rank 0 only in tests/test_stateful_errors.py).
"""
from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from models import make_batches, make_model
from stateful_harness import build_dmuon

STEPS, BATCH = 3, 4
BOUND_S = 5  # the collectives' and the joins' bound: a rank left behind fails the test quickly


class Injected(RuntimeError):
    """The simulated failure (an OOM's type: a ``RuntimeError``)."""


def _arm(opt, where: str, ranks, rank: int):
    """Make the next ``step()`` raise on ``ranks``: ``"ns"`` inside Newton–Schulz (after the
    momentum stage updated every buffer), ``"chunk2"`` in the second momentum chunk's load
    (after the first chunk was stored), ``"chunk1"`` in the first (before anything changed)."""
    from dmuon.stateful.optimizer import state_storage as ss
    if rank not in ranks:
        return lambda: None
    if where in ("ns", "ns-interrupt"):  # the latter: a KeyboardInterrupt (no collective)
        orig = opt._orthogonalizer
        exc = KeyboardInterrupt if where == "ns-interrupt" else Injected

        def boom(*a, **k):
            raise exc("simulated OOM inside Newton-Schulz")
        opt._orthogonalizer = lambda spec, names: boom
        return lambda: setattr(opt, "_orthogonalizer", orig)
    opt._storage.chunk_bytes = 1  # one matrix per chunk
    orig_load = ss.StepIO.load
    at = 1 if where == "chunk1" else 2

    def load(self, names, stored):
        if self._next + 1 == at:
            raise Injected(f"simulated OOM in momentum chunk {at}")
        return orig_load(self, names, stored)
    ss.StepIO.load = load
    return lambda: setattr(ss.StepIO, "load", orig_load)


def _iteration(model, opt, ids, rank):
    opt.zero_grad()
    model(ids.chunk(2)[rank]).backward()
    opt.step()


def _caught(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - an interrupt too
        return type(e).__name__, str(e)
    return None, None


def _case(rank, world, muon_kw, where, ranks):
    """Train STEPS steps; step 1 fails on ``ranks`` and is retried (step, then the iteration);
    then reload the checkpoint taken after step 0 and train on. Returns what each call raised and
    the final full model state."""
    import dmuon
    batches = make_batches(STEPS, BATCH)
    model, opt = _build(rank, world, muon_kw)
    _iteration(model, opt, batches[0], rank)
    ckpt = (dmuon.get_model_state_dict(model), dmuon.get_optimizer_state_dict(model, opt))
    disarm = _arm(opt, where, ranks, rank)
    out = {"failed": _caught(lambda: _iteration(model, opt, batches[1], rank))}
    disarm()
    out["step_again"] = _caught(opt.step)  # the retry (exact where nothing had changed)
    if out["step_again"][0] is not None:  # broken: the iteration again, then reload
        out["iteration_again"] = _caught(lambda: _iteration(model, opt, batches[1], rank))
        dmuon.set_model_state_dict(model, ckpt[0])
        dmuon.set_optimizer_state_dict(model, opt, ckpt[1])
        _iteration(model, opt, batches[1], rank)
    for ids in batches[2:]:
        _iteration(model, opt, ids, rank)
    out["sd"] = dmuon.get_model_state_dict(model)
    return out


def _build(rank, world, muon_kw):
    import datetime
    model = make_model()
    return build_dmuon(rank, world, model, model.layers, {"muon_kw": muon_kw},
                       timeout=datetime.timedelta(seconds=BOUND_S))


def _clean(rank, world, muon_kw):
    import dmuon
    model, opt = _build(rank, world, muon_kw)
    for ids in make_batches(STEPS, BATCH):
        _iteration(model, opt, ids, rank)
    return dmuon.get_model_state_dict(model)


def _worker(rank, world):
    from dmuon.functional import variants
    bf16 = {"transform": variants.muon(momentum_dtype=torch.bfloat16)}
    offload = {"offload_state": True}
    cases = {
        "fp32 ns rank0": ({}, "ns", (0,)),
        "fp32 ns all": ({}, "ns", (0, 1)),
        "fp32 ns-interrupt all": ({}, "ns-interrupt", (0, 1)),  # marked broken with no collective
        "bf16 chunk2 rank0": (bf16, "chunk2", (0,)),
        "offload chunk2 all": (offload, "chunk2", (0, 1)),
        "bf16 chunk1 all": (bf16, "chunk1", (0, 1)),  # nothing changed: retried exactly
        "bf16 chunk1 rank0": (bf16, "chunk1", (0,)),  # rank 1 stepped: broken
    }
    clean = {k: _clean(rank, world, kw) for k, kw in {"fp32": {}, "bf16": bf16,
                                                       "offload": offload}.items()}
    res = {}
    for name, (kw, where, ranks) in cases.items():
        r = _case(rank, world, kw, where, ranks)
        ref = clean[name.split()[0]]
        r["diff"] = max(float((r["sd"][k] - ref[k]).abs().max()) for k in ref)
        del r["sd"]
        res[name] = r
    return res


@pytest.mark.slow  # ~15 s alone: 9 models; the default tier's case is in test_stateful_errors
def test_failed_step_raises_everywhere_then_reload_equals_clean_run():
    got = run_ranks(_worker, 2, env={"DMUON_JOIN_TIMEOUT_S": str(BOUND_S)})
    for name, r in got[0].items():
        exact_retry = name == "bf16 chunk1 all"
        for rank, res in enumerate(got):
            r = res[name]
            assert r["failed"][0] is not None, (name, rank, "the failing step raised here")
            if exact_retry:  # every rank failed before anything changed: the retry is exact
                assert r["failed"][0] == "Injected", (name, rank, r["failed"])
                assert r["step_again"] == (None, None), (name, rank, r["step_again"])
            else:
                assert "reload" in r["step_again"][1] and "failed" in r["step_again"][1], \
                    (name, rank, r["step_again"])
                assert r["iteration_again"][0] == "RuntimeError", (name, rank, r)
            assert r["diff"] == 0.0, (name, rank, r["diff"])
