"""Owner NS overlapped with the backward (``Muon.set_ns_overlap("on")``) on gloo, 2 ranks, fp64:
bitwise the same params, Muon / variant state and AdamW state as without it after 3 steps, in Z3,
Z2 and HSDP (2 replicas of 1), with plain steps, gradient accumulation over 2 backwards, clipping
between backward and step, an lr changed between backward and step, zero_grad then a new
backward, accumulation under ``dmuon.no_sync`` (one reduce: committed), a variant chain (NorMuon),
and an older optimizer state loaded between backward and step; the speculation is committed where valid and discarded
otherwise (the optimizer's overlap counters). One spawn (slow tier)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from dist_utils import run_ranks
from models import make_batches, make_model
from stateful_harness import build_dmuon

pytestmark = pytest.mark.slow

SCENARIOS = ("plain", "accum", "no_sync", "clip", "lr", "zero", "variant", "load")
MODES = (dict(id="z3", z3=True), dict(id="z2", z3=False), dict(id="hsdp", hsdp=True))


def _leaves(tree):
    import optree
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _snapshot(model, opt):
    from dmuon.stateful.runtime.state import local_tensor
    rt = opt.dedicated_state
    out = [m.clone() for m in rt.owned_masters().values()]
    out += [local_tensor(p).detach().clone() for _, p in opt.adamw_named_params]
    out += [t.clone() for t in _leaves(opt._owner.state)]
    out += [t.clone() for t in _leaves(opt.adamw_state)]
    return out


def _train(rank, world, mode, scenario, overlap):
    import dmuon
    from dmuon.functional import variants
    cfg = dict(mode)
    if scenario == "variant":
        cfg["muon_kw"] = dict(transform=variants.normuon())
    model = make_model(dtype=torch.float64)
    model, opt = build_dmuon(rank, world, model, model.layers, cfg)
    opt.set_ns_overlap(overlap)
    batches = make_batches(3, 4)
    saved = None
    for step, ids in enumerate(batches):
        local = ids.chunk(world)[rank]
        opt.zero_grad()
        if scenario == "zero":  # a batch dropped after its backward: the speculation discarded
            model(local).backward()
            opt.zero_grad()
        micro = local.chunk(2) if scenario in ("accum", "no_sync") else [local]
        for i, mb in enumerate(micro):  # accum: two synced backwards, each reduces
            sync = scenario != "no_sync" or i == len(micro) - 1  # no_sync: one reduce, valid
            with contextlib.nullcontext() if sync else dmuon.no_sync(model):
                (model(mb) / len(micro)).backward()
        if scenario == "clip":
            dmuon.clip_grad_norm_(model, 0.05)
        if scenario == "lr":
            opt.param_groups[0]["lr"] = 0.01 * (step + 1)
        if scenario == "load" and step == 2:  # an older state loaded between backward and step
            opt.load_state_dict(saved)
        opt.step()
        if scenario == "load" and step == 0:
            saved = opt.state_dict()
    return _snapshot(model, opt), dict(opt.ns_overlap_stats)


def _worker(rank, world):
    out = {}
    for mode in MODES:
        for scenario in SCENARIOS:
            off, _ = _train(rank, world, mode, scenario, "off")
            on, stats = _train(rank, world, mode, scenario, "on")
            same = len(off) == len(on) and all(torch.equal(a, b) for a, b in zip(off, on))
            out[(mode["id"], scenario)] = (same, stats)
    # a mode whose owner update is not speculated: not applied, decided when set, reason shown
    model = make_model(dtype=torch.float64)
    model, opt = build_dmuon(rank, world, model, model.layers, dict(muon_kw=dict(
        offload_state=True)))
    opt.set_ns_overlap("on")
    out["offload"] = (True, dict(opt.ns_overlap_stats))
    return out


def test_ns_overlap_bitwise_gloo():
    results = run_ranks(_worker, 2, timeout=240)
    for rank, res in enumerate(results):
        stats = res.pop("offload")[1]
        assert stats["mode"] == "off" and "offload" in stats["reason"], stats
    for key in results[0]:
        for rank, res in enumerate(results):
            assert res[key][0], (rank, key, res[key][1])  # bitwise equal to overlap off
        committed = sum(res[key][1]["committed"] for res in results)
        discarded = sum(res[key][1]["discarded"] for res in results)
        scenario = key[1]
        if scenario in ("plain", "no_sync", "variant", "zero"):  # zero: the 2nd backward's
            assert committed > 0, (key, [r[key][1] for r in results])
        if scenario in ("plain", "no_sync", "variant"):
            assert discarded == 0, (key, [r[key][1] for r in results])
        if scenario in ("accum", "clip", "lr", "zero", "load"):
            assert discarded > 0, (key, [r[key][1] for r in results])
