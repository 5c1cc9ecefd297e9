"""``momentum_dtype`` / ``offload_state`` in the other modes and checkpoint paths (issue 38),
slow tier: HSDP 2x2 equals the rounding reference and offload is bitwise on device there; DDP mode
offload is bitwise on device; ``save_sharded`` / ``load_sharded`` (DCP) and ``dmuon.get_/
set_optimizer_state_dict`` carry the state exactly, into the same or another dtype; a variant
with a non-default storage raises at construction; TP dp 2 x tp 2: bf16 offloaded and fp8 (each
slice with its whole matrix's scale) equal the rounding reference, fp8 checkpoints are exact."""
from __future__ import annotations

import logging
import tempfile

import pytest
import torch

from dist_utils import catch, run_ranks
from models import make_batches, make_model, muon_predicate
from stateful_harness import HP, build_dmuon, distributed_run, max_rel_err, reference_run

FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.slow

HSDP = [dict(id="hsdp_fp32", hsdp=True, batch=8, accum=2),
        dict(id="hsdp_offload", hsdp=True, batch=8, accum=2, muon_kw=dict(offload_state=True)),
        dict(id="hsdp_fp8_offload", hsdp=True, batch=8, momentum_dtype=FP8, z3=False,
             muon_kw=dict(momentum_dtype=FP8, offload_state=True))]


def _hsdp_worker(rank, world):
    torch.set_num_threads(1)
    return {c["id"]: distributed_run(rank, world, c) for c in HSDP}


def test_hsdp_2x2():
    res = run_ranks(_hsdp_worker, 4, timeout=400)
    ref = reference_run(HSDP[2])
    for rank in range(4):
        a, b = res[rank]["hsdp_offload"]["sd"], res[rank]["hsdp_fp32"]["sd"]
        assert all(torch.equal(a[k], b[k]) for k in b), rank
        err, where = max_rel_err(res[rank]["hsdp_fp8_offload"]["sd"], ref["sd"])
        assert err <= 1e-10, (rank, err, where)


def _muon(model, **kw):
    import dmuon
    return dmuon.Muon(model, lr=HP["lr"], ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"], **kw)


def _train(model, opt, rank, world, steps=3):
    for ids in make_batches(steps, 4):
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()


def _worker(rank, world, path):
    torch.set_num_threads(1)
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP
    from dmuon.checkpoint.sharded import checkpoint_momentum
    from dmuon.functional.variants import normuon

    out = {}
    # DDP mode: offload (fp8) bitwise the on-device fp8 run
    sds = {}
    for key, kw in (("dev", dict(momentum_dtype=FP8)),
                    ("off", dict(momentum_dtype=FP8, offload_state=True))):
        model = make_model()
        dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), muon_predicate,
                              data_parallel="ddp")
        ddp = DDP(model)
        opt = _muon(ddp, **kw)
        _train(ddp, opt, rank, world, steps=4)
        sds[key] = dmuon.get_model_state_dict(model)
    out["ddp_offload_bitwise"] = all(torch.equal(sds["dev"][k], sds["off"][k]) for k in sds["dev"])
    # a variant with a non-default storage: built (tests/test_variant_state.py checks its math)
    model = make_model()
    model, _ = build_dmuon(rank, world, model, model.layers, {})
    out["variant"] = catch(lambda: _muon(model, transform=normuon(), momentum_dtype=FP8))
    # sharded (DCP) and dmuon's full format, fp8 + offload
    notes = []
    handler = logging.Handler()
    handler.emit = lambda r: notes.append(r.getMessage())
    logging.getLogger("dmuon.stateful.optimizer.state_storage").addHandler(handler)

    def fresh(**kw):
        m = make_model(seed=3)
        m, o = build_dmuon(rank, world, m, m.layers, dict(muon_kw=kw))
        return m, o

    model, opt = fresh(momentum_dtype=FP8, offload_state=True)
    _train(model, opt, rank, world)
    mom = checkpoint_momentum(opt)
    dmuon.save_sharded(path, model, opt)
    full = dmuon.get_optimizer_state_dict(model, opt)
    for key, kw in (("same", dict(momentum_dtype=FP8, offload_state=True)), ("fp32", {})):
        notes.clear()
        m2, o2 = fresh(**kw)
        _train(m2, o2, rank, world, steps=1)  # live state to be replaced
        dmuon.load_sharded(path, m2, o2)
        got = checkpoint_momentum(o2)
        out[f"sharded_{key}"] = all(torch.equal(mom[n].double(), got[n].double()) for n in mom)
        out[f"sharded_{key}_notes"] = len(notes)
        notes.clear()
        m3, o3 = fresh(**kw)
        dmuon.set_optimizer_state_dict(m3, o3, full)
        got = checkpoint_momentum(o3)
        out[f"full_{key}"] = all(torch.equal(mom[n].double(), got[n].double()) for n in mom)
        out[f"full_{key}_notes"] = len(notes)
    # resumed from the sharded checkpoint, training continues exactly as the original
    m4, o4 = fresh(momentum_dtype=FP8, offload_state=True)
    dmuon.load_sharded(path, m4, o4)
    _train(model, opt, rank, world, steps=2)
    _train(m4, o4, rank, world, steps=2)
    a, b = dmuon.get_model_state_dict(model), dmuon.get_model_state_dict(m4)
    out["resume_bitwise"] = all(torch.equal(a[k], b[k]) for k in a)
    return out


def test_ddp_sharded_full_variant(tmp_path):
    res = run_ranks(_worker, 2, str(tmp_path / "ckpt"), timeout=400)
    for rank in range(2):
        r = res[rank]
        assert r["ddp_offload_bitwise"], r
        assert r["variant"] == (None, None), r["variant"]
        assert r["sharded_same"] and r["full_same"], r
        assert r["sharded_fp32"] and r["full_fp32"], r
        assert r["sharded_same_notes"] == 0 and r["full_same_notes"] == 0, r
        assert r["full_fp32_notes"] == 1 and r["sharded_fp32_notes"] == 1, r
        assert r["resume_bitwise"], r


def test_tp_bf16_offload():
    """TP (dp 2 x tp 2): bf16 momentum, offloaded, == the rounding reference (bf16 rounds per
    element, so TP slices round as the whole matrix)."""
    from test_tensor_parallel import _check, _reference, _train as tp_train
    cfg = {"z3": True, "momentum_dtype": torch.bfloat16,
           "muon_kw": dict(momentum_dtype=torch.bfloat16, offload_state=True)}
    ref = _reference(cfg)
    _check(run_ranks(tp_train, 4, cfg, timeout=300), ref, 4)


def _tp_fp8_worker(rank, world, cfgs):
    from test_tensor_parallel import _train as tp_train
    return [tp_train(rank, world, c) for c in cfgs]


def test_tp_fp8():
    """TP (dp 2 x tp 2): fp8 momentum, on the device (Z3) and offloaded (Z2), == the one-process
    Muon that round-trips its whole momentum through fp8 after each update (each TP slice encodes
    with its whole matrix's scale)."""
    from test_tensor_parallel import _check, _reference
    cfgs = [{"z3": True, "momentum_dtype": FP8, "muon_kw": dict(momentum_dtype=FP8)},
            {"z3": False, "momentum_dtype": FP8,
             "muon_kw": dict(momentum_dtype=FP8, offload_state=True)}]
    ref = _reference(cfgs[0])
    res = run_ranks(_tp_fp8_worker, 4, cfgs, timeout=400)
    for k in range(2):
        _check([r[k] for r in res], ref, 4)


def _tp_ckpt_worker(rank, world):
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import dmuon
    from dmuon.functional import state_dtype as sd
    from dmuon.functional.memory_model import rank_memory
    from dmuon.stateful.modes.tensor_parallel import local_part
    from dmuon.checkpoint.sharded import checkpoint_momentum
    from dmuon.stateful.optimizer.state_storage import state_nbytes
    from test_tensor_parallel import apply_tp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]

    def fresh(**kw):
        model = make_model(seed=3)
        apply_tp(model, mesh["tp"])
        dmuon.dedicate_params(model, dp, muon_predicate)
        for layer in model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
        return model, _muon(model, **kw)

    def train(model, opt, steps):
        for ids in make_batches(steps, 4):
            opt.zero_grad()
            model(ids.chunk(2)[mesh.get_coordinate()[0]]).backward()
            opt.step()

    out = {}
    model, opt = fresh(momentum_dtype=FP8)
    train(model, opt, 3)
    rt = opt.dedicated_state
    full = dmuon.get_optimizer_state_dict(model, opt)
    ded = {n: e["momentum_buffer"] for n, e in full["dedicated"].items()}
    tp_names = [n for n in rt.owned_names if n in rt.tp_layouts]
    # each slice's scale is its matrix's: equal over the TP group (compared in the parent); the
    # step took it from the unrounded momentum, whose rounding may halve the absmax's binade
    whole = {n: sd.scale_from_absmax(sd.absmax(ded[n].double()), FP8) for n in tp_names}
    out["scales"] = {n: float(opt._storage.scales[n]) for n in tp_names}
    out["scales_whole"] = bool(tp_names) and all(
        float(opt._storage.scales[n]) in (float(whole[n]), 2 * float(whole[n])) for n in tp_names)
    m = rank_memory(rt.program, rt.coord, momentum_dtype=FP8)
    out["memory_model"] = (m.state, state_nbytes(opt)["device"])
    mom = checkpoint_momentum(opt)
    # a save -> load round trip into fp8 + TP: bitwise, the same scales
    m2, o2 = fresh(momentum_dtype=FP8)
    train(m2, o2, 1)
    dmuon.set_optimizer_state_dict(m2, o2, full)
    got = checkpoint_momentum(o2)
    out["same_bitwise"] = all(torch.equal(mom[n], got[n]) for n in mom)
    # a load takes each scale from the loaded whole matrix (the MAX over the TP group)
    out["same_scales"] = all(torch.equal(o2._storage.scales[n], whole[n]) for n in tp_names)
    dmuon.set_model_state_dict(m2, dmuon.get_model_state_dict(model))
    train(model, opt, 2)
    train(m2, o2, 2)
    a, b = dmuon.get_model_state_dict(model), dmuon.get_model_state_dict(m2)
    out["resume_bitwise"] = all(torch.equal(a[k], b[k]) for k in a)
    # an fp32 checkpoint into fp8 + TP: rounded with each whole matrix's scale
    m3, o3 = fresh()
    train(m3, o3, 3)
    full32 = dmuon.get_optimizer_state_dict(m3, o3)
    m4, o4 = fresh(momentum_dtype=FP8)
    dmuon.set_optimizer_state_dict(m4, o4, full32)
    got = checkpoint_momentum(o4)
    want = {n: local_part(rt, n, sd.round_trip(e["momentum_buffer"], FP8))
            for n, e in full32["dedicated"].items() if n in got}
    out["fp32_rounded"] = bool(got) and all(
        torch.equal(got[n].double(), want[n].double()) for n in got)
    dist.barrier()
    return out


def test_tp_fp8_checkpoints():
    """fp8 + TP (dp 2 x tp 2): each slice's stored scale is its whole matrix's; the memory model
    counts one scale per slice held; dmuon's full optimizer state dict round-trips bitwise (and
    training resumes bitwise); an fp32 checkpoint loads rounded with the whole matrices' scales."""
    res = run_ranks(_tp_ckpt_worker, 4, timeout=400)
    for rank, r in enumerate(res):
        assert r["scales_whole"], (rank, r)
        assert r["scales"] == res[rank ^ 1]["scales"], rank  # ranks 2d, 2d+1: one TP group
        assert r["memory_model"][0] == r["memory_model"][1], (rank, r)
        assert r["same_bitwise"] and r["same_scales"] and r["resume_bitwise"], (rank, r)
        assert r["fp32_rounded"], (rank, r)
