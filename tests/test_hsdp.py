"""HSDP on a 2-D (replicate, shard) mesh: 4 gloo ranks as (R, G) = (2, 2), fp64.

One spawned group runs every check (spawning costs seconds):

* 10 training steps, the seeds' usage exactly (``init_device_mesh(..., (R, G), mesh_dim_names=
  ("replicate", "shard"))``, ``dedicate_params(model, hsdp["shard"], predicate,
  replicate_mesh=hsdp["replicate"])``, ``fully_shard(layer, mesh=hsdp)``) with the async publish,
  with ``replicate_async=False``, and on a 1-D shard mesh of 4; the parent compares them with a
  single-process reference (functional Muon, fp64 NS; ``torch.optim.AdamW``), with each other
  (async == sync bitwise) and checks that after a drain the replicas of every shard column hold
  bit-identical masters;
* the bytes the executor counted per phase, totals over all ranks: stage-2 reduce and publish move
  ``(R-1) * P`` each per step (``(R-1)/(G*R) * P`` per rank), stage 1 / unshard as in FSDP2;
* the publish life cycle: pending per group after ``step``, consumed by each group's forward
  pre-hook, groups forward did not use drained at the end of backward, ``step`` twice with no
  forward/backward raises (nothing changes) until ``wait_all_replicate_broadcasts``;
* ``examples/hsdp.py``'s ``main`` (a few steps).
"""
from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks
from models import TinyLlama, make_batches, make_model, muon_predicate
from stateful_harness import HP, max_rel_err, reference_run

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-10
STEPS, BATCH, R, G = 10, 8, 2, 2


class SkipLlama(TinyLlama):
    """``TinyLlama`` whose forward skips the layers listed in ``self.skip``."""

    skip: frozenset = frozenset()

    def forward(self, ids):
        import torch.nn.functional as F
        x = self.embed_tokens(ids[:, :-1])
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _setup(rank, world, kind, *, replicate_async=True, model=None, z3=True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = model if model is not None else make_model()
    if kind == "hsdp":  # the seeds' usage, exactly
        hsdp = init_device_mesh("cpu", (R, world // R), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(model, hsdp["shard"], muon_predicate, replicate_mesh=hsdp["replicate"],
                              reshard_after_forward=z3)
        mesh = hsdp
    elif kind == "hsdp2d":  # the 2-D mesh itself passed to dedicate_params
        mesh = init_device_mesh("cpu", (R, world // R), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(model, mesh, muon_predicate, reshard_after_forward=z3)
    else:
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, muon_predicate, reshard_after_forward=z3)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=mesh, reshard_after_forward=z3)
    opt = dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                     weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                     ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"], adamw_betas=HP["adamw_betas"],
                     adamw_eps=HP["adamw_eps"], adamw_weight_decay=HP["adamw_weight_decay"],
                     replicate_async=replicate_async)
    return model, opt


def _lane_sent(rt):
    return {lane: (c["sent_bytes"], c["received_bytes"]) for lane, c in rt.executor.counters().items()}


def _diff(a, b):
    return {k: (a[k][0] - b[k][0], a[k][1] - b[k][1]) for k in a}


def _train(rank, world, kind, replicate_async=True, z3=True, accum=1):
    """10 fp64 steps; per-phase lane bytes; final state dict and drained masters."""
    import contextlib

    import dmuon

    model, opt = _setup(rank, world, kind, replicate_async=replicate_async, z3=z3)
    rt = opt.dedicated_state
    phases = {"backward": [], "step": []}
    pending_after_step, pending_after_forward = [], []
    for ids in make_batches(STEPS, BATCH):
        opt.zero_grad()
        c0 = _lane_sent(rt)
        for i, mb in enumerate(ids.chunk(world)[rank].chunk(accum)):
            with dmuon.no_sync(model) if i < accum - 1 else contextlib.nullcontext():
                loss = model(mb) / accum
                if i == 0:
                    pending_after_forward.append(sorted(rt.pending_publish))
                loss.backward()
        rt.reduced_grads()  # (step() would do it) so that stage 2 is counted in this phase
        c1 = _lane_sent(rt)
        opt.step()
        pending_after_step.append(sorted(rt.pending_publish))
        c2 = _lane_sent(rt)
        phases["backward"].append(_diff(c1, c0))
        phases["step"].append(_diff(c2, c1))
    dmuon.wait_all_replicate_broadcasts(model)
    masters = {n: m.detach().clone() for n, m in rt.masters.items()}
    sd = dmuon.get_model_state_dict(model, cpu_offload=True)
    return {"sd": sd, "masters": masters, "phases": phases, "coord": rt.coord,
            "owned": list(rt.owned_names), "groups": sorted(rt.groups),
            "pending_after_step": pending_after_step, "pending_after_forward": pending_after_forward,
            "n_names": len(rt.names),
            "P": sum(math.prod(rt.shape[n]) * rt.orig_dtype[n].itemsize for n in rt.names),
            # the reduces' presence elements: one per matrix, in its group's reduce dtype
            "F": sum(rt.groups[rt.group_of[n]].reduce_dtype.itemsize for n in rt.names)}


def _lifecycle(rank, world):
    """Publish life cycle with a 3-layer model whose forward can skip a layer."""
    import dmuon

    torch.manual_seed(0)
    model = SkipLlama(n_layers=3).to(torch.float64)
    model, opt = _setup(rank, world, "hsdp", model=model)
    rt = opt.dedicated_state
    batches = make_batches(6, BATCH, seed=3)
    out = {}

    def fwd_bwd(ids, skip=frozenset()):
        model.skip = frozenset(skip)
        loss = model(ids.chunk(world)[rank])
        out.setdefault("after_forward", []).append(sorted(rt.pending_publish))
        loss.backward()
        out.setdefault("after_backward", []).append(sorted(rt.pending_publish))

    fwd_bwd(batches[0])
    opt.step()
    out["after_step"] = sorted(rt.pending_publish)
    opt.zero_grad()  # (without it torch would add the next backward to this step's gradients)
    # forward skips layers.1 and .2: layers.0 prefetches (so consumes) layers.1; the publish of
    # layers.2 stays pending through forward and the end of backward drains it
    fwd_bwd(batches[1], skip={1, 2})
    opt.step()
    opt.zero_grad()
    # a second step with no forward/backward: the same clear error as on a 1-D mesh, on every
    # rank, nothing changes (only owned masters: the others are still being written by the
    # pending publish)
    before = {n: rt.masters[n].clone() for n in rt.owned_names}
    mom_before = {n: b.clone() for n, b in opt.muon_state.momentum.items()}
    steps_before = opt.num_steps
    try:
        opt.step()
        out["double_step_error"] = None
    except RuntimeError as e:
        out["double_step_error"] = str(e)
    out["unchanged"] = (all(torch.equal(before[n], rt.masters[n]) for n in before)
                        and all(torch.equal(mom_before[n], opt.muon_state.momentum[n])
                                for n in mom_before)
                        and opt.num_steps == steps_before and bool(before))
    dmuon.wait_all_replicate_broadcasts(model)
    out["after_drain"] = sorted(rt.pending_publish)
    fwd_bwd(batches[2])
    opt.step()
    # an eval forward (no_grad) consumes every group it runs
    with torch.no_grad():
        model.skip = frozenset()
        model(batches[2].chunk(world)[rank])
    out["after_eval_forward"] = sorted(rt.pending_publish)
    for ids in batches[3:5]:  # the ordinary loop still runs
        opt.zero_grad()
        fwd_bwd(ids)
        opt.step()
    # model.load_state_dict right after a step, its publish pending: the loaded values stay
    # (the publish lands before the load writes them, never over them)
    opt.zero_grad()
    fwd_bwd(batches[4])
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt.step()
    out["pending_before_load"] = sorted(rt.pending_publish)
    model.load_state_dict(saved)
    out["pending_after_load"] = sorted(rt.pending_publish)
    with torch.no_grad():  # consumes every group it runs
        model.skip = frozenset()
        model(batches[4].chunk(world)[rank])
    now = model.state_dict()
    out["load_after_step_kept"] = all(torch.equal(now[k], v) for k, v in saved.items())
    # sync mode: nothing is ever left pending
    opt.replicate_async = False
    opt.zero_grad()
    fwd_bwd(batches[5])
    opt.step()
    out["sync_after_step"] = sorted(rt.pending_publish)
    out["masters"] = {n: m.detach().clone() for n, m in rt.masters.items()}
    out["coord"] = rt.coord
    out["groups"] = sorted(rt.groups)
    return out


def _example(rank, world):
    spec = importlib.util.spec_from_file_location("dmuon_example_hsdp", ROOT / "examples" / "hsdp.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.main(steps=12, verbose=False)


def _worker(rank, world):
    out, secs = {}, {}
    for name, fn in [("hsdp_async", lambda: _train(rank, world, "hsdp")),
                     ("hsdp_sync", lambda: _train(rank, world, "hsdp", replicate_async=False)),
                     ("shard4", lambda: _train(rank, world, "shard")),
                     ("hsdp2d", lambda: _train(rank, world, "hsdp2d")),
                     ("hsdp_z2_accum", lambda: _train(rank, world, "hsdp", z3=False, accum=2)),
                     ("lifecycle", lambda: _lifecycle(rank, world)),
                     ("example", lambda: _example(rank, world))]:
        t = time.perf_counter()
        out[name] = fn()
        secs[name] = time.perf_counter() - t
    out["seconds"] = secs
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, R * G, timeout=120)


@pytest.fixture(scope="module")
def reference():
    return reference_run({"steps": STEPS, "batch": BATCH})


def _columns(results, key):
    """``{s: [masters dict of (s, r) for r in 0..R-1]}``."""
    cols: dict = {}
    for res in results:
        s, r = res[key]["coord"]
        cols.setdefault(s, {})[r] = res[key]["masters"]
    return {s: [by_r[r] for r in sorted(by_r)] for s, by_r in cols.items()}


def test_hsdp_equals_shard4_equals_reference(results, reference):
    errs = {}
    for rank, res in enumerate(results):
        a, c = res["hsdp_async"]["sd"], res["shard4"]["sd"]
        assert set(a) == set(reference["sd"]) == set(c)
        errs[rank] = (max_rel_err(a, reference["sd"]), max_rel_err(c, reference["sd"]),
                      max_rel_err(a, c), max_rel_err(res["hsdp_z2_accum"]["sd"], reference["sd"]))
        # a 2-D mesh given to dedicate_params directly: the same plan and ops, bitwise
        assert all(torch.equal(a[k], res["hsdp2d"]["sd"][k]) for k in a)
        for (err, where) in errs[rank]:
            assert err <= TOL, (rank, err, where)
    # the plan uses all G*R slots, one owner per matrix
    owned = [n for res in results for n in res["hsdp_async"]["owned"]]
    assert len(owned) == len(set(owned)) == results[0]["hsdp_async"]["n_names"]
    assert all(res["hsdp_async"]["owned"] for res in results)
    print("max rel err (hsdp vs ref, shard4 vs ref, hsdp vs shard4, hsdp z2+accum vs ref):",
          {r: [f"{e:.2e}" for e, _ in v] for r, v in errs.items()})


def test_async_equals_sync_bitwise_and_replicas_identical(results):
    for res in results:
        a, b = res["hsdp_async"], res["hsdp_sync"]
        assert all(torch.equal(a["sd"][k], b["sd"][k]) for k in a["sd"])
        assert set(a["masters"]) == set(b["masters"])
        assert all(torch.equal(a["masters"][n], b["masters"][n]) for n in a["masters"])
        # async: every group pending after step, consumed by its forward pre-hook
        assert all(p == a["groups"] for p in a["pending_after_step"])
        assert a["pending_after_forward"][0] == []
        assert all(p == [] for p in a["pending_after_forward"])
        assert all(p == [] for p in b["pending_after_step"])
    for key in ("hsdp_async", "hsdp_sync", "hsdp_z2_accum", "lifecycle"):
        for s, reps in _columns(results, key).items():
            assert len(reps) == R and reps[0], (key, s)
            for other in reps[1:]:
                assert set(other) == set(reps[0])
                assert all(torch.equal(other[n], reps[0][n]) for n in reps[0]), (key, s)


def test_hsdp_accounting(results):
    P = results[0]["hsdp_async"]["P"]
    assert P == results[0]["shard4"]["P"] > 0
    for key in ("hsdp_async", "hsdp_sync"):
        tot = {ph: {lane: [0, 0] for lane in ("unshard", "reduce", "replicate")}
               for ph in ("backward", "step")}
        for res in results:
            for ph, per_step in res[key]["phases"].items():
                for d in per_step:
                    for lane, (sent, recv) in d.items():
                        tot[ph][lane][0] += sent
                        tot[ph][lane][1] += recv
        W = G * R
        F = results[0][key]["F"]  # the reduces also carry one presence element per matrix
        # stage-2 reduce (backward, replicate lane) and publish (step, replicate lane): P
        assert tot["backward"]["replicate"] == [STEPS * (R - 1) * (P + F)] * 2, tot
        assert tot["step"]["replicate"] == [STEPS * (R - 1) * P] * 2, tot
        assert tot["backward"]["replicate"][0] / W / STEPS == (R - 1) / W * (P + F)
        # stage 1 in every replica: (G-1)/G P per rank; Z3 unshards twice: 2 (G-1)/G P per rank
        assert tot["backward"]["reduce"] == [STEPS * R * (G - 1) * (P + F)] * 2, tot
        assert tot["backward"]["unshard"][0] == STEPS * 2 * R * (G - 1) * P, tot
        assert tot["step"]["unshard"] == [0, 0] and tot["step"]["reduce"] == [0, 0], tot
    print(f"P = {P} B; per step totals over ranks: stage-2 {(R - 1) * P} B, publish "
          f"{(R - 1) * P} B, i.e. {(R - 1) / (G * R) * P:.0f} B per rank each")


def test_publish_lifecycle(results):
    for res in results:
        lc = res["lifecycle"]
        groups = lc["groups"]
        assert groups == ["layers.0", "layers.1", "layers.2"]
        assert lc["after_forward"][0] == [] and lc["after_backward"][0] == []
        assert lc["after_step"] == groups
        # skipped layer: pending after forward, drained at the end of backward
        assert lc["after_forward"][1] == ["layers.2"]
        assert lc["after_backward"][1] == []
        msg = lc["double_step_error"]
        assert msg is not None and "no backward pass reached" in msg and "nothing was updated" in msg
        assert lc["unchanged"]
        assert lc["after_drain"] == []
        assert lc["after_eval_forward"] == []
        assert all(p == [] for p in lc["after_backward"])
        assert lc["sync_after_step"] == []


def test_load_state_dict_after_step_keeps_the_loaded_values(results):
    """A user's path beyond the life cycle: ``model.load_state_dict`` right after ``step()``
    (async publish pending) loads exactly what it is given, on every rank: it waits for the
    pending publish first, so none is left to land over the loaded masters (on gloo a broadcast
    lands at once, so the values alone do not show it; NCCL's on its own stream would)."""
    for res in results:
        lc = res["lifecycle"]
        assert lc["pending_before_load"] == lc["groups"]
        assert lc["pending_after_load"] == []
        assert lc["load_after_step_kept"]


def test_example_hsdp_runs(results):
    for res in results:
        ex = res["example"]
        assert ex["n_tensors"] == 15
        assert len(ex["losses"]) == 12 and ex["losses"][-1] < ex["losses"][0]
        assert ex["lanes"]["replicate"]["collectives"] > 0
    print("seconds per part (rank 0):", {k: round(v, 1) for k, v in results[0]["seconds"].items()})
