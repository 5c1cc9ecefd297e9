"""Pure checkpoint helpers (no processes): state-dict checks with tied names, the functional <->
full optimizer-state conversion, and reading torch / safetensors / sharded-index files."""
from __future__ import annotations

import json

import torch

from dmuon.functional import adamw as fadamw
from dmuon.functional import muon as fmuon
from dmuon.functional.state_dict_check import (
    check_state_dict, full_from_functional_states, functional_states_from_full,
)

EXP = {"embed.weight": (8, 4), "layers.0.w": (4, 4), "norm.weight": (4,), "lm_head.weight": (8, 4)}
TIED = [("embed.weight", "lm_head.weight")]


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
