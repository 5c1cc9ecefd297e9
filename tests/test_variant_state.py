"""A variant's state options (issue 38): ``dmuon.Muon(..., transform=variants.normuon(),
momentum_dtype=..., offload_state=...)`` on 2 gloo ranks, fp64 masters, one spawn:

* bf16 and fp8 momentum equal (<= 1e-10) the one-process chain that rounds its momentum the same
  way after each update (``state_dtype.round_trip``; weights and the variant's state by name);
* ``offload_state=True`` (fp32) is bitwise the on-device run;
* the momentum is stored in its dtype (on the host when offloaded); ``opt.state`` gives its value;
  ``Muon.state_dict()`` and ``dmuon.get/set_optimizer_state_dict`` restore it bitwise into fresh
  optimizers with the same options, which then train bitwise as the original; into another
  ``momentum_dtype`` it is converted (rounded as a step would) with one logged note;
* a chain without a momentum stage has nothing these options apply to: it raises on every rank;
* DDP mode (``data_parallel="ddp"``) with fp8 offloaded equals the same rounding reference and
  resumes bitwise through both state dicts.

Slow tier: NorMuon with fp8 offloaded on HSDP 2x2 and bf16 offloaded on TP dp2 x tp2 (column and
row slices), each against the rounding reference and resumed bitwise through the state dicts.
"""
from __future__ import annotations

import copy

import pytest
import torch

import variant_worker as vw
from dist_utils import run_ranks
from stateful_harness import max_rel_err

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
STEPS = 3
CASES = {"fp32": {}, "offload": dict(offload_state=True), "bf16": dict(momentum_dtype=BF16),
         "fp8_offload": dict(momentum_dtype=FP8, offload_state=True)}
ROUND_TRIPS = ("fp8_offload",)  # (bf16 offloaded: the slow tier's TP run, full format)


def _case(rank: int, world: int, key: str, kw: dict) -> dict:
    import dmuon
    from dmuon.stateful.optimizer.state_storage import state_nbytes

    batches = vw.make_batches(STEPS + 2, vw.BATCH)
    model, opt, i, n = vw.build("normuon", "fsdp", world, **kw)
    vw.train(model, opt, batches[:STEPS], i, n)
    r: dict = {"sd": dmuon.get_model_state_dict(model, cpu_offload=True)}
    full = dmuon.get_optimizer_state_dict(model, opt, cpu_offload=True)
    r["opt"] = {"dedicated": full["dedicated"], "scalars": full.get("variant_scalars")}
    stored = opt._owner.field_values("momentum_buffer")
    r["stored"] = sorted({(str(t.dtype), t.device.type) for t in stored.values()})
    r["nbytes"] = (state_nbytes(opt), sum(t.nbytes for t in stored.values()))
    params = opt.dedicated_state.params
    r["view_equal"] = all(
        torch.equal(opt.state[params[m]]["momentum_buffer"].double().cpu(),
                    full["dedicated"][m]["momentum_buffer"].double()) for m in stored)
    r["ckpt_dtypes"] = sorted({str(e["momentum_buffer"].dtype)
                               for e in full["dedicated"].values()})
    if key == "bf16":  # into an fp8 variant: rounded as a step would round it, one note
        import logging
        from dmuon.functional.state_dtype import round_trip
        notes: list = []
        handler = logging.Handler()
        handler.emit = lambda rec: notes.append(rec.getMessage())
        log = logging.getLogger("dmuon.stateful.optimizer.state_storage")
        log.addHandler(handler)
        m3, o3, _, _ = vw.build("normuon", "fsdp", world, seed=5, momentum_dtype=FP8)
        dmuon.set_optimizer_state_dict(m3, o3, full)
        m4, o4, _, _ = vw.build("normuon", "fsdp", world, seed=5)  # the default storage: a note
        dmuon.set_optimizer_state_dict(m4, o4, full)
        log.removeHandler(handler)
        got = dmuon.get_optimizer_state_dict(m3, o3, cpu_offload=True)["dedicated"]
        r["to_fp8"] = (all(torch.equal(got[m]["momentum_buffer"].double(), round_trip(
            e["momentum_buffer"].double(), FP8)) for m, e in full["dedicated"].items()),
            [x for x in notes if "converted on load" in x])
    if key in ROUND_TRIPS:
        msd = dmuon.get_model_state_dict(model)
        tsd = copy.deepcopy(opt.state_dict())
        vw.train(model, opt, batches[STEPS:], i, n)
        r["after"] = dmuon.get_model_state_dict(model, cpu_offload=True)
        for how in ("torch", "full"):
            m2, o2, _, _ = vw.build("normuon", "fsdp", world, seed=5, **kw)
            dmuon.set_model_state_dict(m2, msd)
            if how == "torch":
                o2.load_state_dict(tsd)
            else:
                dmuon.set_optimizer_state_dict(m2, o2, full)
            got = dmuon.get_optimizer_state_dict(m2, o2, cpu_offload=True)["dedicated"]
            r[f"restored_{how}"] = all(torch.equal(got[m][k], v) for m, e in
                                       full["dedicated"].items() for k, v in e.items())
            vw.train(m2, o2, batches[STEPS:], i, n)
            r[f"resumed_{how}"] = dmuon.get_model_state_dict(m2, cpu_offload=True)
    return r


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    from dist_utils import catch
    from dmuon.functional import transforms as T
    from dmuon.newton_schulz import NSConfig

    out: dict = {}
    for key, kw in CASES.items():
        try:
            out[key] = _case(rank, world, key, kw)
        except Exception as e:  # noqa: BLE001 (the parent reports it)
            out[key] = repr(e)

    try:  # DDP mode: the owners' offloaded fp8 field, resumed through both state dicts
        out["ddp"] = vw.run_variant(rank, world, "normuon", "ddp", STEPS, checkpoint=True,
                                    momentum_dtype=FP8, offload_state=True)
    except Exception as e:  # noqa: BLE001
        out["ddp"] = repr(e)

    def no_momentum(hp):  # NS of the raw gradient: no momentum buffers to store
        return T.chain(T.orthogonalize(NSConfig.from_hparams(hp)), T.scale_by_shape(hp.lr_scale),
                       T.decoupled_apply(hp.lr, hp.weight_decay))
    out["no_momentum"] = catch(lambda: vw.build("normuon", "fsdp", world, transform=no_momentum,
                                                momentum_dtype=BF16))
    torch.distributed.barrier()
    return out


def test_variant_state_options():
    res = run_ranks(_worker, 2, timeout=300)
    for key in CASES:
        for rank in range(2):
            assert isinstance(res[rank][key], dict), (key, rank, res[rank][key])
    # bf16 / fp8: the one-process chain rounding its momentum the same way after each update
    for key, dt in (("bf16", BF16), ("fp8_offload", FP8)):
        vw.check([r[key] for r in res], "normuon", STEPS, momentum_dtype=dt)
    # DDP mode (replicated model, owner-only NS, update broadcast), fp8 offloaded: the same
    # reference, and training resumed through either state dict is bitwise the uninterrupted run
    assert all(isinstance(r["ddp"], dict) for r in res), [r["ddp"] for r in res]
    vw.check([r["ddp"] for r in res], "normuon", STEPS, momentum_dtype=FP8)
    for r in res:
        for how in ("torch", "full"):
            assert max_rel_err(r["ddp"][f"resumed_{how}"], r["ddp"]["after"])[0] == 0.0, how
    # (fp32 on device == the plain chain: tests/test_variants_distributed.py)
    for rank in range(2):
        r = res[rank]
        # offloaded: bitwise the on-device run (weights and the gathered state)
        for a, b in (("offload", "fp32"),):
            assert max_rel_err(r[a]["sd"], r[b]["sd"])[0] == 0.0, (a, b, rank)
            for m, e in r[b]["opt"]["dedicated"].items():
                for k, v in e.items():
                    assert torch.equal(r[a]["opt"]["dedicated"][m][k], v), (a, m, k)
        owns = bool(r["fp32"]["stored"])
        if owns:
            assert r["fp32"]["stored"] == [("torch.float64", "cpu")]
            assert r["offload"]["stored"] == [("torch.float64", "cpu")]
            assert r["bf16"]["stored"] == [("torch.bfloat16", "cpu")]
            assert r["fp8_offload"]["stored"] == [("torch.float8_e4m3fn", "cpu")]
        # the state's bytes: the momentum in its dtype, on the host when offloaded
        for key in CASES:
            nb, data = r[key]["nbytes"]
            where = "host" if "offload" in key else "device"
            assert nb[where] >= data and (nb[where] == data or key.startswith("fp8")), (key, nb)
        # opt.state: the momentum's value; checkpoints: bf16 for bf16 / fp8, fp64 otherwise
        for key in CASES:
            assert r[key]["view_equal"], (key, rank)
        assert r["bf16"]["ckpt_dtypes"] == r["fp8_offload"]["ckpt_dtypes"] == ["torch.bfloat16"]
        assert r["offload"]["ckpt_dtypes"] == ["torch.float64"]
        # save -> load: the state bitwise, and training continues bitwise
        for key in ROUND_TRIPS:
            for how in ("torch", "full"):
                assert r[key][f"restored_{how}"], (key, how, rank)
                assert max_rel_err(r[key][f"resumed_{how}"], r[key]["after"])[0] == 0.0, (
                    key, how, rank)
        rounded, notes = r["bf16"]["to_fp8"]
        assert rounded and len(notes) == 2, r["bf16"]["to_fp8"]  # into fp8, into fp32
        kind, msg = r["no_momentum"]
        assert kind == "ValueError" and "momentum" in msg and "transform=" in msg, r["no_momentum"]


@pytest.mark.slow
@pytest.mark.parametrize("mode,dtype", [("hsdp", FP8), ("tp", BF16)])
def test_variant_state_options_hsdp_tp(mode, dtype):
    res = run_ranks(vw.run_variant, 4, "normuon", mode, 3, True, momentum_dtype=dtype,
                    offload_state=True, timeout=400)
    vw.check(res, "normuon", 3, momentum_dtype=dtype)
    for r in res:
        for how in ("torch", "full"):
            if f"resumed_{how}" in r:
                assert max_rel_err(r[f"resumed_{how}"], r["after"])[0] == 0.0, (mode, how)
