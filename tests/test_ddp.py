"""DDP mode: ``dedicate_params(..., data_parallel="ddp")`` then ``DistributedDataParallel(model)``.

gloo, fp64, 10 steps. One spawned group per world size runs every check (spawning costs seconds):

* training equals the single-process reference (functional Muon with fp64 NS + ``torch.optim.AdamW``
  on the full batch) to <= 1e-10, plain, with DDP's ``no_sync`` and with ``dmuon.no_sync``
  accumulation (2 micro-batches), with ``dmuon.clip_grad_norm_`` (norms equal too);
* DDP skips the dedicated matrices: its ignore list names them, its reducer holds none of them and
  its all-reduce buckets (a counting comm hook) carry exactly the other params' elements;
* replicas are bit-identical (every rank's masters and DDP params, after a drain);
* Newton–Schulz ran only on owners (``last_step_stats()``): every matrix owned by exactly one rank,
  each rank's NS elements are its own matrices';
* zero-copy: in forward each dedicated param is a view of its master (no gathered copy);
* the dedicated reduces + publishes move, per step, the bytes the functional schedules predict;
  a ``no_sync`` micro-batch moves none;
* mismatches raise naming the fix: FSDP-mode dedication then DDP, DDP-mode dedication then
  ``fully_shard``, composable ``replicate``, an unknown ``data_parallel``; torch's own
  ``clip_grad_norm_`` refuses the dedicated params (instead of silently missing their gradients);
* checkpoints move between backends: full dicts (``get_model_state_dict`` /
  ``get_optimizer_state_dict``) and sharded ones (``save_sharded`` / ``load_sharded``) saved at
  step 5 under DDP resume under FSDP2 and the reverse, equal to the uninterrupted run at step 10;
  torch's own ``state_dict()`` of the DDP wrapper (plain full tensors) and of ``dmuon.Muon``
  resume a DDP run the same way;
* ``dmuon.verify_step`` passes on a DDP step;
* ``examples/ddp.py`` trains (loss falls); bf16 params (fp32 masters, cast-copy path) keep
  bit-identical replicas.
"""
from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch

from dist_utils import catch, run_ranks
from models import make_batches, make_model, muon_predicate
from stateful_harness import HP, max_rel_err, reference_run

TOL = 1e-10
STEPS, BATCH, CLIP = 10, 8, 0.5


def _muon(model, **kw):
    import dmuon
    return dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                      weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                      ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"],
                      adamw_betas=HP["adamw_betas"], adamw_eps=HP["adamw_eps"],
                      adamw_weight_decay=HP["adamw_weight_decay"], **kw)


def _build_ddp(world, *, seed=0, counter=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dmuon

    model = make_model(seed=seed)
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), muon_predicate,
                          data_parallel="ddp")
    ddp = DDP(model)
    if counter is not None:
        def count(state, bucket):
            counter.append(bucket.buffer().numel())
            return torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook(
                None, bucket)
        import torch.distributed.algorithms.ddp_comm_hooks.default_hooks  # noqa: F401
        ddp.register_comm_hook(None, count)
    return ddp, _muon(ddp)


def _build_fsdp(world, *, seed=0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = make_model(seed=seed)
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, muon_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _muon(model)


def _lanes(rt):
    return {k: c["sent_bytes"] + c["received_bytes"] for k, c in rt.executor.counters().items()}


def _train(model, opt, rank, world, start, stop, *, accum=1, sync="none", clip=None, probe=None):
    """Steps ``start..stop-1``; ``sync``: "ddp" / "dmuon" no_sync for all but the last
    micro-batch. Returns per-step clip norms and the dedicated bytes of no_sync backwards."""
    import dmuon

    rt = opt.dedicated_state
    norms, quiet = [], []
    for ids in make_batches(STEPS, BATCH)[start:stop]:
        opt.zero_grad()
        for i, mb in enumerate(ids.chunk(world)[rank].chunk(accum)):
            last = i == accum - 1
            ctx = contextlib.nullcontext()
            if not last and sync == "ddp":
                ctx = model.no_sync()
            elif not last and sync == "dmuon":
                ctx = dmuon.no_sync(model)
            before = _lanes(rt)
            with ctx:
                (model(mb) / accum).backward()
            if not last:
                quiet.append(sum(_lanes(rt).values()) - sum(before.values()))
        if probe is not None:
            probe(rt)
        if clip is not None:
            norms.append(float(dmuon.clip_grad_norm_(model, clip)))
        opt.step()
    return norms, quiet


def _replicas(ddp, rt):
    import dmuon
    dmuon.wait_all_replicate_broadcasts(ddp)
    out = {n: m.detach().clone() for n, m in rt.masters.items()}
    out.update({n: p.detach().clone() for n, p in ddp.module.named_parameters()
                if n not in rt.params})
    return out


def _main_run(rank, world):
    """The plain 10-step run with every probe."""
    import dmuon

    counter: list = []
    ddp, opt = _build_ddp(world, counter=counter)
    rt = opt.dedicated_state
    views = []

    def in_forward(module, args):
        for n in rt.group_of:
            if rt.group_of[n] == "layers.0":
                p = rt.params[n]
                views.append(p.numel() == rt.masters[n].numel()
                             and p.data_ptr() == rt.masters[n].data_ptr())
    hook = ddp.module.layers[0].register_forward_pre_hook(in_forward, prepend=False)
    stats, per_step = [], []
    for step in range(STEPS):
        c0, n0 = _lanes(rt), len(counter)
        _train(ddp, opt, rank, world, step, step + 1)
        c1 = _lanes(rt)
        per_step.append(sum(c1.values()) - sum(c0.values()))
        stats.append(opt.last_step_stats())
        assert len(counter) > n0
    hook.remove()
    ddp_elems_per_step = sum(counter) / STEPS
    # torch's own clip must refuse the dedicated params (their gradients live in dmuon)
    ddp(make_batches(1, BATCH)[0].chunk(world)[rank]).backward()
    torch_clip = catch(lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0))
    opt.zero_grad()
    st = stats[-1]
    from dmuon.tools.ddp_traffic import ddp_step_traffic
    from dmuon.functional.specs import specs_from_named_shapes
    specs = specs_from_named_shapes(list(make_model().named_parameters()), muon_predicate)
    predicted = ddp_step_traffic(specs, world, dtype="torch.float64")
    return {
        "predicted": predicted.sent[rank] + predicted.received[rank],
        "predicted_mean_sent": predicted.mean_sent, "ring": predicted.ring,
        "sd": dmuon.get_model_state_dict(ddp, cpu_offload=True),
        "replicas": _replicas(ddp, rt),
        "owned": list(rt.owned_names), "names": list(rt.names),
        "owned_elements": [s.owned_elements for s in stats],
        "owned_matrices": [s.owned_matrices for s in stats],
        "own_numel": sum(rt.masters[n].numel() for n in rt.owned_names),
        "ns_calls": [s.ns_calls for s in stats],
        "ignored": sorted(ddp.parameters_to_ignore),
        "reducer_has_dedicated": any(p in set(rt.params.values()) for p in ddp._module_parameters),
        "ddp_elems_per_step": ddp_elems_per_step,
        "other_numel": sum(p.numel() for n, p in ddp.module.named_parameters()
                           if n not in rt.params),
        "zero_copy": views, "unshard_buffers": sum(len(g.unshard_buffers)
                                                   for g in rt.groups.values()),
        "bytes_per_step": per_step[1:], "lanes_last": st.lanes,
        "torch_clip": torch_clip,
        "P": sum(math.prod(rt.shape[n]) * rt.orig_dtype[n].itemsize for n in rt.names),
    }


def _variants(rank, world):
    import dmuon
    out = {}
    for sync in ("ddp", "dmuon"):
        ddp, opt = _build_ddp(world)
        _, quiet = _train(ddp, opt, rank, world, 0, STEPS, accum=2, sync=sync)
        out[f"accum_{sync}"] = {"sd": dmuon.get_model_state_dict(ddp, cpu_offload=True),
                                "quiet": quiet}
    ddp, opt = _build_ddp(world)
    ddp(make_batches(1, BATCH)[0].chunk(world)[rank]).backward()
    report = dmuon.verify_step(ddp, opt)  # one verified step against single-device math
    out["verify"] = (report.max_error, report.worst, len(report.errors))
    ddp, opt = _build_ddp(world)
    norms, _ = _train(ddp, opt, rank, world, 0, STEPS, clip=CLIP)
    out["clip"] = {"sd": dmuon.get_model_state_dict(ddp, cpu_offload=True), "norms": norms}
    return out


def _errors(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dmuon

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    m = make_model()
    dmuon.dedicate_params(m, mesh, muon_predicate)
    out["fsdp_then_ddp"] = catch(lambda: DDP(m))
    m = make_model()
    dmuon.dedicate_params(m, mesh, muon_predicate, data_parallel="ddp")
    for layer in m.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    out["ddp_then_fully_shard"] = catch(lambda: _muon(m))
    out["ddp_then_fully_shard_forward"] = catch(
        lambda: m(make_batches(1, BATCH)[0].chunk(world)[rank]))
    mesh2d = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    out["ddp_2d_mesh"] = catch(lambda: dmuon.dedicate_params(make_model(), mesh2d, muon_predicate,
                                                             data_parallel="ddp"))
    out["bad_mode"] = catch(lambda: dmuon.dedicate_params(make_model(), mesh, muon_predicate,
                                                          data_parallel="DDP"))
    # DDP-mode dedication but the model never wrapped in DDP: its other params would never be
    # all-reduced (replicas drift apart silently); a training forward must raise instead
    m = make_model()
    dmuon.dedicate_params(m, mesh, muon_predicate, data_parallel="ddp")
    opt = _muon(m)
    out["not_wrapped"] = catch(lambda: _train(m, opt, rank, world, 0, 2))
    with torch.no_grad():  # evaluation of the inner module stays allowed
        out["not_wrapped_eval"] = catch(lambda: m(make_batches(1, BATCH)[0]))
    try:
        from torch.distributed._composable.replicate import replicate
    except ImportError:  # pragma: no cover
        replicate = None
    if replicate is not None:
        m = make_model()
        dmuon.dedicate_params(m, mesh, muon_predicate, data_parallel="ddp")
        replicate(m)
        out["replicate"] = catch(lambda: _muon(m))
    return out


def _checkpoints(rank, world, root):
    """Step-5 checkpoints of one backend resume under the other: full dicts
    (``get_model_state_dict`` / ``get_optimizer_state_dict``) and sharded (``save_sharded`` /
    ``load_sharded``); torch's own ``state_dict()`` / ``load_state_dict()`` of the DDP wrapper
    and of ``dmuon.Muon`` resume a DDP run."""
    import copy
    import os

    import dmuon

    half = STEPS // 2
    saved, final, native = {}, {}, {}
    for kind, build in (("ddp", _build_ddp), ("fsdp", _build_fsdp)):
        model, opt = build(world)
        _train(model, opt, rank, world, 0, half)
        saved[kind] = (dmuon.get_model_state_dict(model, cpu_offload=True),
                       dmuon.get_optimizer_state_dict(model, opt, cpu_offload=True))
        dmuon.save_sharded(os.path.join(root, kind), model, opt)
        if kind == "ddp":
            native = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                      "optim": copy.deepcopy(opt.state_dict())}
        _train(model, opt, rank, world, half, STEPS)
        final[kind] = dmuon.get_model_state_dict(model, cpu_offload=True)
    resumed = {}
    for src, kind, build in (("fsdp", "ddp", _build_ddp), ("ddp", "fsdp", _build_fsdp)):
        for how in ("full", "sharded"):
            model, opt = build(world, seed=7)  # other initial values: the load must replace them
            if how == "full":
                sd, osd = saved[src]
                dmuon.set_model_state_dict(model, sd)
                dmuon.set_optimizer_state_dict(model, opt, osd)
            else:
                dmuon.load_sharded(os.path.join(root, src), model, opt)
            _train(model, opt, rank, world, half, STEPS)
            resumed[f"{src}->{kind}:{how}"] = dmuon.get_model_state_dict(model, cpu_offload=True)
    model, opt = _build_ddp(world, seed=7)
    plain = all(not hasattr(v, "to_local") and v.numel() > 0 for v in native["model"].values())
    model.load_state_dict(native["model"])
    opt.load_state_dict(native["optim"])
    _train(model, opt, rank, world, half, STEPS)
    resumed["ddp->ddp:torch"] = dmuon.get_model_state_dict(model, cpu_offload=True)
    return {"final": final, "resumed": resumed, "native_plain": plain,
            "native_keys": sorted(native["model"])}


def _extras(rank, world):
    """``examples/ddp.py``; bf16 params (fp32 masters: the cast-copy path instead of zero-copy)."""
    import importlib.util
    import sys
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dmuon

    path = Path(__file__).resolve().parents[1] / "examples" / "ddp.py"
    spec = importlib.util.spec_from_file_location("dmuon_example_ddp", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    example = mod.main(steps=12, verbose=False)
    model = make_model(dtype=torch.bfloat16)
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), muon_predicate,
                          data_parallel="ddp")
    ddp = DDP(model)
    opt = dmuon.Muon(ddp, lr=0.02, adamw_lr=3e-3)
    rt = opt.dedicated_state
    first = {n: m.clone() for n, m in rt.masters.items()}
    _train(ddp, opt, rank, world, 0, 3)
    return {"example": example, "bf16": {
        "replicas": _replicas(ddp, rt), "zero_copy": [g.zero_copy for g in rt.groups.values()],
        "master_dtypes": sorted({str(m.dtype) for m in rt.masters.values()}),
        "moved": all(not torch.equal(first[n], rt.masters[n]) for n in first)}}


def _worker(rank, world, parts, root=None):
    fns = {"main": _main_run, "variants": _variants, "errors": _errors, "extras": _extras,
           "checkpoints": lambda rank, world: _checkpoints(rank, world, root)}
    out, secs = {}, {}
    for name in parts:
        t = time.perf_counter()
        out[name] = fns[name](rank, world)
        secs[name] = time.perf_counter() - t
    out["seconds"] = secs
    return out


@pytest.fixture(scope="module")
def reference():
    return reference_run({"steps": STEPS, "batch": BATCH})


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(_worker, 2, ("main", "variants", "errors", "checkpoints", "extras"),
                     str(tmp_path_factory.mktemp("ddp_ckpt")), timeout=180)


@pytest.fixture(scope="module")
def four():
    return run_ranks(_worker, 4, ("main",), timeout=180)


def _check_main(results, reference):
    world = len(results)
    names = results[0]["main"]["names"]
    for rank, res in enumerate(results):
        r = res["main"]
        err, where = max_rel_err(r["sd"], reference["sd"])
        assert err <= TOL, (rank, err, where)
        # replicas bit-identical (masters of every matrix, DDP's params)
        assert all(torch.equal(r["replicas"][k], results[0]["main"]["replicas"][k])
                   for k in r["replicas"]), rank
        # DDP ignores the dedicated matrices
        assert set(names) <= set(r["ignored"])
        assert not r["reducer_has_dedicated"]
        assert r["ddp_elems_per_step"] == r["other_numel"], (r["ddp_elems_per_step"],
                                                             r["other_numel"])
        # NS only on owners: this rank's NS covers its own matrices, every step
        assert r["owned_elements"] == [r["own_numel"]] * STEPS
        assert r["owned_matrices"] == [len(r["owned"])] * STEPS
        assert 0 < len(r["owned"]) < len(names)
        # zero-copy: in every forward the params of layers.0 are their masters
        assert r["zero_copy"] and all(r["zero_copy"]), r["zero_copy"]
        assert r["unshard_buffers"] == 0
        # torch's own clip_grad_norm_ refuses instead of skipping dmuon's gradients
        assert r["torch_clip"][0] is not None, r["torch_clip"]
        # the bytes the functional schedules predict (dmuon.tools.ddp_traffic), every step
        assert r["bytes_per_step"] == [r["predicted"]] * (STEPS - 1), (r["bytes_per_step"],
                                                                      r["predicted"])
    # mean sent per rank = DDP's ring all-reduce of the same matrices (+ presence flags)
    r0 = results[0]["main"]
    assert r0["ring"] <= r0["predicted_mean_sent"] <= r0["ring"] * 1.01
    owned = [n for res in results for n in res["main"]["owned"]]
    assert sorted(owned) == sorted(names)  # each matrix stepped by exactly one rank
    # bytes: reduce (the other ranks send their part) + publish (the owner sends its part):
    # summed over ranks, each matrix of P bytes moves 2 (world - 1) P sent+received per step in
    # each direction; presence flags add a few bytes
    P = results[0]["main"]["P"]
    total = [sum(res["main"]["bytes_per_step"][i] for res in results)
             for i in range(STEPS - 1)]
    assert all(t == total[0] for t in total)
    assert 4 * (world - 1) * P <= total[0] <= 4 * (world - 1) * P * 1.01, (total[0], P)


def test_ddp_two_ranks_equals_reference(two, reference):
    _check_main(two, reference)
    print("seconds per part (rank 0):", two[0]["seconds"])


@pytest.mark.slow
def test_ddp_four_ranks_equals_reference(four, reference):
    _check_main(four, reference)


def test_no_sync_accumulation_and_clip(two, reference):
    clipped = reference_run({"steps": STEPS, "batch": BATCH, "clip": CLIP})
    for rank, res in enumerate(two):
        for sync in ("ddp", "dmuon"):
            v = res["variants"][f"accum_{sync}"]
            err, where = max_rel_err(v["sd"], reference["sd"])
            assert err <= TOL, (sync, rank, err, where)
            assert v["quiet"] == [0] * STEPS, (sync, v["quiet"])  # no dedicated traffic
        max_error, worst, n = res["variants"]["verify"]
        assert n == len(reference["sd"]) and max_error <= 1e-10, (max_error, worst, n)
        c = res["variants"]["clip"]
        err, where = max_rel_err(c["sd"], clipped["sd"])
        assert err <= TOL, (rank, err, where)
        assert all(abs(a - b) <= TOL * b for a, b in zip(c["norms"], clipped["norms"]))
        assert len(c["norms"]) == STEPS


def test_not_wrapped_in_ddp_raises(two):
    for res in two:
        e = res["errors"]
        assert e["not_wrapped"][0] == "RuntimeError" and "DistributedDataParallel" in \
            e["not_wrapped"][1], e["not_wrapped"]
        assert e["not_wrapped_eval"] == (None, None), e["not_wrapped_eval"]


def test_mismatches_raise_naming_the_fix(two):
    for rank, res in enumerate(two):
        e = res["errors"]
        assert e["fsdp_then_ddp"][0] == "RuntimeError" and 'data_parallel="ddp"' in \
            e["fsdp_then_ddp"][1], e["fsdp_then_ddp"]
        for key in ("ddp_then_fully_shard", "ddp_then_fully_shard_forward"):
            assert e[key][0] == "RuntimeError" and 'data_parallel="fsdp"' in e[key][1], e[key]
        assert e["bad_mode"][0] == "ValueError" and "data_parallel" in e["bad_mode"][1]
        assert e["ddp_2d_mesh"][0] == "ValueError" and "1-D mesh" in e["ddp_2d_mesh"][1], \
            e["ddp_2d_mesh"]
        if "replicate" in e:
            assert e["replicate"][0] == "RuntimeError" and "DistributedDataParallel" in \
                e["replicate"][1], e["replicate"]


def test_checkpoints_across_backends(two, reference):
    for rank, res in enumerate(two):
        c = res["checkpoints"]
        for kind in ("ddp", "fsdp"):
            err, where = max_rel_err(c["final"][kind], reference["sd"])
            assert err <= TOL, (kind, err, where)
        assert len(c["resumed"]) == 5
        for key, got in c["resumed"].items():
            err, where = max_rel_err(got, c["final"][key.split("->")[0]])
            assert err <= TOL, (key, rank, err, where)
        # torch's own model.state_dict() of the DDP wrapper: plain full tensors, DDP's keys
        assert c["native_plain"] and all(k.startswith("module.") for k in c["native_keys"])
        assert len(c["native_keys"]) == len(c["final"]["ddp"])


def test_ddp_traffic_equals_ring_allreduce_on_presets():
    """Functional: for real model shapes, dmuon's DDP-mode bytes per rank equal (mean) DDP's ring
    all-reduce of the dedicated matrices, the maximum within a few percent."""
    from dmuon.tools.ddp_traffic import ddp_step_traffic, ring_allreduce_bytes
    from dmuon.tools.presets import preset_specs

    specs = preset_specs("llama-3.2-1b", dtype="torch.float32")
    for world in (2, 4, 8):
        t = ddp_step_traffic(specs, world)
        assert t.ring == ring_allreduce_bytes(t.matrix_bytes, world)
        flags = 16 * 7 * 4  # one fp32 presence element per matrix (16 layers x 7 projections)
        assert abs(t.mean_sent - t.ring) <= flags, (world, t.mean_sent, t.ring)
        assert abs(sum(t.received) / world - t.ring) <= flags
        assert t.max_sent <= 1.02 * t.ring and sum(t.owned_bytes) == t.matrix_bytes


def test_example_and_bf16_params(two):
    for res in two:
        ex = res["extras"]["example"]
        assert ex["losses"][-1] < ex["losses"][0] - 0.2, ex["losses"]
        b = res["extras"]["bf16"]
        assert b["zero_copy"] and not any(b["zero_copy"]) and b["master_dtypes"] == ["torch.float32"]
        assert b["moved"]
        assert all(torch.equal(v, two[0]["extras"]["bf16"]["replicas"][k])
                   for k, v in b["replicas"].items())
