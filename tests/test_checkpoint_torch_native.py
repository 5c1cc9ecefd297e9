"""torch's own state dicts and DCP on a dmuon model round-trip every dedicated matrix exactly.

Before: ``model.state_dict()``, torch's ``get_model_state_dict`` (full or sharded) and a plain
``dcp.save({"model": model.state_dict()})`` held zero-size placeholders for every dedicated matrix
on every rank (the owner too); a DCP round trip left 14 of 26 tensors at their fresh init,
silently; ``model.load_state_dict(plain_dict)`` failed with torch's "mixed torch.Tensor and
DTensor". Now: each dedicated entry is a ``Shard(0)`` DTensor on the shard mesh, like FSDP2's own;
loads accept those or plain full tensors, validated on every rank before anything changes.
"""
from __future__ import annotations

import logging

import pytest
import torch
from dist_utils import catch, run_ranks
from models import make_batches, make_model
from stateful_harness import build_dmuon

BATCH = 4


def _trained(rank, world, cfg, steps=2, seed=0):
    model = make_model(seed=seed)
    model, opt = build_dmuon(rank, world, model, model.layers, cfg)
    for ids in make_batches(steps, BATCH):
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()
    return model, opt


def _equal(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _full(sd):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in sd.items()}


def _native(rank, world, cfg, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.tensor import DTensor

    import dmuon

    out = {}
    model, opt = _trained(rank, world, cfg)
    truth = dmuon.get_model_state_dict(model)            # dmuon's own full dict
    sd = model.state_dict()
    out["types"] = {k: type(v).__name__ for k, v in sd.items()}
    out["state_dict"] = _equal(_full(sd), truth)
    out["keep_vars"] = _equal(_full(model.state_dict(keep_vars=True)), truth)
    out["torch_sharded"] = _equal(_full(get_model_state_dict(model)), truth)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["torch_full"] = _equal(_full(full), truth)
    out["dtensors"] = all(isinstance(v, DTensor) for k, v in sd.items() if "proj" in k)
    # DCP round trip into a fresh model (other init): plain dcp.save of model.state_dict()
    dcp.save({"model": model.state_dict()}, checkpoint_id=f"{tmp}/dcp")
    fresh, _ = _trained(rank, world, cfg, steps=0, seed=7)
    target = {"model": fresh.state_dict()}
    dcp.load(target, checkpoint_id=f"{tmp}/dcp")
    fresh.load_state_dict(target["model"])
    out["dcp_roundtrip"] = _equal(dmuon.get_model_state_dict(fresh), truth)
    # torch's set_model_state_dict, sharded then full (from rank 0 only)
    fresh2, _ = _trained(rank, world, cfg, steps=0, seed=8)
    set_model_state_dict(fresh2, get_model_state_dict(model))
    out["torch_set_sharded"] = _equal(dmuon.get_model_state_dict(fresh2), truth)
    fresh3, _ = _trained(rank, world, cfg, steps=0, seed=9)
    full_cpu = {k: v.cpu() for k, v in full.items()} if rank == 0 else {}
    set_model_state_dict(fresh3, full_cpu, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    out["torch_set_full_rank0"] = _equal(dmuon.get_model_state_dict(fresh3), truth)
    # a plain single-device dict on every rank: model.load_state_dict works (before: mixed error)
    fresh4, opt4 = _trained(rank, world, cfg, steps=0, seed=10)
    fresh4.load_state_dict({k: v.clone() for k, v in truth.items()})
    out["plain_load"] = _equal(dmuon.get_model_state_dict(fresh4), truth)
    # the next forward runs on the loaded weights (gathered copies refreshed)
    ids = make_batches(3, BATCH)[2].chunk(world)[rank]
    with torch.no_grad():
        out["train_on"] = bool(torch.equal(fresh4(ids), model(ids)))
    # bad dicts raise on every rank and change nothing
    before = dmuon.get_model_state_dict(fresh4)
    bad_key = "layers.0.self_attn.q_proj.weight"
    for name, mutate in (("nan", lambda t: t.fill_(float("nan"))),
                         ("int", lambda t: t.to(torch.int64)),
                         ("shape", lambda t: t[:-1])):
        bad = {k: v.clone() for k, v in truth.items()}
        bad[bad_key] = mutate(bad[bad_key].clone())
        bad["norm.weight"] = bad["norm.weight"] * 2  # a good entry that must not load either
        out[f"bad_{name}"] = catch(lambda: fresh4.load_state_dict(bad))
    out["bad_unchanged"] = _equal(dmuon.get_model_state_dict(fresh4), before)
    return out


@pytest.mark.parametrize("world,cfg", [(2, {}), pytest.param(4, {"hsdp": True},
                                                               marks=pytest.mark.slow)])
def test_torch_native_model_state_dicts(tmp_path, world, cfg):
    res = run_ranks(_native, world, cfg, str(tmp_path), timeout=120)
    for rank, r in enumerate(res):
        for key in ("state_dict", "keep_vars", "torch_sharded", "torch_full", "dtensors",
                    "dcp_roundtrip", "torch_set_sharded", "torch_set_full_rank0", "plain_load",
                    "train_on", "bad_unchanged"):
            assert r[key] is True, (rank, key)
        for name, needle in (("nan", "non-finite"), ("int", "int64"), ("shape", "shape")):
            kind, msg = r[f"bad_{name}"]
            assert kind == "StateDictError" and needle in msg, (rank, name, kind, msg)


# ---------------------------------------------------------------------------------- optimizer
STEPS_A, STEPS_B = 2, 2


def _continue(model, opt, world, rank, start):
    for ids in make_batches(STEPS_A + STEPS_B, BATCH)[start:]:
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()


def flat_keys(flat):
    return {k.split(".", 1)[1].rsplit(".", 1)[0] for k in flat if k.startswith("state.")}


def _save_side(rank, world, cfg, tmp):
    """Train STEPS_A steps, save with torch's tools (model.state_dict + opt.state_dict through DCP,
    torch's get_optimizer_state_dict full and flattened, dmuon's full dict as HF Trainer would
    store it), train on: the final state is what every resume must reach."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    import dmuon

    model, opt = _trained(rank, world, cfg, steps=0)
    # before any step: torch's getter must not run its zero-gradient "materializing" step
    get_optimizer_state_dict(model, opt)
    for ids in make_batches(STEPS_A, BATCH):
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
             checkpoint_id=f"{tmp}/native")
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(
        flatten_optimizer_state_dict=True))
    dcp.save({"optim": flat}, checkpoint_id=f"{tmp}/flat")
    msd = dmuon.get_model_state_dict(model, cpu_offload=True)
    osd = dmuon.get_optimizer_state_dict(model, opt, cpu_offload=True, rank0_only=True)
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, f"{tmp}/hf_style.pt")
    assert set(full["state"]) == set(flat_keys(flat)), "full and flattened name the same params"
    _continue(model, opt, world, rank, STEPS_A)
    return dmuon.get_model_state_dict(model, cpu_offload=True)


def _load_side(rank, world, cfg, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    import dmuon

    out = {}
    # 1. DCP of model.state_dict() + opt.state_dict(), into another topology
    model, opt = _trained(rank, world, cfg, steps=0, seed=3)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=f"{tmp}/native")
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    _continue(model, opt, world, rank, STEPS_A)
    out["native"] = dmuon.get_model_state_dict(model, cpu_offload=True)
    # 2. torch's flattened optimizer state dict through DCP + set_optimizer_state_dict
    model, opt = _trained(rank, world, cfg, steps=0, seed=4)
    blob = torch.load(f"{tmp}/hf_style.pt", weights_only=False)
    dmuon.set_model_state_dict(model, blob["model"])
    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(
        flatten_optimizer_state_dict=True))
    dcp.load({"optim": flat}, checkpoint_id=f"{tmp}/flat")
    set_optimizer_state_dict(model, opt, flat, options=StateDictOptions(
        flatten_optimizer_state_dict=True))
    _continue(model, opt, world, rank, STEPS_A)
    out["flat"] = dmuon.get_model_state_dict(model, cpu_offload=True)
    # 3. HF Trainer style: optimizer.load_state_dict(torch.load(...)) on every rank
    model, opt = _trained(rank, world, cfg, steps=0, seed=5)
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optim"])
    _continue(model, opt, world, rank, STEPS_A)
    out["hf_style"] = dmuon.get_model_state_dict(model, cpu_offload=True)
    # 4. a bad optimizer dict raises on every rank, nothing changes
    before = opt.state_dict()
    bad = {k: v for k, v in blob["optim"].items()}
    bad["dedicated"] = {n: dict(e) for n, e in bad["dedicated"].items()}
    name = next(iter(bad["dedicated"]))
    bad["dedicated"][name]["momentum_buffer"] = bad["dedicated"][name]["momentum_buffer"] * float("nan")
    out["bad"] = catch(lambda: opt.load_state_dict(bad))
    after = opt.state_dict()
    out["bad_unchanged"] = all(
        torch.equal(_full({"x": a})["x"], _full({"x": b})["x"])
        for i in before["state"] for a, b in ((before["state"][i][k], after["state"][i][k])
                                               for k in before["state"][i]))
    return out


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_optimizer_state_dicts_resume_on_another_topology(tmp_path):
    """4 ranks HSDP 2x2 save, 2 ranks 1-D load; each resume equals the uninterrupted run."""
    want = run_ranks(_save_side, 4, {"hsdp": True}, str(tmp_path), timeout=150)[0]
    res = run_ranks(_load_side, 2, {}, str(tmp_path), timeout=150)
    from stateful_harness import max_rel_err
    for rank, r in enumerate(res):
        for key in ("native", "flat", "hf_style"):
            err, where = max_rel_err(r[key], want)
            assert err <= 1e-12, (rank, key, err, where)
        kind, msg = r["bad"]
        assert kind == "StateDictError" and "non-finite" in msg, (kind, msg)
        assert "strict=False" not in msg, msg  # an optimizer's load takes no strict
        assert r["bad_unchanged"]


# ---------------------------------------------------------------------------------- one owner
def _one_matrix(name, p):
    return name == "layers.0.self_attn.q_proj.weight"


def _one_owner(rank, world, tmp):
    """torch's DCP route (``get_optimizer_state_dict`` / ``dcp.save`` / ``dcp.load`` /
    ``set_optimizer_state_dict``) on a model whose one dedicated matrix leaves a rank owning
    nothing; then one more step, against the uninterrupted run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    import dmuon
    from dmuon.stateful.checkpoint.optimizer_state_dict import muon_step

    cfg = {"predicate": _one_matrix}
    model, opt = _trained(rank, world, cfg)
    owned = len(opt.dedicated_state.owned_names)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=f"{tmp}/one_owner")
    fresh, fopt = _trained(rank, world, cfg, steps=0, seed=7)
    sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fopt)}
    dcp.load(sd, checkpoint_id=f"{tmp}/one_owner")
    set_model_state_dict(fresh, sd["model"])
    load = catch(lambda: set_optimizer_state_dict(fresh, fopt, sd["optim"]))
    steps = (muon_step(fopt), muon_step(opt))
    same = False
    if load == (None, None):
        for m, o in ((model, opt), (fresh, fopt)):
            o.zero_grad()
            model_ids = make_batches(3, BATCH)[2].chunk(world)[rank]
            m(model_ids).backward()
            o.step()
        same = _equal(dmuon.get_model_state_dict(fresh), dmuon.get_model_state_dict(model))
    return {"owned": owned, "load": load, "same": same, "steps": steps}


def test_torch_dcp_route_resumes_when_a_rank_owns_no_matrix(tmp_path):
    res = run_ranks(_one_owner, 2, str(tmp_path), timeout=120)
    assert sorted(r["owned"] for r in res) == [0, 1], res
    for rank, r in enumerate(res):
        assert r["load"] == (None, None), (rank, r["load"])
        assert r["steps"] == (2, 2), (rank, r)  # the loaded count of Muon steps, every rank
        assert r["same"] is True, (rank, r)


# ---------------------------------------------------------------------------------- dcp.load alone
def _written_not_loaded(rank, world, cfg, tmp):
    """A user's resume that calls ``dcp.load`` into ``model.state_dict()`` and
    ``opt.state_dict()`` but leaves out the ``load_state_dict`` calls (enough on plain FSDP2 with a
    torch optimizer: its entries are views of the live tensors)."""
    import torch.distributed.checkpoint as dcp

    import dmuon

    out = {}
    model, opt = _trained(rank, world, cfg)
    with torch.inference_mode():  # (a review: "Inference tensors do not track version counter";
        out["inference"] = catch(opt.state_dict)  # model.state_dict() fails there in plain FSDP2)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{tmp}/ck")
    twin, topt = _trained(rank, world, cfg, steps=0, seed=7)  # resumed as documented
    tsd = {"model": twin.state_dict(), "optim": topt.state_dict()}
    dcp.load(tsd, checkpoint_id=f"{tmp}/ck")
    twin.load_state_dict(tsd["model"])
    topt.load_state_dict(tsd["optim"])
    twin_at_ck = dmuon.get_model_state_dict(twin)
    batches = make_batches(6, BATCH)
    kept = {"model": model.state_dict(), "optim": opt.state_dict()}  # held, never written
    _continue(model, opt, world, rank, STEPS_A)  # the run goes on (no false alarm from `kept`)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=f"{tmp}/ck")  # rolls back ... only FSDP2's params and moments
    ids = batches[4].chunk(world)[rank]
    with torch.no_grad():
        out["eval"] = catch(lambda: model(ids))
    model.load_state_dict(sd["model"])
    with torch.no_grad():
        out["eval_after"] = bool(torch.equal(model(ids), twin(ids)))
    opt.zero_grad()
    model(ids).backward()
    out["step"] = catch(opt.step)
    opt.load_state_dict(sd["optim"])
    for m, o in ((model, opt), (twin, topt)):
        for b in batches[4:]:
            o.zero_grad()
            m(b.chunk(world)[rank]).backward()
            o.step()
    out["same"] = _equal(dmuon.get_model_state_dict(model), dmuon.get_model_state_dict(twin))
    del kept
    # the one line plain FSDP2 users write (the dict a temporary, gone when dcp.load returns),
    # and a written dict deleted after the error: the model is half-loaded, still refused
    dcp.load({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{tmp}/ck")
    with torch.no_grad():
        out["inline"] = catch(lambda: model(ids))
        out["inline_again"] = catch(lambda: model(ids))
    # exports of the half-loaded model (a conversion script runs no forward): dmuon's refuse on
    # every rank, torch's model.state_dict() (also a load's target) warns. Before (a review,
    # session 16): they exported FSDP2's loaded params beside the old matrices, silently
    out["export_full"] = catch(lambda: dmuon.get_model_state_dict(model))
    out["export_optim"] = catch(lambda: dmuon.get_optimizer_state_dict(model, opt))
    out["export_sharded"] = catch(lambda: dmuon.save_sharded(f"{tmp}/mixed", model, opt))
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("dmuon").addHandler(handler)
    model.state_dict()
    logging.getLogger("dmuon").removeHandler(handler)
    out["warned"] = any("written in place but never loaded" in m for m in seen)
    # a partial load through dmuon's own route takes over its key only (before, a review of
    # session 16: every key, and the forward ran with 13 matrices still old)
    one = next(k for k in twin_at_ck if "proj" in k)
    dmuon.set_model_state_dict(model, {one: twin_at_ck[one]}, strict=False)
    with torch.no_grad():
        out["partial"] = catch(lambda: model(ids))
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=f"{tmp}/ck")
    model.load_state_dict(sd["model"])  # the model loaded, the optimizer's dict deleted
    del sd
    opt.zero_grad()
    model(ids).backward()
    out["inline_step"] = catch(opt.step)
    sd = {"optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=f"{tmp}/ck")
    opt.load_state_dict(sd["optim"])
    model.load_state_dict(twin_at_ck)
    opt.zero_grad()
    model(ids).backward()
    out["after"] = catch(opt.step)
    # a write into a DTensor entry itself (sd[k].copy_(v)): it bumps the DTensor's own version
    # counter, not its local tensor's. Before (a review, session 16): neither loaded nor seen
    sd = model.state_dict()
    key = next(k for k, v in sd.items() if "proj" in k)
    sd[key].copy_(sd[key] * 2)
    with torch.no_grad():
        out["dtensor_write"] = catch(lambda: model(ids))
        model.load_state_dict(sd)
        out["dtensor_loaded"] = catch(lambda: model(ids))
    return out


@pytest.mark.parametrize("world,cfg", [(2, {}), pytest.param(4, {"hsdp": True},
                                                               marks=pytest.mark.slow)])
def test_dcp_load_without_load_state_dict_raises_then_resumes_exactly(tmp_path, world, cfg):
    """Before (measured): the forward ran on the old dedicated matrices (FSDP2's params rolled
    back, dmuon's not) and the step on the old momentum and counts, silently: 2 steps later all
    21 tensors differed from the resumed twin's, by up to 4.2e-2. Now the forward raises (the
    model's copies), then the step (the optimizer's), on every rank; after both loads the run
    equals the twin bitwise. A dict held across steps and never written raises nothing."""
    res = run_ranks(_written_not_loaded, world, cfg, str(tmp_path), timeout=120)
    for rank, r in enumerate(res):
        kind, msg = r["eval"]
        assert kind == "RuntimeError" and "model.load_state_dict(sd)" in msg, (rank, r["eval"])
        assert "written in place but never loaded" in msg, (rank, msg)
        assert r["eval_after"] is True, rank
        kind, msg = r["step"]
        assert kind == "RuntimeError" and "optimizer.load_state_dict(sd)" in msg, (rank, r["step"])
        assert "momentum_buffer" in msg, (rank, msg)
        assert r["same"] is True, rank
        for key in ("inline", "inline_again"):  # (before: no error, the dict was gone)
            kind, msg = r[key]
            assert kind == "RuntimeError" and "model.load_state_dict(sd)" in msg, (rank, key, msg)
        kind, msg = r["inline_step"]
        assert kind == "RuntimeError" and "optimizer.load_state_dict(sd)" in msg, (rank, msg)
        assert r["after"] == (None, None), (rank, r["after"])
        for key in ("export_full", "export_optim", "export_sharded", "dtensor_write", "partial"):
            kind, msg = r[key]
            assert kind == "RuntimeError" and "written in place but never loaded" in msg, (
                rank, key, kind, msg)
        assert r["warned"] is True and r["dtensor_loaded"] == (None, None), rank
        assert r["inference"] == (None, None), (rank, r["inference"])
