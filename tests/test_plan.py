"""Owner plan: specs, cost model, LPT + local search, determinism, reports, presets and CLI."""
from __future__ import annotations

import dataclasses
import json
import random
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmuon.__main__ import main as cli_main
from dmuon.newton_schulz.matrix_shape import as_matrix_shape
from dmuon.newton_schulz.cost import ns_cost
from dmuon.tools.plan_report import plan_summary, plan_table
from dmuon.functional.plan import (DEFAULT_FLOPS_PER_BYTE, DEFAULT_LAYER_SPREAD_TOLERANCE, OwnerPlan,
                                   build_units, natural_key, param_cost, plan_owners)
from dmuon.tools.presets import (PRESETS, get_preset, preset_from_hf_config, preset_named_shapes,
                                      preset_specs)
from dmuon.functional.specs import ParamSpec, layer_key_from_name, specs_from_named_shapes

F32 = "torch.float32"


def spec(name, shape, layer_key="auto", route="muon", dtype=F32, batch_dims=0):
    key = layer_key_from_name(name) if layer_key == "auto" else layer_key
    return ParamSpec(name, tuple(shape), dtype, key, route, batch_dims)


# --------------------------------------------------------------------------------------------- specs

@pytest.mark.parametrize("name,key", [
    ("model.layers.3.mlp.up_proj.weight", "model.layers.3"),
    ("model.layers.12.self_attn.q_proj.weight", "model.layers.12"),
    ("transformer.h.0.attn.c_attn.weight", "transformer.h.0"),
    ("encoder.layer.7.attention.self.query.weight", "encoder.layer.7"),
    ("blocks.2.attn.qkv.weight", "blocks.2"),
    ("layers_5.feed_forward.w1.weight", "layers_5"),
    ("visual.blocks.1.mlp.fc1.weight", "visual.blocks.1"),
    ("model.layers.3.experts.layers.1.w", "model.layers.3"),   # outermost block wins
    ("model.embed_tokens.weight", None),
    ("lm_head.weight", None),
    ("model.sublayers.2.w", None),
    ("fh.3.w", None),
    ("layers.x.w", None),
])
def test_layer_key_from_name(name, key):
    assert layer_key_from_name(name) == key


def test_specs_from_triples_and_module():
    named = [("layers.0.w", (4, 3), torch.float32), ("layers.0.b", (4,), "torch.float32"),
             ("emb", (10, 4), torch.bfloat16)]
    seen = []

    def pred(name, p):
        seen.append((name, p.ndim, p.numel()))
        return p.ndim == 2 and name != "emb"

    specs = specs_from_named_shapes(named, pred)
    assert seen == [("layers.0.w", 2, 12), ("layers.0.b", 1, 4), ("emb", 2, 40)]
    assert specs[0] == ParamSpec("layers.0.w", (4, 3), F32, "layers.0", "muon", 0)
    assert specs[1].route == "adamw" and specs[2].dtype == "torch.bfloat16" and specs[2].layer_key is None

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    model[1].bias.requires_grad_(False)
    s2 = specs_from_named_shapes(model.named_parameters(), lambda n, p: p.ndim == 2,
                                 layer_key_fn=lambda n: "L" + n[0])
    assert [(s.name, s.route, s.layer_key) for s in s2] == [
        ("0.weight", "muon", "L0"), ("0.bias", "adamw", "L0"), ("1.weight", "adamw", "L1")]

    s3 = specs_from_named_shapes([("experts", (4, 8, 6), F32)], lambda n, p: True,
                                 batch_dims_fn=lambda n, shape: 1)
    assert s3[0].batch_dims == 1 and as_matrix_shape(s3[0].shape, 1) == (4, 8, 6)


def test_spec_errors():
    with pytest.raises(ValueError, match="not a matrix"):
        specs_from_named_shapes([("v", (5,), F32)], lambda n, p: True)
    with pytest.raises(ValueError, match="duplicate"):
        specs_from_named_shapes([("a", (2, 2), F32), ("a", (2, 2), F32)])
    with pytest.raises(ValueError, match="route"):
        ParamSpec("a", (2, 2), F32, None, "sgd")
    with pytest.raises(ValueError, match="torch dtype"):
        ParamSpec("a", (2, 2), "torch.float99", None, "adamw")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec("a", (2, 2)).name = "b"


# ------------------------------------------------------------------------------------ cost model

def test_param_cost_uses_ns_cost_and_bytes():
    s = spec("layers.0.w", (64, 256), dtype="torch.bfloat16")
    c = ns_cost(64, 256, 5)
    assert c.variant == "gram"  # wide matrix: the plan charges the variant that will run
    assert param_cost(s) == (c.flops + DEFAULT_FLOPS_PER_BYTE * 64 * 256 * 2, c.flops, 64 * 256 * 2, 1)
    assert param_cost(s, ns_variant="direct", ns_steps=3)[1] == 3 * (4 * 64 * 64 * 256 + 2 * 64**3)
    e = spec("experts", (3, 16, 8), batch_dims=1)
    assert param_cost(e, flops_per_byte=0)[0] == 3 * ns_cost(16, 8, 5).flops


def test_small_params_of_a_layer_are_packed():
    specs = [spec("layers.0.big", (64, 64)), spec("layers.0.k", (4, 64)), spec("layers.0.v", (4, 64)),
             spec("layers.1.k", (4, 64)), spec("free", (4, 64))]
    units = build_units(specs, flops_per_byte=0)
    by = {u.name: u for u in units}
    assert by["layers.0:small0"].params == ("layers.0.k", "layers.0.v")
    assert by["layers.1.k"].params == ("layers.1.k",)      # a single small param keeps its name
    assert by["free"].layer_key is None                     # no layer: never packed
    assert sum(u.cost for u in units) == sum(param_cost(s, flops_per_byte=0)[0] for s in specs)
    assert len(build_units(specs, flops_per_byte=0, small_unit_threshold=0.0)) == 5


# --------------------------------------------------------------------------- known exact owners

def test_known_fsdp_case():
    # flops_per_byte=0: cost = 5 * 6 m^3 = 30 m^3 -> 15360, 6480, 1920, 240
    specs = [spec(n, (m, m), layer_key=None) for n, m in (("d", 2), ("b", 6), ("a", 8), ("c", 4))]
    plan = plan_owners(specs, 2, flops_per_byte=0, small_unit_threshold=0.0)
    assert dict(plan.owners) == {"a": (0, 0), "b": (1, 0), "c": (1, 0), "d": (1, 0)}
    assert plan.slot_costs == (15360, 8640)
    assert plan.strategy == "lpt" and plan.round_robin_max_cost == 15360 + 1920
    assert plan.balance == 1.0 and plan.imbalance == pytest.approx(15360 / 12000)


def test_known_hsdp_case_column_first():
    specs = [spec(f"x{i}", (8, 8), layer_key=None) for i in (4, 2, 3, 1)]
    plan = plan_owners(specs, 2, 2)
    assert dict(plan.owners) == {"x1": (0, 0), "x2": (1, 0), "x3": (0, 1), "x4": (1, 1)}
    assert [plan.slot_of(plan.owner(f"x{i}")) for i in (1, 2, 3, 4)] == [0, 1, 2, 3]
    assert plan.owned_by((0, 1)) == ("x3",) and plan.coord_of(3) == (1, 1)


def test_layer_spread_soft_constraint():
    specs = [spec("layers.0.a", (8, 8)), spec("x.big", (8, 8), layer_key=None), spec("layers.0.b", (2, 2))]
    kw = dict(flops_per_byte=0, small_unit_threshold=0.0, local_search_steps=0)
    plan = plan_owners(specs, 2, **kw)
    assert plan.owner("layers.0.a") == (0, 0) and plan.owner("layers.0.b") == (1, 0)  # tie -> distinct
    nolayer = [dataclasses.replace(s, layer_key=None) for s in specs]
    assert plan_owners(nolayer, 2, **kw).owner("layers.0.b") == (0, 0)               # plain LPT
    # x.big (21870) on slot 0, layers.0.a (15360) on slot 1: spreading layers.0.b onto slot 0 would
    # exceed the least-loaded slot by more than the tolerance -> the balanced slot 1 wins
    specs2 = [spec("layers.0.a", (8, 8)), spec("x.big", (9, 9), layer_key=None), spec("layers.0.b", (2, 2))]
    assert plan_owners(specs2, 2, **kw).owner("layers.0.b") == (1, 0)
    assert plan_owners(specs2, 2, layer_spread_tolerance=1.0, **kw).owner("layers.0.b") == (0, 0)


def test_layers_on_distinct_slots_when_possible():
    cases = [("llama-3.1-8b", 64, DEFAULT_LAYER_SPREAD_TOLERANCE), ("llama-3.2-1b", 32, DEFAULT_LAYER_SPREAD_TOLERANCE),
             ("llama-3.1-70b", 64, 10.0), ("llama-3.2-1b", 16, 10.0)]  # large tolerance: always spread
    for name, g, tol in cases:
        plan = plan_owners(preset_specs(name), g, layer_spread_tolerance=tol)
        assert plan.layer_collisions == 0
        for layer in range(get_preset(name).layers):
            ks = [u for u in plan.units if u.layer_key == f"model.layers.{layer}"]
            slots = {plan.slot_of(plan.owner(u.params[0])) for u in ks}
            assert len(slots) == len(ks)


# ------------------------------------------------------------------------------ property tests

@st.composite
def spec_sets(draw):
    n_layers = draw(st.integers(0, 4))
    specs = []
    for li in range(n_layers):
        for j in range(draw(st.integers(1, 4))):
            m, n = draw(st.integers(1, 48)), draw(st.integers(1, 48))
            specs.append(spec(f"model.layers.{li}.w{j}", (m, n),
                              dtype=draw(st.sampled_from([F32, "torch.bfloat16"]))))
    for j in range(draw(st.integers(0 if specs else 1, 3))):
        specs.append(spec(f"free{j}", (draw(st.integers(1, 48)), draw(st.integers(1, 48)))))
    specs.append(spec("norm", (7,), route="adamw"))
    return specs


def _naive_round_robin_max(units, n):
    loads = [0] * n
    for k, u in enumerate(sorted(units, key=lambda u: natural_key(u.name))):
        loads[k % n] += u.cost
    return max(loads)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=spec_sets(), g=st.integers(1, 5), r=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_plan_properties(specs, g, r, seed):
    plan = plan_owners(specs, g, r)
    muon = {s.name: s for s in specs if s.route == "muon"}
    # each dedicated param exactly once, on a valid coordinate
    assert set(plan.owners) == set(muon)
    assert all(0 <= s < g and 0 <= rr < r for s, rr in plan.owners.values())
    assert sorted(p for u in plan.units for p in u.params) == sorted(muon)
    # loads add up, recomputed independently from owners and the cost function
    loads, nbytes = [0] * (g * r), [0] * (g * r)
    for name, coord in plan.owners.items():
        c = param_cost(muon[name])
        loads[plan.slot_of(coord)] += c[0]
        nbytes[plan.slot_of(coord)] += muon[name].nbytes
    assert list(plan.slot_costs) == loads and list(plan.slot_bytes) == nbytes
    assert sum(loads) == sum(u.cost for u in plan.units)
    # never worse than round-robin; within the greedy bound; balance >= 1
    mx, mean = max(loads), sum(loads) / (g * r)
    assert mx <= _naive_round_robin_max(plan.units, g * r) == plan.round_robin_max_cost
    assert mx <= mean * (1 + DEFAULT_LAYER_SPREAD_TOLERANCE) + plan.units[0].cost + 1e-6
    assert plan.balance >= 1 - 1e-12 and plan.imbalance >= 1 - 1e-12
    # any input order -> the same plan and fingerprint
    shuffled = list(specs)
    random.Random(seed).shuffle(shuffled)
    other = plan_owners(shuffled, g, r)
    assert other.fingerprint == plan.fingerprint and dict(other.owners) == dict(plan.owners)
    assert other == plan


@settings(max_examples=30, deadline=None)
@given(specs=spec_sets(), g=st.integers(1, 4), r=st.integers(2, 3))
def test_hsdp_column_balance_property(specs, g, r):
    specs = [dataclasses.replace(s, layer_key=None) for s in specs]
    plan = plan_owners(specs, g, r, local_search_steps=0, layer_spread_tolerance=0.0)
    cols = plan.column_costs
    total = sum(cols)
    if plan.strategy == "lpt":  # column-first LPT bound on the columns
        assert max(cols) <= total / g + plan.units[0].cost
    assert sum(cols) == sum(plan.slot_costs)


def test_hsdp_columns_balanced_on_presets():
    for name, g, r in (("llama-3.1-8b", 8, 8), ("llama-3.2-1b", 4, 2), ("llama-3.1-70b", 64, 8)):
        s = plan_summary(plan_owners(preset_specs(name), g, r))
        assert s["column_imbalance"] <= 1.02, (name, g, r, s["column_imbalance"])


def test_fingerprint_depends_on_inputs():
    specs = preset_specs("llama-3.2-1b")
    base = plan_owners(specs, 8).fingerprint
    assert len(base) == 64 and int(base, 16) >= 0
    assert plan_owners(specs, 8).fingerprint == base
    assert plan_owners(specs, 4, 2).fingerprint != base
    assert plan_owners(specs, 8, ns_steps=6).fingerprint != base
    changed = [dataclasses.replace(s, dtype=F32) if s.route == "adamw" else s for s in specs]
    assert plan_owners(changed, 8).fingerprint != base


def test_plan_is_immutable_and_errors():
    plan = plan_owners([spec("a", (4, 4))], 2)
    with pytest.raises(TypeError):
        plan.owners["a"] = (1, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.balance = 0.5
    with pytest.raises(KeyError, match="not a dedicated"):
        plan.owner("zzz")
    with pytest.raises(ValueError, match="shard_size"):
        plan_owners([spec("a", (4, 4))], 0)
    with pytest.raises(ValueError, match="duplicate"):
        plan_owners([spec("a", (4, 4)), spec("a", (2, 2))], 2)
    empty = plan_owners([spec("n", (3,), route="adamw")], 3)
    assert dict(empty.owners) == {} and empty.slot_costs == (0, 0, 0) and empty.balance == 1.0


# ----------------------------------------------------------------------- targets (benchmark cases)

@pytest.mark.parametrize("name,g,r,target", [
    ("llama-3.2-1b", 8, 1, 1.02), ("llama-3.1-8b", 8, 1, 1.02), ("llama-3.1-8b", 64, 1, 1.06)])
def test_balance_targets(name, g, r, target):
    plan = plan_owners(preset_specs(name), g, r)
    assert plan.balance <= target, plan_table(plan)


def test_70b_on_512_slots_is_fast():
    specs = preset_specs("llama-3.1-70b")
    t0 = time.perf_counter()
    plan = plan_owners(specs, 64, 8)
    assert time.perf_counter() - t0 < 1.0
    assert len(plan.owners) == 80 * 7 and plan.balance <= 1.0 + 1e-12


# ------------------------------------------------------------------------------ presets and report

def test_presets_param_counts():
    # published parameter counts of these checkpoints
    expected = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
                "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496,
                "qwen2.5-7b": 7_615_616_512}
    for name, n in expected.items():
        specs = preset_specs(name)
        assert sum(s.numel for s in specs) == n
        muon = [s for s in specs if s.route == "muon"]
        assert len(muon) == 7 * PRESETS[name].layers
        assert all(s.name.endswith("_proj.weight") and s.layer_key for s in muon)


def test_hf_config_roundtrip(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
           "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "vocab_size": 152064, "tie_word_embeddings": False}
    path = tmp_path / "qwen" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    p = preset_from_hf_config(path)
    assert p.name == "qwen" and preset_named_shapes(p) == preset_named_shapes(get_preset("qwen2.5-7b"))
    wrapped = preset_from_hf_config({"text_config": {**cfg, "model_type": "llama"}})
    assert not wrapped.qkv_bias and wrapped.layers == 28
    with pytest.raises(ValueError, match="hidden_size"):
        preset_from_hf_config({"vocab_size": 3})


def test_summary_and_table():
    plan = plan_owners(preset_specs("llama-3.2-1b"), 4, 2)
    s = plan_summary(plan, planning_seconds=0.01)
    json.dumps(s)
    assert s["slots"] == 8 and len(s["per_slot"]) == 8 and s["comm_bytes_per_rank"] is None
    assert sum(x["matrices"] for x in s["per_slot"]) == 16 * 7
    assert s["max_cost"] == max(plan.slot_costs) and s["fingerprint"] == plan.fingerprint
    s2 = plan_summary(plan, comm_bytes_per_rank={"z2": list(range(8))})
    assert s2["comm_bytes_per_rank"] == {"z2": list(range(8))}
    with pytest.raises(ValueError, match="8 ranks"):
        plan_summary(plan, comm_bytes_per_rank={"z3": [1, 2]})
    text = plan_table(plan, planning_seconds=0.01)
    assert "balance" in text and "(3,1)" in text and plan.fingerprint in text
    assert "Z2 recv/step" in plan_table(plan, comm_bytes_per_rank={"z2": [0] * 8})
    assert "not shown" in plan_table(plan, max_rows=4)
    assert isinstance(plan, OwnerPlan) and hash(plan) == hash(plan_owners(preset_specs("llama-3.2-1b"), 4, 2))


def test_cli_plan(capsys, tmp_path):
    assert cli_main(["plan", "--model", "llama-3.2-1b", "--shard", "4", "--replicate", "2"]) == 0
    out = capsys.readouterr().out
    assert "G=4 x R=2" in out and "planning time" in out and "balance" in out
    assert cli_main(["plan", "--model", "llama-3.1-8b", "-G", "8", "--json"]) == 0
    summ = json.loads(capsys.readouterr().out)
    assert summ["model"] == "llama-3.1-8b" and summ["balance"] <= 1.02
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "vocab_size": 100}))
    assert cli_main(["plan", "--config", str(cfg), "-G", "3"]) == 0
    assert "14 dedicated params" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli_main(["plan", "--model", "llama-3.2-1b", "-G", "0"])
    assert e.value.code == 2
