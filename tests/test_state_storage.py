"""Owner-local Muon state: ``dmuon.Muon(momentum_dtype=..., offload_state=...)`` (issue 38).

* :mod:`dmuon.functional.state_dtype` (pure): bf16 / fp8 encoding exactness.
* gloo, 2 ranks (one spawn, many checks): bf16 and fp8 momentum equal (<= 1e-10, fp64 masters)
  the one-process reference that rounds its momentum the same way after each update, and stay
  within a stated tolerance of fp32; ``offload_state=True`` is bitwise the on-device run (also
  with ``no_sync`` accumulation); checkpoints (torch protocol) carry the state exactly in its
  checkpoint dtype, round-trip bitwise, and load into another ``momentum_dtype`` with one note.
"""
from __future__ import annotations

import logging

import pytest
import torch

from dist_utils import run_ranks
from stateful_harness import distributed_run, max_rel_err, reference_run

from dmuon.functional import state_dtype as sd

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn

CONFIGS = [
    dict(id="fp32", accum=2),
    dict(id="offload", accum=2, muon_kw=dict(offload_state=True)),
    dict(id="bf16", momentum_dtype=BF16, muon_kw=dict(momentum_dtype=BF16)),
    dict(id="fp8", momentum_dtype=FP8, accum=2, muon_kw=dict(momentum_dtype=FP8)),
    dict(id="fp8_offload", momentum_dtype=FP8, accum=2,
         muon_kw=dict(momentum_dtype=FP8, offload_state=True)),
    dict(id="adamw_bf16", adamw_state_dtype=BF16, muon_kw=dict(adamw_state_dtype=BF16)),
]


def test_encode_decode_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g, dtype=torch.float64) * 1e-3
    # fp32 of an fp32 tensor: the identity (the default path is bitwise the historical one)
    x32 = x.float()
    assert sd.encode(x32, torch.float32).data is x32
    # bf16: round to nearest, decoded exactly
    assert torch.equal(sd.round_trip(x, BF16), x.to(BF16).double())
    # fp8: power-of-two scale, decoded value exact in bf16, re-encoding it changes nothing
    st = sd.encode(x, FP8)
    k = torch.log2(st.scale)
    assert st.data.dtype == FP8 and torch.equal(k, k.round())
    y = sd.decode(st, torch.float64)
    assert torch.equal(sd.decode(st, BF16).double(), y)
    assert torch.equal(sd.round_trip(y, FP8), y)
    assert float((y - x).norm() / x.norm()) < 0.04  # 3-bit mantissa: ~2.6% measured
    assert float(y.abs().max()) <= float(torch.finfo(FP8).max * st.scale)
    assert sd.state_nbytes(100, FP8, matrices=2) == 108
    assert sd.state_nbytes(100, BF16) == 200 and sd.state_nbytes(100, None) == 400
    assert sd.check_state_dtype("bf16") is BF16 and sd.check_state_dtype("fp8") is FP8
    with pytest.raises(ValueError, match="momentum_dtype must be one of"):
        sd.check_state_dtype(torch.float16)


def _ckpt_checks(rank, world):
    """Checkpoint round trips through the torch protocol (``Muon.state_dict``)."""
    from models import make_batches, make_model
    from stateful_harness import build_dmuon
    from dmuon.checkpoint.sharded import checkpoint_momentum
    from dmuon.stateful.optimizer.state_storage import state_nbytes

    def train(kw, steps=3, opt_sd=None):
        model = make_model()
        model, opt = build_dmuon(rank, world, model, model.layers, dict(muon_kw=kw))
        if opt_sd is not None:
            opt.load_state_dict(opt_sd)
        for ids in make_batches(steps, 4):
            opt.zero_grad()
            model(ids.chunk(world)[rank]).backward()
            opt.step()
        return model, opt

    out = {}
    notes = []
    handler = logging.Handler()
    handler.emit = lambda r: notes.append(r.getMessage())
    logging.getLogger("dmuon.stateful.optimizer.state_storage").addHandler(handler)
    for key, kw in [("fp8", dict(momentum_dtype=FP8)), ("bf16", dict(momentum_dtype=BF16)),
                    ("offload", dict(offload_state=True)),
                    ("fp8_offload", dict(momentum_dtype=FP8, offload_state=True))]:
        model, opt = train(kw)
        if key == "offload":  # the copies back wait (on CPU all of them) for the next forward's
            # first hook group, which starts them (offload_copies.py): before it the host buffers
            # are stale, after it they hold the stepped momentum
            copies = opt._storage.copies
            waiting = [(h, d.clone()) for hs, ds, _, _ in copies._pending for h, d in zip(hs, ds)]
            out["offload_stale_before_forward"] = (
                len(waiting), sum(not torch.equal(h, d) for h, d in waiting))
            with torch.no_grad():
                model(make_batches(1, 4)[0].chunk(world)[rank])
            out["offload_after_forward"] = (len(copies._pending),
                                            all(torch.equal(h, d) for h, d in waiting))
            # every matrix in the root hook group (no block boundary): the root's forward is the
            # first hook group's; and a newer optimizer starts what the superseded one deferred
            m1 = make_model()
            m1, o1 = build_dmuon(rank, world, m1, m1.layers, dict(muon_kw=kw),
                                 hook_boundary_predicate=lambda m: False)
            ids = make_batches(1, 4)[0].chunk(world)[rank]
            o1.zero_grad()
            m1(ids).backward()
            o1.step()
            before = len(o1._storage.copies._pending)
            with torch.no_grad():
                m1(ids)
            out["offload_root_only"] = (before, len(o1._storage.copies._pending))
            o1.zero_grad()
            m1(ids).backward()
            o1.step()
            before = len(o1._storage.copies._pending)
            import dmuon
            dmuon.Muon(m1, offload_state=True)
            out["offload_superseded"] = (before, len(o1._storage.copies._pending))
            # a tensor read from opt.state before a step holds the value before it: a write
            # through it after the step (before the copy back) is refused, not lost
            m5 = make_model()
            m5, o5 = build_dmuon(rank, world, m5, m5.layers, dict(muon_kw=kw))
            held = None
            for k in range(2):
                o5.zero_grad()
                m5(ids).backward()
                o5.step()
                if k == 0:
                    params = o5.dedicated_state.params
                    held = [o5.state[params[n]]["momentum_buffer"] for n in o5.muon_state.momentum]
            held[0].mul_(0.5)
            try:
                with torch.no_grad():
                    m5(ids)
                out["offload_held_write"] = "accepted"
            except RuntimeError as e:
                out["offload_held_write"] = str(e)
        if key == "fp8":  # opt.state's decoded copies exist only while someone reads it (they
            # were built at construction and held for the whole training: a bf16 momentum's bytes)
            import gc
            gc.collect()
            out["fp8_decoded_bytes"] = sum(
                o.untyped_storage().nbytes() for o in gc.get_objects()
                if type(o) is torch.Tensor and o.dtype == BF16 and o.is_inference())
        stored = opt.muon_state.momentum
        want = FP8 if key.startswith("fp8") else BF16 if key == "bf16" else torch.float64
        out[f"{key}_stored_dtypes"] = sorted({str(t.dtype) for t in stored.values()}) == [str(want)]
        out[f"{key}_stored_device"] = sorted({t.device.type for t in stored.values()})
        nb = state_nbytes(opt)
        numel = sum(t.numel() for t in stored.values())
        out[f"{key}_nbytes"] = (nb, sd.state_nbytes(numel, want if key != "offload" else None,
                                                    matrices=len(stored), working=torch.float64))
        try:  # the memory model's number for this rank (dmuon.functional.memory_model)
            from dmuon.functional.memory_model import rank_memory
            rt = opt.dedicated_state
            m = rank_memory(rt.program, rt.coord, momentum_dtype=kw.get("momentum_dtype"),
                            offload_state=kw.get("offload_state", False))
            out[f"{key}_model"] = {"device": m.state, "host": m.host_state}
        except Exception as e:  # noqa: BLE001 (reported to the parent)
            out[f"{key}_model"] = repr(e)
        # offload: every step copied each owned momentum in (prefetch) and back (commit)
        copies = opt._storage.copies
        out[f"{key}_copies"] = (copies.copies_in, copies.copies_out, 3 * len(stored))
        mom = checkpoint_momentum(opt)
        # what a user (or torch's tools) reads from opt.state is the momentum's value (fp8:
        # its data alone is the value divided by the matrix's scale)
        params = opt.dedicated_state.params
        out[f"{key}_state_view_equal"] = all(
            torch.equal(opt.state[params[n]]["momentum_buffer"].to(mom[n]), mom[n]) for n in mom)
        if key == "fp8" and mom:  # a write into that copy could not reach the fp8 state: raises
            try:
                opt.state[params[next(iter(mom))]]["momentum_buffer"].zero_()
                out["fp8_view_write"] = "silently accepted"
            except RuntimeError as e:
                out["fp8_view_write"] = str(e)
            opt.refresh_state_views()
        osd = opt.state_dict()
        ckpt_dtypes = {str(e["momentum_buffer"].dtype) for e in osd["state"].values()
                       if "momentum_buffer" in e}
        out[f"{key}_ckpt_dtypes"] = sorted(ckpt_dtypes)
        out[f"{key}_group_dtype"] = osd["param_groups"][0]["momentum_dtype"]
        # same options: the stored state comes back bitwise
        notes.clear()
        _, opt2 = train(kw, steps=0, opt_sd=osd)
        mom2 = checkpoint_momentum(opt2)
        out[f"{key}_same_roundtrip"] = all(torch.equal(mom[n], mom2[n]) for n in mom)
        out[f"{key}_same_notes"] = len(notes)
        if key == "fp8":
            out["fp8_scales_equal"] = all(torch.equal(opt._storage.scales[n],
                                                      opt2._storage.scales[n]) for n in mom)
            # a load leaves no decoded copy of the momentum in the loaded optimizer's views
            out["fp8_decoded_bytes_after_load"] = sum(
                v.untyped_storage().nbytes() for e in opt2._state_views.values()
                for v in e.values() if isinstance(v, torch.Tensor) and v.is_inference())
        # into fp32 (default): exact values, one note
        notes.clear()
        _, opt3 = train({}, steps=0, opt_sd=osd)
        mom3 = checkpoint_momentum(opt3)
        out[f"{key}_to_fp32_exact"] = all(torch.equal(mom[n].double(), mom3[n]) for n in mom)
        out[f"{key}_to_fp32_notes"] = list(notes)
    try:  # AdamW's moments in bf16: held, checkpointed and restored in bf16
        model, opt = train(dict(adamw_state_dtype=BF16))
        osd = opt.state_dict()
        out["adamw_moment_dtypes"] = sorted({str(e["exp_avg"].dtype) for e in osd["state"].values()
                                             if "exp_avg" in e} | {str(t.dtype) for t in
                                                                   opt.adamw_state.nu.values()})
        _, opt2 = train(dict(adamw_state_dtype=BF16), steps=0, opt_sd=osd)
        out["adamw_roundtrip"] = all(torch.equal(opt.adamw_state.mu[n], opt2.adamw_state.mu[n])
                                     and torch.equal(opt.adamw_state.nu[n], opt2.adamw_state.nu[n])
                                     for n in opt.adamw_state.mu)
    except Exception as e:  # noqa: BLE001 (reported to the parent)
        out["adamw_moment_dtypes"] = out["adamw_roundtrip"] = repr(e)
    # an fp32 checkpoint into fp8: converted (rounded as a step would round it), one note
    _, opt = train({})
    osd = opt.state_dict()
    mom = checkpoint_momentum(opt)
    notes.clear()
    _, opt4 = train(dict(momentum_dtype=FP8), steps=0, opt_sd=osd)
    mom4 = checkpoint_momentum(opt4)
    out["fp32_to_fp8_rounded"] = all(torch.equal(mom4[n].double(), sd.round_trip(mom[n], FP8))
                                     for n in mom)
    out["fp32_to_fp8_notes"] = list(notes)
    return out


def _worker(rank, world, cfgs):
    torch.set_num_threads(1)
    out = {}
    for c in cfgs:
        try:
            out[c["id"]] = distributed_run(rank, world, c)
        except Exception as e:  # noqa: BLE001 (the test of that config reports it)
            out[c["id"]] = repr(e)
    out["ckpt"] = _ckpt_checks(rank, world)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 2, CONFIGS, timeout=300)


def test_momentum_dtype_equals_rounding_reference(results):
    """bf16 / fp8 momentum on 2 gloo ranks == the one-process Muon that rounds the same way."""
    for cfg in [c for c in CONFIGS if c.get("momentum_dtype") is not None]:
        ref = reference_run(cfg)
        for rank in range(2):
            err, where = max_rel_err(results[rank][cfg["id"]]["sd"], ref["sd"])
            assert err <= 1e-10, (cfg["id"], rank, err, where)
    # and within a stated tolerance of fp32 momentum after 10 steps (fp8: 3-bit mantissa)
    fp32 = reference_run(dict(id="fp32"))
    for cid, tol in (("bf16", 2e-2), ("fp8", 2e-1)):
        err, where = max_rel_err(results[0][cid]["sd"], fp32["sd"])
        print(f"{cid} vs fp32 momentum after 10 steps: max rel err {err:.3g} at {where}")
        assert 0 < err <= tol, (cid, err)


def test_offload_copies_back_start_at_the_next_forward(results):
    for rank, r in enumerate(res["ckpt"] for res in results):
        assert isinstance(r, dict), r
        waiting, stale = r["offload_stale_before_forward"]
        assert waiting == r["offload_copies"][2] // 3 > 0, (rank, waiting)  # each owned matrix
        assert stale == waiting, (rank, stale, waiting)  # not copied yet
        assert r["offload_after_forward"] == (0, True), (rank, r["offload_after_forward"])
        owns = waiting > 0
        assert r["offload_root_only"][1] == 0 and (r["offload_root_only"][0] > 0 or not owns), r
        assert r["offload_superseded"][1] == 0 and (r["offload_superseded"][0] > 0 or not owns), r
        assert "written after step()" in r["offload_held_write"], r["offload_held_write"]


def test_offload_bitwise_on_device(results):
    """offload_state=True (fp32, no_sync accumulation) is bitwise the on-device run; fp8 offload
    is bitwise fp8 on device."""
    for rank in range(2):
        for a, b in (("offload", "fp32"), ("fp8_offload", "fp8")):
            x, y = results[rank][a]["sd"], results[rank][b]["sd"]
            assert all(torch.equal(x[k], y[k]) for k in y), (a, b, rank)


def test_checkpoints_store_state_in_its_dtype(results):
    for rank in range(2):
        c = results[rank]["ckpt"]
        for key in ("fp8", "bf16", "offload", "fp8_offload"):
            assert c[f"{key}_state_view_equal"], (rank, key)
        assert c["fp8_decoded_bytes"] == 0, c["fp8_decoded_bytes"]
        assert c["fp8_decoded_bytes_after_load"] == 0, c["fp8_decoded_bytes_after_load"]
        if "fp8_view_write" in c:  # the rank owns a matrix
            assert "Inplace update to inference tensor" in c["fp8_view_write"], c["fp8_view_write"]
        for key, dt in (("fp8", "torch.float8_e4m3fn"), ("bf16", "torch.bfloat16"),
                        ("offload", "torch.float32")):
            assert c[f"{key}_stored_dtypes"], key
            assert c[f"{key}_group_dtype"] == dt, c
            assert c[f"{key}_same_roundtrip"] and c[f"{key}_same_notes"] == 0, (key, c)
            assert c[f"{key}_to_fp32_exact"], key
            nb, want = c[f"{key}_nbytes"]
            assert nb["device" if key != "offload" else "host"] == want, (key, nb, want)
            assert nb["host" if key != "offload" else "device"] == 0, (key, nb)
        # fp8 offloaded (the HSDP slow test trains it): data on the host, scales on the device
        nb, model = c["fp8_offload_nbytes"][0], c["fp8_offload_model"]
        assert nb == model and nb["host"] > 0 and 0 < nb["device"] < nb["host"], (nb, model)
        assert c["offload_stored_device"] == ["cpu"]
        cin, cout, want = c["offload_copies"]
        assert cin == cout == want > 0, c["offload_copies"]
        assert c["bf16_copies"][:2] == (0, 0)
        assert c["fp8_ckpt_dtypes"] == ["torch.bfloat16"] and c["bf16_ckpt_dtypes"] == [
            "torch.bfloat16"] and c["offload_ckpt_dtypes"] == ["torch.float64"]
        assert c["fp8_scales_equal"]
        for key in ("fp8", "bf16"):
            notes = c[f"{key}_to_fp32_notes"]
            assert len(notes) == 1 and "converted on load" in notes[0], notes
        assert c["offload_to_fp32_notes"] == []
        assert c["fp32_to_fp8_rounded"] and len(c["fp32_to_fp8_notes"]) == 1


def test_unsupported_combinations_raise():
    from dmuon.stateful.optimizer.state_storage import MomentumStorage
    # every chain (Muon and the variants) now stores its momentum stage's buffers through the
    # one chunked path, so an 8-bit momentum with TP takes each slice's whole-matrix scale for a
    # variant too (tests/test_state_tp_scale.py): nothing left to refuse there
    with pytest.raises(TypeError, match="offload_state"):
        MomentumStorage(None, "yes", torch.device("cpu"))


def test_memory_model_equals_allocated(results):
    """The plan's per-rank state bytes (rank_memory) == the bytes the owners' state tensors hold,
    read from the optimizer, for each option, on each rank."""
    for rank in range(2):
        c = results[rank]["ckpt"]
        for key in ("fp8", "bf16", "offload"):
            assert c[f"{key}_model"] == c[f"{key}_nbytes"][0], (key, rank, c[f"{key}_model"])
        assert c["offload_nbytes"][0]["host"] > 0


def test_plan_cli_shows_state_bytes(capsys):
    from dmuon.__main__ import main
    got = {}
    for d in ("fp32", "bf16", "fp8"):
        main(["plan", "--model", "llama-3.2-1b", "--shard", "4", "--momentum-dtype", d, "--json"])
        import json
        got[d] = json.loads(capsys.readouterr().out)["muon_state"]
    assert got["fp32"]["total_bytes"] == 2 * got["bf16"]["total_bytes"]
    n_mats = 16 * 7  # Llama 3.2 1B: 16 layers x 7 projections, one 4-byte scale each
    assert got["fp8"]["total_bytes"] == got["bf16"]["total_bytes"] // 2 + 4 * n_mats
    main(["plan", "--model", "llama-3.2-1b", "--shard", "4", "--momentum-dtype", "bf16",
          "--offload-state"])
    assert "Muon state per rank (torch.bfloat16, on the host (offloaded))" in \
        capsys.readouterr().out


def test_adamw_state_dtype_bf16(results):
    """adamw_state_dtype=bf16: FSDP2's AdamW moments stored in bf16 == the one-process
    torch.optim.AdamW that rounds its moments to bf16 after each step; checkpoints hold them in
    bf16 and round-trip them bitwise."""
    for rank in range(2):
        assert results[rank]["adamw_bf16"]["sd"]  # the run itself (compared below)
    cfg = CONFIGS[-1]
    ref = reference_run(cfg)
    for rank in range(2):
        err, where = max_rel_err(results[rank]["adamw_bf16"]["sd"], ref["sd"])
        assert err <= 1e-10, (rank, err, where)
    fp32 = reference_run(dict(id="fp32"))
    err, where = max_rel_err(results[0]["adamw_bf16"]["sd"], fp32["sd"])
    print(f"bf16 AdamW moments vs fp32 after 10 steps: max rel err {err:.3g} at {where}")
    assert 0 < err <= 2e-2, err
    for rank in range(2):
        c = results[rank]["ckpt"]
        assert c["adamw_moment_dtypes"] == ["torch.bfloat16"], c["adamw_moment_dtypes"]
        assert c["adamw_roundtrip"], rank
