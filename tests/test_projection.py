"""Step projector: machine model, flop counts, NS times, the step timeline built from the real plan
and schedules, byte accounting of the runtime's layouts, reports, CLI and the MoE config reader."""
import json
import math
import os

import pytest

from dmuon.__main__ import main
from dmuon.tools.machine import A800, H200, H200_NS_GROUPS, collective_time, ns_matrix_seconds, ns_rate
from dmuon.tools.model_flops import active_params, forward_flops, layer_forward_flops
from dmuon.newton_schulz.cost import ns_cost
from dmuon.tools.ns_phase import ns_phase
from dmuon.functional.plan import plan_owners
from dmuon.tools.presets import ModelPreset, get_preset, preset_from_hf_config, preset_specs
from dmuon.tools.projection import StepSetup, project_step
from dmuon.tools.projection_report import projection_summary, projection_table
from dmuon.tools.step_bytes import plan_program

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
TINY = ModelPreset("tiny", hidden=1024, intermediate=2816, layers=4, heads=8, kv_heads=2, vocab=8192)


def test_collective_times():
    m = H200
    assert collective_time(m, "all_reduce", 1e9, 1, members_per_node=1, nodes=1) == 0.0
    ar = collective_time(m, "all_reduce", 1e9, 8, members_per_node=8, nodes=1)
    ag = collective_time(m, "all_gather", 1e9, 8, members_per_node=8, nodes=1)
    lat = m.nvlink.alpha + 8 * m.nvlink.alpha_hop
    assert math.isclose(ar - lat, 2 * 7 / 8 * 1e9 / m.nvlink.busbw)
    assert math.isclose(ag - lat, 7 / 8 * 1e9 / m.nvlink.busbw)
    # one rank per node: the NIC; a whole node per group member set: min(NVLink, 8 NICs)
    rep = collective_time(m, "broadcast", 1e9, 4, members_per_node=1, nodes=4)
    assert math.isclose(rep - m.ib.alpha - 4 * m.ib.alpha_hop, 1e9 / m.ib.busbw)
    big = collective_time(m, "broadcast", 1e9, 64, members_per_node=8, nodes=8)
    lat = m.ib.alpha + 8 * m.ib.alpha_hop + 56 * m.nvlink.alpha_hop
    assert math.isclose(big - lat, 1e9 / min(m.nvlink.busbw, 8 * m.ib.busbw))
    changed = m.with_values(nvlink_busbw=2 * m.nvlink.busbw, mfu_fwd=0.5)
    assert changed.nvlink.busbw == 2 * m.nvlink.busbw and changed.mfu_fwd == 0.5
    assert changed.sources["mfu_fwd"] == "set by the caller"
    with pytest.raises(KeyError):
        m.with_values(nonsense=1.0)


def test_ns_times_from_measured_groups():
    for gm, gn, variant, count, ms in H200_NS_GROUPS:           # measured shapes: measured times
        assert math.isclose(ns_matrix_seconds(H200, gm, gn) * count * 1e3, ms)
        assert math.isclose(ns_matrix_seconds(H200, gn, gm) * count * 1e3, ms)
    # between measured sizes the rate is interpolated, beyond them clamped
    r1, r2 = ns_rate(H200, 1024, "gram"), ns_rate(H200, 2048, "gram")
    assert r1 < ns_rate(H200, 1500, "gram") < r2
    assert ns_rate(H200, 8192, "gram") == ns_rate(H200, 4096, "gram")
    t = ns_matrix_seconds(H200, 8192, 28672)
    assert math.isclose(t, ns_cost(8192, 28672, 5, gram_restart=3).flops / ns_rate(H200, 8192, "gram"))
    assert math.isclose(ns_matrix_seconds(A800, 8192, 28672) * A800.ns_rate_scale, t)


def test_flops():
    p = get_preset("llama-3.1-8b")
    per_token = forward_flops(p, 4096, 1)
    n_nonembed = sum(s.numel for s in preset_specs(p) if "embed_tokens" not in s.name)
    assert abs(active_params(p) - n_nonembed) / n_nonembed < 1e-3    # matmul params = all but embed
    assert per_token == 2 * active_params(p) + p.layers * 2 * 4096 * p.heads * p.head_dim
    moe = get_preset("mixtral-8x7b")
    dense_twin = ModelPreset("d", hidden=4096, intermediate=2 * 14336, layers=32, heads=32,
                             kv_heads=8, vocab=32000)
    assert layer_forward_flops(moe, 4096, 1) == layer_forward_flops(dense_twin, 4096, 1) + 2 * 4096 * 8


def test_world1_step_is_compute_plus_owners_phase():
    setup = StepSetup(TINY, 1, 1, micro_batch=2, seq=1024)
    a, d = project_step(setup, H200, "adamw"), project_step(setup, H200, "dmuon")
    tokens = 2 * 1024
    fwd = forward_flops(TINY, 1024, tokens) / (H200.peak_flops * H200.mfu("fwd", TINY.hidden))
    assert math.isclose(a.forward, fwd) and math.isclose(d.forward, fwd)
    assert math.isclose(a.backward, 2 * fwd * H200.mfu_fwd / H200.mfu_bwd)
    assert all(v == 0 for v in a.exposed.values()) and all(v == 0 for v in d.exposed.values())
    specs = preset_specs(TINY)
    ns = sum(ns_matrix_seconds(H200, *s.shape) for s in specs if s.route == "muon")
    ew = sum(s.numel for s in specs if s.route == "muon") * H200.fused_s_per_param
    rest = sum(s.numel for s in specs if s.route != "muon") * H200.fused_s_per_param
    assert math.isclose(d.optimizer, ns + ew + rest)
    assert math.isclose(a.optimizer, sum(s.numel for s in specs) * H200.adamw_s_per_param)


def test_timeline_carries_the_schedules():
    setup = StepSetup(TINY, 8, 2, micro_batch=1, seq=512, dmuon_reshard=True)
    d = project_step(setup, H200, "dmuon")
    ops = d.timeline
    for layer in range(TINY.layers):                 # Z3: one broadcast per bucket, twice
        fwd = [o for o in ops if o.name == f"broadcast L{layer}"]
        bwd = [o for o in ops if o.name == f"broadcast' L{layer}"]
        red = [o for o in ops if o.name == f"reduce L{layer}"]
        cols = {c for n, c in d.plan.owners.items() if f"layers.{layer}." in n}
        assert len(fwd) == len(bwd) == len(red) == len({s for s, _ in cols})
    assert any(o.name.startswith("publish") for o in ops)          # HSDP publish in the forward
    assert all(o.end >= o.start >= 0 for o in ops)
    z2 = project_step(StepSetup(TINY, 8, 2, micro_batch=1, seq=512, dmuon_reshard=False), H200, "dmuon")
    assert not any(o.name.startswith("broadcast'") for o in z2.timeline)
    summ = projection_summary(setup, H200, [project_step(setup, H200, "adamw"), d])
    assert summ["global_batch_tokens"] == 16 * 512
    assert "overhead_vs_adamw" in summ["designs"]["dmuon"]
    assert "global batch 16 sequences = 8,192 tokens" in projection_table(summ)


def test_split_units_as_executed_in_the_owners_phase_of_70b():
    """Split as the optimizer executes it (the owner scatters its NS input and gathers the result,
    split_exec): the plan's split evens the NS load at 64x8 and 64x16, but shortens the phase
    only at 64x16; at 64x8 the scatter / gather cost more than the balance wins."""
    specs = preset_specs("llama-3.1-70b")
    for r, pays in ((8, False), (16, True)):
        whole = ns_phase(plan_owners(specs, 64, r), specs, H200)
        split = ns_phase(plan_owners(specs, 64, r, max_split=8), specs, H200)
        assert split.imbalance < whole.imbalance and max(split.split_comm) > 0
        assert (split.seconds < 0.95 * whole.seconds) == pays, (r, split.seconds, whole.seconds)


@pytest.mark.slow
def test_projected_70b_keeps_splits_only_where_they_shorten_the_step():
    for r, pays in ((8, False), (16, True)):
        setup = StepSetup(get_preset("llama-3.1-70b"), 64, r, max_split=8)
        d = project_step(setup, H200, "dmuon")
        whole = project_step(setup.__class__(**{**setup.__dict__, "max_split": 1}), H200, "dmuon")
        assert bool(d.plan.splits) == pays and d.step <= whole.step
        if pays:
            assert d.ns.imbalance < whole.ns.imbalance and d.step < whole.step


def test_runtime_step_traffic_z3_hsdp_and_splits(monkeypatch):
    import dmuon.functional.split_plan as sp_mod
    from dmuon.functional.split_ns import split_ns_schedule
    from dmuon.functional.split_plan import runtime_owners
    specs = preset_specs(TINY)
    P = sum(s.numel for s in specs if s.route == "muon") * 4
    F = 4 * sum(1 for s in specs if s.route == "muon")
    G, R = 4, 2
    plan = plan_owners(specs, G, R)
    tr = plan_program(plan, specs, reshard_after_forward=True, compute_dtype="torch.float32").traffic()
    shard = tr.total_sent(["unshard", "reduce"])
    assert shard == R * (G - 1) * (3 * P + F)        # mean per rank 3(G-1)/G P + presence
    assert tr.total_sent(["replicate"]) == (R - 1) * (2 * P + F)   # stage 2 (+ presence), publish
    monkeypatch.setattr(sp_mod, "SPLIT_COLLECTIVE_FLOPS", 0)    # make splits pay at this size
    monkeypatch.setattr(sp_mod, "SPLIT_COMM_FLOPS_PER_BYTE", 0)
    monkeypatch.setattr(sp_mod, "EXEC_FLOPS_PER_BYTE", 0)
    one = ModelPreset("one", hidden=256, intermediate=1024, layers=1, heads=4, kv_heads=2, vocab=512)
    specs = preset_specs(one)                          # 7 matrices on 8 slots: the MLPs split
    P = sum(s.numel for s in specs if s.route == "muon") * 4
    split = plan_owners(specs, G, R, max_split=4, node_size=4)
    assert split.splits
    tr = plan_program(split, specs, reshard_after_forward=True, compute_dtype="torch.float32").traffic()
    entries = len(runtime_owners(split))               # executed: every matrix whole on one rank
    assert entries == len(specs) - sum(s.route != "muon" for s in specs)
    assert tr.total_sent(["unshard", "reduce"]) == R * (G - 1) * (3 * P + 4 * entries)
    core = sum(split_ns_schedule(sp.param, sp.layout, sp.members, G, R, variant=sp.variant,
                                 gram_restart=sp.gram_restart, dtype="torch.bfloat16").traffic()
               .total_sent(["split"]) for sp in split.splits)
    # + the owner's fp32 scatter of the NS input and gather of the result: (k-1)/k of each matrix
    moved = sum(2 * 4 * (sp.layout.m * sp.layout.n - sp.layout.m * (sp.layout.col_ranges[0][1]
                                                                   - sp.layout.col_ranges[0][0]))
                for sp in split.splits)
    assert tr.total_sent(["split"]) == core + moved and core > 0


def test_moe_and_bad_hf_configs(tmp_path):
    mixtral = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 100, "num_local_experts": 4, "num_experts_per_tok": 2}
    p = preset_from_hf_config(mixtral, name="mx")
    assert (p.experts, p.experts_per_token, p.moe_intermediate) == (4, 2, 96)
    names = [s.name for s in preset_specs(p) if s.route == "muon"]
    assert len(names) == 2 * (4 + 4 * 3) and "model.layers.1.mlp.experts.3.down_proj.weight" in names
    qwen = {**mixtral, "model_type": "qwen2_moe", "num_local_experts": None, "num_experts": 8,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 128}
    q = preset_from_hf_config(qwen, name="qm")
    assert (q.experts, q.moe_intermediate, q.shared_intermediate, q.qkv_bias) == (8, 32, 128, True)
    assert any("shared_expert.down_proj" in s.name for s in preset_specs(q))
    with pytest.raises(ValueError, match="DeepSeek"):
        preset_from_hf_config({**mixtral, "kv_lora_rank": 512})
    with pytest.raises(ValueError, match="dense and sparse"):
        preset_from_hf_config({**qwen, "decoder_sparse_step": 2})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(mixtral))
    assert main(["project", "--config", str(path), "-G", "2", "--seq", "64", "--max-split", "1"]) == 0


def test_cli_project(capsys, tmp_path):
    png = tmp_path / "t.png"
    assert main(["project", "--model", "llama-3.2-1b", "-G", "8", "--max-split", "1",
                 "--designs", "adamw,dmuon,reference", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "global batch 8 sequences = 32,768 tokens" in out and "reference" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["project", "--model", "llama-3.2-1b", "-G", "8", "--max-split", "1", "--json",
                 "--machine", "a800", "--set", "ib_alpha_hop=1e-5"]) == 0
    summ = json.loads(capsys.readouterr().out)
    assert summ["machine"] == "A800" and summ["machine_constants"]["ib"]["alpha_hop"] == 1e-5


def test_machine_defaults_are_the_validation_fit():
    with open(os.path.join(RESULTS, "projection_validation.json")) as f:
        fit = json.load(f)
    for machine, key in ((A800, "a800"), (H200, "h200_world1")):
        cal = fit[key]["calibrated"]
        for name in ("mfu_fwd", "mfu_bwd", "mfu_half_hidden", "adamw_step_s", "adamw_s_per_param"):
            assert math.isclose(getattr(machine, name), cal[name], rel_tol=1e-3, abs_tol=1e-12), name


def test_ns_steps_change_ns_time_as_the_math_says():
    """``--ns-steps`` (and every NS option) changes the projected NS time by the flop ratio: the
    measured groups are 5-step runs, so k steps take k-step flops at the measured rate."""
    for gm, gn, variant, count, ms in H200_NS_GROUPS:
        t5 = ns_matrix_seconds(H200, gm, gn, steps=5)
        for k in (1, 2, 10):
            ratio = (ns_cost(gm, gn, k, variant=variant, gram_restart=3).flops
                     / ns_cost(gm, gn, 5, variant=variant, gram_restart=3).flops)
            assert math.isclose(ns_matrix_seconds(H200, gm, gn, steps=k), t5 * ratio, rel_tol=1e-9)
    t = {k: ns_matrix_seconds(H200, 8192, 28672, steps=k) for k in (1, 2, 5, 10)}
    assert t[1] < t[2] < t[5] < t[10]
    owners = {k: max(project_step(StepSetup(get_preset("llama-3.1-8b"), 8, ns_steps=k), H200,
                                  "dmuon").ns.finish) for k in (1, 2, 5, 10)}
    assert owners[1] < owners[2] < owners[5] < owners[10]


def test_project_config_takes_a_folder_as_plan_does(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(tmp_path), "--shard", "2"]) == 0
    assert main(["project", "--config", str(tmp_path), "-G", "2", "--seq", "64",
                 "--max-split", "1"]) == 0


def test_projection_prints_its_sensitivity_to_link_constants(capsys):
    assert main(["project", "--model", "llama-3.2-1b", "-G", "16", "--max-split", "1",
                 "--json"]) == 0
    summ = json.loads(capsys.readouterr().out)
    for design in ("adamw", "dmuon"):
        rows = summ["sensitivity"][design]
        step = summ["designs"][design]["step_ms"]
        assert set(rows) == {"nvlink_busbw", "nvlink_alpha", "ib_busbw", "ib_alpha"}
        # half the bandwidth never speeds a step up, twice never slows it down (latency: reverse)
        assert rows["ib_busbw"][0] >= step >= rows["ib_busbw"][1]
        assert rows["ib_alpha"][0] <= step <= rows["ib_alpha"][1]
    assert main(["project", "--model", "llama-3.2-1b", "-G", "16", "--max-split", "1"]) == 0
    assert "with each link constant at 1/2x and 2x" in capsys.readouterr().out


def test_project_prints_its_calibration_rows_with_errors(capsys):
    """`dmuon project` prints the measured rows its machine constants were fitted on beside their
    projection now (with any --set applied) and the error: H200's W=1 AdamW row, A800's four."""
    assert main(["project", "--model", "llama-3.2-1b", "-G", "8", "--max-split", "1"]) == 0
    out = capsys.readouterr().out
    assert "calibration" in out and "step_world1_h200.json" in out and "133.1" in out
    from dmuon.tools.calibration import calibration_rows
    from dmuon.tools.machine import A800
    rows = calibration_rows(H200)
    assert rows and all(abs(r["error"]) <= 0.02 for r in rows if r["phase"] == "step")
    a800 = calibration_rows(A800)
    assert len([r for r in a800 if r["phase"] == "step"]) == 4
    assert all(abs(r["error"]) <= 0.10 for r in a800)
    # the rows are projected with the constants in use: a wrong MFU shows in the errors
    worse = calibration_rows(H200.with_values(mfu_fwd=0.4, mfu_bwd=0.4))
    assert max(abs(r["error"]) for r in worse) > 0.3
    assert main(["project", "--model", "llama-3.2-1b", "-G", "8", "--max-split", "1", "--json"]) == 0
    summ = json.loads(capsys.readouterr().out)
    assert summ["calibration"] and {"measured_ms", "projected_ms", "error"} <= set(summ["calibration"][0])


def test_collective_styles_in_the_timeline_and_auto_takes_the_cheaper(capsys):
    """``collectives``: per bucket, one all-gather (twice in Z3) and one reduce-scatter per layer,
    gated by every column's HSDP publish; ``auto`` never projects a longer step than the two
    styles (Llama's few matrices per layer stay per owner at G = 64; many equal experts per layer
    go per bucket)."""
    setup = StepSetup(TINY, 8, 2, micro_batch=1, seq=512)
    pb = project_step(StepSetup(TINY, 8, 2, micro_batch=1, seq=512, collectives="per_bucket"),
                      H200, "dmuon")
    for layer in range(TINY.layers):
        assert [o.name for o in pb.timeline if o.lane in ("unshard", "reduce")
                and o.name.endswith(f" L{layer}")] == [f"all-gather L{layer}",
                                                       f"all-gather' L{layer}",
                                                       f"reduce-scatter L{layer}"]
    assert pb.collective_styles == {"per_bucket": TINY.layers}
    for preset, G in ((get_preset("llama-3.1-8b"), 64), (get_preset("mixtral-8x7b"), 8)):
        steps = {st: project_step(StepSetup(preset, G, 1, collectives=st), H200, "dmuon")
                 for st in ("per_owner", "per_bucket", "auto")}
        assert steps["auto"].step <= min(steps["per_owner"].step, steps["per_bucket"].step) + 1e-9
        # the padding is in the bytes: every part is the largest bucket
        assert steps["per_bucket"].shard_bytes_per_rank > steps["per_owner"].shard_bytes_per_rank
    assert steps["auto"].collective_styles == {"per_bucket": preset.layers}  # mixtral at G = 8
    assert main(["project", "--model", "llama-3.2-1b", "-G", "8", "--max-split", "1",
                 "--collectives", "auto", "--json"]) == 0
    summ = json.loads(capsys.readouterr().out)
    assert summ["collectives"] == "auto" and summ["designs"]["dmuon"]["collective_styles"]
    assert project_step(setup, H200, "dmuon").collective_styles == {"per_owner": TINY.layers}
    # dmuon plan counts the bytes of the style (the program's op_bytes, padding included)
    comm = {}
    for st in ("per_owner", "per_bucket"):
        assert main(["plan", "--model", "llama-3.2-1b", "-G", "8", "--collectives", st,
                     "--json"]) == 0
        summ = json.loads(capsys.readouterr().out)
        assert summ["collectives"] == st
        comm[st] = summ["comm_bytes_per_rank"]["z3"]
    assert sum(comm["per_bucket"]) > sum(comm["per_owner"])


def test_grouped_style_is_one_launch_per_phase_with_the_per_owner_bytes():
    """``collectives="grouped"``: per layer one all-gather-v (twice in Z3) and one reduce-v, each
    one latency plus the per-owner bytes: never slower than per owner, the same bytes, and
    ``auto`` never slower than any style."""
    st = {c: project_step(StepSetup(TINY, 8, 2, micro_batch=1, seq=512, collectives=c), H200,
                          "dmuon") for c in ("per_owner", "grouped", "per_bucket", "auto")}
    gr = st["grouped"]
    for layer in range(TINY.layers):
        assert [o.name for o in gr.timeline if o.lane in ("unshard", "reduce")
                and o.name.endswith(f" L{layer}")] == [f"all-gather-v L{layer}",
                                                       f"all-gather-v' L{layer}",
                                                       f"reduce-v L{layer}"]
    assert gr.collective_styles == {"grouped": TINY.layers}
    assert gr.shard_bytes_per_rank == st["per_owner"].shard_bytes_per_rank
    assert gr.step < st["per_owner"].step
    assert gr.exposed["unshard"] <= st["per_owner"].exposed["unshard"]
    assert st["auto"].step <= min(s.step for s in st.values()) + 1e-9


def test_the_sharded_styles_refresh_where_it_runs():
    """``collectives="sharded"``: the built (lazy) refresh runs in front of each group's first
    forward gather; ``sharded_refresh="behind_ns"`` (projected only) moves it into the owners'
    phase, which at 8 GPUs and sequence 1024 hides most of it (Llama-3.1-8B: less exposed
    gather than lazy and than grouped)."""
    import dataclasses
    setup = StepSetup(get_preset("llama-3.1-8b"), 8, 1, micro_batch=1, seq=1024, max_split=1,
                      collectives="sharded")
    lazy = project_step(setup, H200, "dmuon")
    behind = project_step(dataclasses.replace(setup, sharded_refresh="behind_ns"), H200, "dmuon")
    grouped = project_step(dataclasses.replace(setup, collectives="grouped"), H200, "dmuon")
    assert any("copy refresh" in o.name and o.phase == "forward" for o in lazy.timeline)
    assert not any("copy refresh" in o.name and o.phase == "forward" for o in behind.timeline)
    gather = lambda p: p.exposed["unshard"] + p.exposed.get("fsdp_all_gather", 0.0)  # noqa: E731
    assert gather(behind) < gather(grouped) < gather(lazy)
