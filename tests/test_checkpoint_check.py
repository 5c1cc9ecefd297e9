"""Pure checkpoint helpers (no processes): state-dict checks with tied names, the functional <->
full optimizer-state conversion, and reading torch / safetensors / sharded-index files."""
from __future__ import annotations

import json

import torch

from dmuon.functional import adamw as fadamw
from dmuon.functional import muon as fmuon
from dmuon.functional.optimizer_format import (
    field_problems, from_torch_protocol, full_dict_problems, full_dict_structure,
    full_from_functional_states, functional_states_from_full, loadable_hparams,
    optimizer_state_problems, to_torch_protocol,
)
from dmuon.functional.state_dict_check import (
    assign_problems, check_state_dict, dtype_changes, model_state_problems, row_chunks,
    value_problems,
)
from dmuon.functional.state_fields import tp_concat_dim

EXP = {"embed.weight": (8, 4), "layers.0.w": (4, 4), "norm.weight": (4,), "lm_head.weight": (8, 4)}
TIED = [("embed.weight", "lm_head.weight")]


def test_assign_is_refused_only_once_an_optimizer_holds_fsdp2_params():
    """``load_state_dict(sd, assign=True)`` would swap FSDP2 params the built ``dmuon.Muon`` holds
    (the slow tier's test_user_paths_review5 runs it on 2 ranks)."""
    keys = ["embed.weight", "norm.weight"]
    assert assign_problems(False, True, keys) == []
    assert assign_problems(True, False, keys) == []  # before dmuon.Muon: the new params are its
    assert assign_problems(True, True, []) == []  # only dedicated matrices: copied by dmuon
    (line,) = assign_problems(True, True, keys)
    assert "assign=True" in line and "embed.weight" in line and "assign=False" in line


def test_exact_dict_passes_and_reads_each_key_from_itself():
    c = check_state_dict(dict(EXP), EXP, TIED)
    assert c.problems() == [] and dict(c.source) == {k: k for k in EXP}


def test_tied_name_is_satisfied_by_its_alias():
    given = {k: v for k, v in EXP.items() if k != "lm_head.weight"}  # save_pretrained drops it
    c = check_state_dict(given, EXP, TIED)
    assert c.problems() == [] and c.source["lm_head.weight"] == "embed.weight"
    c = check_state_dict({k: v for k, v in EXP.items() if k != "embed.weight"}, EXP, TIED)
    assert c.problems() == [] and c.source["embed.weight"] == "lm_head.weight"
    c = check_state_dict({"layers.0.w": (4, 4), "norm.weight": (4,)}, EXP, TIED)
    assert c.missing == ("embed.weight",)  # a whole tied group absent: reported once


def test_every_problem_is_listed_and_strict_false_keeps_shape_errors():
    given = {"embed.weight": (8, 4), "layers.0.w": (4, 5), "norm.weight": "str", "extra.b": (1,)}
    c = check_state_dict(given, EXP)
    msg = " ".join(c.problems())
    for name in ("lm_head.weight", "extra.b", "layers.0.w: shape (4, 5), expected (4, 4)",
                 "norm.weight: not a tensor"):
        assert name in msg, msg
    loose = " ".join(c.problems(strict=False))
    assert "layers.0.w" in loose and "extra.b" not in loose and "lm_head" not in loose


def test_functional_states_round_trip_through_the_full_format():
    g = torch.Generator().manual_seed(0)
    ms = fmuon.MuonState(step=3, momentum={"a.w": torch.randn(4, 3, generator=g)})
    st = fadamw.AdamWState(step=3, mu={"b": torch.randn(5, generator=g)},
                           nu={"b": torch.rand(5, generator=g)})
    full = full_from_functional_states(ms, st, [{"name": "muon", "lr": 0.02}])
    assert full["dedicated"]["a.w"]["momentum_buffer"] is ms.momentum["a.w"]
    ms2, st2 = functional_states_from_full(full)
    assert ms2.step == 3 and st2.step == 3 and full["num_steps"] == 3
    assert torch.equal(ms2.momentum["a.w"], ms.momentum["a.w"])
    assert torch.equal(st2.nu["b"], st.nu["b"])


def test_torch_protocol_round_trips_to_the_load_entries():
    mom, mu = torch.ones(2, 2), torch.zeros(3)
    entries = {"a.w": {"momentum_buffer": mom, "step": torch.tensor(4.0)},
               "b": {"exp_avg": mu, "exp_avg_sq": mu, "step": torch.tensor(4.0)}}
    groups = [({"name": "muon", "lr": 0.02, "ns_dtype": torch.float64}, ["a.w"]),
              ({"name": "adamw", "lr": 3e-3}, ["b"])]
    sd = to_torch_protocol(groups, entries, num_steps=5)
    assert sd["param_groups"][0] == {"name": "muon", "lr": 0.02, "ns_dtype": "torch.float64",
                                     "params": [0], "param_names": ["a.w"], "num_steps": 5}
    assert sd["param_groups"][1]["params"] == [1] and sd["state"][1] is entries["b"]
    back = from_torch_protocol(sd, ["x", "y"], {"a.w"})  # by the groups' param_names
    assert back["dedicated"] == {"a.w": {"momentum_buffer": mom}}
    assert set(back["fsdp2"]) == {"b"} and (back["muon_step"], back["adamw_step"]) == (4, 4)
    assert back["num_steps"] == 5 and back["param_groups"][1] == {"name": "adamw", "lr": 3e-3}
    for g in sd["param_groups"]:
        del g["param_names"]
    by_position = from_torch_protocol(sd, ["m", "v"], {"m"})
    assert set(by_position["dedicated"]) == {"m"} and set(by_position["fsdp2"]) == {"v"}
    assert from_torch_protocol({"state": {}}, [], ()) is None
    assert loadable_hparams(sd["param_groups"][0]) == {"lr": 0.02, "ns_dtype": torch.float64}


def test_field_problems_name_missing_and_foreign_fields():
    assert field_problems("w", {"momentum_buffer": 1, "master": 2, "step": 3},
                          ["momentum_buffer"]) == []
    msg = " ".join(field_problems("w", {"momentum_buffer": 1, "v": 2}, ["momentum_buffer", "u"]))
    assert "no 'u'" in msg and "['v']: not a state of this optimizer" in msg
    assert field_problems("w", 3, ["momentum_buffer"]) == ["dedicated['w']: not a dict"]


def test_value_problems_and_the_precision_notes():
    notes: list = []
    ok = value_problems("w", torch.ones(2, 3, dtype=torch.float16), (2, 3), torch.float32,
                        notes=notes)
    assert ok == [] and notes == [("w", torch.float16, torch.float32)]
    assert value_problems("w", 3, (2,), torch.float32) == ["w: a int, not a tensor"]
    assert "shape (3,), expected (2,)" in value_problems("w", torch.ones(3), (2,), torch.float32)[0]
    assert "int64 cannot load" in value_problems("w", torch.ones(2, dtype=torch.int64), (2,),
                                                 torch.float32)[0]
    assert value_problems("w", torch.ones(2), (2,), torch.float32, layout="bad") == ["w: bad"]
    nan = torch.tensor([1.0, float("nan")])
    assert value_problems("w", nan, (2,), torch.float32) == ["w: non-finite values (NaN/Inf)"]
    assert value_problems("w", nan, (2,), torch.float32, finite=False) == []
    lines = dtype_changes("load", notes + [("v", torch.float64, torch.float32)])
    assert [w for w, _ in lines] == [True, False]
    assert "1 value(s) hold a narrower float" in lines[0][1] and "(e.g. w)" in lines[0][1]
    assert "torch.float64 into torch.float32" in lines[1][1]


def test_model_state_problems_check_keys_then_values():
    exp = {k: (shape, torch.float32) for k, shape in EXP.items()}
    sd = {k: torch.zeros(shape) for k, shape in EXP.items() if k != "lm_head.weight"}
    check, problems = model_state_problems(sd, exp, TIED)
    assert problems == [] and check.source["lm_head.weight"] == "embed.weight"
    assert model_state_problems([1], exp)[1] == ["expected a mapping {name: tensor}, got list"]
    sd["norm.weight"] = torch.full((4,), float("inf"))
    assert model_state_problems(sd, exp, TIED)[1] == ["'norm.weight': non-finite values (NaN/Inf)"]
    assert model_state_problems(sd, exp, TIED, finite=False)[1] == []
    sd["extra"] = torch.zeros(1)
    _, problems = model_state_problems(sd, exp, TIED)  # a key problem: values not read yet
    assert problems == ["unexpected keys ['extra']"]


def test_optimizer_state_problems_name_every_mismatch():
    spec = dict(matrices={"w": {"momentum_buffer": ((4, 2), torch.float32),
                                "master": ((4, 2), torch.float32)}},
                fields=["momentum_buffer"], adamw={"b": ((4,), (2,), torch.float32)})
    ok = {"w": {"momentum_buffer": torch.zeros(4, 2)}}
    assert optimizer_state_problems(ok, {}, **spec) == []  # an empty section: zeros
    piece = {"b": {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(4)}}  # piece or full
    assert optimizer_state_problems(ok, piece, **spec) == []
    bad = optimizer_state_problems({"w": {"momentum_buffer": torch.zeros(2, 4)}, "x": {}},
                                   {"b": {"exp_avg": torch.zeros(3)}, "c": {}}, **spec)
    msg = " | ".join(bad)
    for needle in ("dedicated['x']: no such dedicated matrix", "shape (2, 4), expected (4, 2)",
                   "fsdp2['b']['exp_avg']: shape (3,), expected (2,)", "no 'exp_avg_sq'",
                   "fsdp2['c']: no such AdamW param"):
        assert needle in msg, msg
    assert optimizer_state_problems({"w": 3}, {}, **spec) == ["dedicated['w']: not a dict"]
    assert optimizer_state_problems(ok, {}, layout=lambda v: "spec", **spec) == [
        "dedicated['w']['momentum_buffer']: spec"]
    spec["matrices"] = dict(spec["matrices"], v=spec["matrices"]["w"])
    assert optimizer_state_problems(ok, {}, **spec) == [
        "dedicated: 1 matrices missing, e.g. ['v']"]


def test_row_chunks_split_as_torch_chunk_and_tp_concat_dims():
    for rows, parts in ((10, 4), (3, 4), (0, 2), (8, 2)):
        sizes = [len(c) for c in torch.arange(rows).chunk(parts)]
        sizes += [0] * (parts - len(sizes))
        assert [n for _, n in row_chunks(rows, parts)] == sizes, (rows, parts)
    assert row_chunks(10, 4)[3] == (9, 1)
    assert tp_concat_dim("param", 1) == 1 and tp_concat_dim("rows", 0) == 0
    assert tp_concat_dim("rows", 1) is None and tp_concat_dim("matrices", 0) is None
    assert tp_concat_dim("param", None) is None


def test_read_state_dict_formats(tmp_path):
    from safetensors.torch import save_file

    from dmuon.checkpoint.state_dict_files import read_state_dict

    sd = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.float64)}
    torch.save(sd, tmp_path / "m.pt")
    shard = tmp_path / "hf"
    shard.mkdir()
    save_file({"a": sd["a"]}, str(shard / "model-00001-of-00002.safetensors"))
    save_file({"b": sd["b"]}, str(shard / "model-00002-of-00002.safetensors"))
    (shard / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors",
                        "b": "model-00002-of-00002.safetensors"}}))
    for src in (tmp_path / "m.pt", shard):
        got = read_state_dict(src)
        assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)


def test_full_dict_problems_and_rank0_structure():
    sd = {"fsdp2": {"b": {}, "a": {}}, "dedicated": {"w": {"momentum_buffer": 1, "master": 2}},
          "muon_step": 3}
    assert full_dict_problems(sd) == []
    for bad in (None, {"fsdp2": {}}, {"fsdp2": [], "dedicated": {}}):
        assert full_dict_problems(bad) == [
            f"expected dmuon.get_optimizer_state_dict's dict, got {type(bad).__name__}"]
    got = full_dict_structure(sd)
    assert got["fsdp2"] == ["a", "b"] and got["dedicated"] == {"w": ["master", "momentum_buffer"]}
    assert got["muon_step"] == 3 and got["adamw_step"] == 0
