"""Slow tier: the benchmark scripts that run on CPU still run and write their JSON.

The GPU benchmarks (``ns_whole_model``, ``ns_accuracy``, ``ns_breakdown``, ``syrk_bench``) need a
CUDA device and run on the H200; here the CPU-capable ones run end to end in small configurations:
``step_world1 --tiny`` and ``step_profile --tiny`` (gloo, world size 1), ``plan_balance`` and
``validate_projection --skip-gloo`` (the projector's prediction errors), ``variants_step --tiny``,
``bitwise_zoo --only z3`` (and its ``--compare``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.slow


def _run(script: str, *args: str, timeout: float = 300.0) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_step_world1_tiny_writes_results(tmp_path):
    out = tmp_path / "s.json"
    _run("step_world1.py", "--tiny", "--out", str(out))
    d = json.loads(out.read_text())
    for key in ("date", "torch", "results", "summary"):
        assert key in d, key
    assert d["results"], d


def test_step_profile_tiny_writes_results(tmp_path):
    out = tmp_path / "p.json"
    _run("step_profile.py", "--tiny", "--out", str(out))
    assert json.loads(out.read_text())


def test_plan_balance_writes_results(tmp_path):
    out = tmp_path / "pb.json"
    _run("plan_balance.py", "--out", str(out), "--repeat", "1")
    d = json.loads(out.read_text())
    assert d


def test_validate_projection_meets_the_step_total_goal(tmp_path):
    """Issue 25: calibrated on AdamW rows only, every predicted dmuon step total within 15 %."""
    out = tmp_path / "v.json"
    _run("validate_projection.py", "--skip-gloo", "--out", str(out))
    d = json.loads(out.read_text())
    totals = [r["total"]["error"] for r in d["a800"]["rows"] if r["role"] == "prediction"]
    totals += [r["step"]["error"] for r in d["h200_world1"]["rows"] if r["role"] == "prediction"]
    totals += [r["reference"]["error"] for r in d["a800"]["a800_128"]]
    assert len(totals) == 4 + 8 + 2 and max(abs(e) for e in totals) <= 0.15, totals


def test_variants_step_tiny_writes_results(tmp_path):
    out = tmp_path / "v.json"
    _run("variants_step.py", "--tiny", "--out", str(out))
    d = json.loads(out.read_text())
    for key in ("date", "machine", "torch", "results"):
        assert key in d, key
    r = d["results"]["tiny"]
    assert {"ns", "muon", "normuon", "muon_hyperball", "normuon_hyperball"} <= set(r)
    assert all(r[k]["ratio_to_ns"] > 0 for k in r if k != "ns")


def test_state_memory_tiny_writes_results(tmp_path):
    """Issue 38: ``state_memory --tiny`` runs the full mode's code path on CPU; the owners' state
    bytes it reads from each optimizer equal the plan's (memory model) number."""
    out = tmp_path / "sm.json"
    _run("state_memory.py", "--tiny", "--model", "llama", "--configs",
         "adamw,dmuon_fp8,dmuon_offload", "--warmup", "1", "--steps", "1", "--largest",
         "--probe-layers", "1", "2", "--max-layers", "3", "--max-tries", "1", "--out", str(out), timeout=600)
    d = json.loads(out.read_text())
    for key in ("date", "machine", "torch", "results", "largest", "summary"):
        assert key in d, key
    for c in ("dmuon_fp8", "dmuon_offload"):
        r = d["results"][c]
        assert r["muon_state_held_bytes"] == r["muon_state_planned_bytes"], r
    for c, big in d["largest"].items():  # probes at 1 and 2 layers, the prediction capped at 3
        assert big["layers"] == 3 and big["capped"] and big["peak_per_layer_gib"] > 0, (c, big)
        assert sorted(big["tries"]) == ["1", "2", "3"], (c, big["tries"])
    assert d["results"]["dmuon_offload"]["muon_state_held_bytes"]["device"] == 0


@pytest.mark.slow
def test_split_balance_executed_70b_meets_its_target(tmp_path):
    """Issue 35: the plan dedicate_params(split_ns=8) runs for 70B on 64x8 has max/mean <= 1.2,
    and the file carries the projector's owners' phase of the same plans beside it."""
    out = tmp_path / "sb.json"
    _run("split_balance.py", "--out", str(out))
    cases = json.loads(out.read_text())["cases"]
    c = next(c for c in cases if c["model"] == "llama-3.1-70b" and c["R"] == 8 and c["max_split"] == 8)
    assert c["meets_target"] and c["split_units"] > 0 and c["projected_ns_phase_ms"] > 0


def test_collective_style_projection_writes_results(tmp_path):
    """The style grid of benchmarks/collective_projection.py: auto is never behind per owner,
    per bucket or grouped (issue 47: with the replicate-axis wait of the step's first group
    weighed), and NS overlapped with the backward never lengthens a step."""
    out = tmp_path / "c.json"
    _run("collective_projection.py", "--grid", "styles", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["torch"] and data["date"] and len(data["rows"]) == 17
    for row in data["rows"]:
        auto = row["auto"]["step_ms"]
        assert auto <= min(row[s]["step_ms"] for s in ("per_owner", "per_bucket", "grouped")) \
            + 1e-6, row
        for style in ("per_owner", "per_bucket", "grouped", "auto"):
            for key, ov in row[style]["ns_overlap"].items():
                assert ov["step_ms"] <= row[style]["step_ms"] + 1e-6, (row["model"], style, key)
                assert ov["owners_phase_hidden_ms"] >= 0


def test_collective_style_gloo_writes_results(tmp_path):
    out = tmp_path / "g.json"
    _run("collective_style_gloo.py", "--ranks", "2", "--iters", "2", "--out", str(out))
    data = json.loads(out.read_text())
    small = data["cases"]["small"]
    assert small["per_bucket"]["counters"]["unshard"]["collectives"] == 1
    assert small["per_owner"]["counters"]["unshard"]["collectives"] == 2
    assert data["cases"]["one_owner"]["auto"]["style"] == "per_owner"


def test_bitwise_zoo_records_and_compare_catches_a_change(tmp_path):
    """The bitwise zoo (issue 45's check of a refactor): one scenario runs on 2 gloo ranks and
    records every category; ``--compare`` of a file with itself exits 0, and with one tensor's
    digest changed exits 1 naming that tensor."""
    out = tmp_path / "z.json"
    _run("bitwise_zoo.py", "--out", str(out), "--only", "z3")
    data = json.loads(out.read_text())
    ranks = data["scenarios"]["z3"]["ranks"]
    assert len(ranks) == 2 and not any(r["error"] for r in ranks)
    recs = ranks[0]["records"]
    assert set(recs) == {"model", "optim_full", "optim_torch", "traffic", "trace"}
    key = "layers.0.mlp.up_proj.weight"
    assert len(recs["model"][key]["sha256"]) == 64
    assert recs["traffic"]["unshard/collectives"]["value"] != "0"

    def compare(a, b):
        return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bitwise_zoo.py"),
                               "--compare", str(a), str(b)], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)

    assert compare(out, out).returncode == 0
    recs["model"][key]["sha256"] = "0" * 64
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(data))
    proc = compare(out, changed)
    assert proc.returncode == 1 and f"model/{key}" in proc.stdout, proc.stdout[-2000:]
