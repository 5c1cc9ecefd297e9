"""``examples/lightning_fsdp2.py``: dmuon under Lightning's ``ModelParallelStrategy`` (2 gloo ranks, fp64).

Lightning starts its own ranks (``devices=2``); the example dedicates in ``configure_model`` before
``fully_shard``, returns ``dmuon.Muon`` + a ``LambdaLR`` from ``configure_optimizers`` and clips with
``dmuon.clip_grad_norm_``. A 6-step schedule, each step over the whole 8-sample dataset (so data order
cannot matter), is stopped after step 3 and saved with ``trainer.save_checkpoint`` (Lightning's DCP
folder of torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``), then resumed with
``trainer.fit(..., ckpt_path=...)`` in new processes. Compared with an independent single-process
reference (plain model, ``clip_grad_norm_`` over all params, functional Muon + ``torch.optim.AdamW``,
the same schedule): the weights after step 3 and, resumed 2 ranks -> 1 process, after step 6, within
1e-10 relative (measured ~1e-16). Slow tier: resume 2 -> 2 bitwise equal to the uninterrupted run.
Lightning runs are slow to start (~15-20 s each on the 2-core machine), so all of this is slow tier.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS, STOP, SAMPLES = 6, 3, 8
TOL = 1e-10


def _load_example():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_ex_lightning", ROOT / "examples" / "lightning_fsdp2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(ex, steps: int, clip: str = "norm"):
    """Single process, fp64, full batch; the weights after ``steps`` steps (``clip``: torch's
    norm clipping at 1.0, or its value clipping at 0.01)."""
    import torch
    from dmuon.functional import muon as fmuon
    model = ex.tiny_lm(torch.float64)
    ids = ex.dataset(SAMPLES)
    mats = {n: p for n, p in model.named_parameters() if ex.is_muon(n, p)}
    rest = [p for n, p in model.named_parameters() if n not in mats]
    adam = torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01, foreach=False)
    st = fmuon.init({n: p.detach() for n, p in mats.items()})
    for t in range(steps):
        f = ex.lr_factor(t, STEPS)
        model.zero_grad()
        model(ids).backward()
        if clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with torch.no_grad():
            _, st = fmuon.update({n: p.grad for n, p in mats.items()}, st,
                                 {n: p.data for n, p in mats.items()},
                                 fmuon.MuonHParams(lr=0.02 * f), donate=True)
        for g in adam.param_groups:
            g["lr"] = 3e-3 * f
        adam.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _lightning(devices: int, probe: Path, *extra: str):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "NODE_RANK", "LOCAL_WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(ROOT / "examples" / "lightning_fsdp2.py"), "--devices", str(devices),
           "--batch-size", str(SAMPLES // devices), "--samples", str(SAMPLES), "--dtype", "float64",
           "--total-steps", str(STEPS), "--probe-out", str(probe), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          cwd=probe.parent)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    import torch
    return torch.load(probe, weights_only=False)


def _max_rel(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12))
               for k in want)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    run = _lightning(2, out / "part.pt", "--max-steps", str(STOP), "--save", str(out / "ckpt"))
    return out, run


def test_lightning_fsdp2_trains_and_resumes_on_one_process(preempted):
    ex = _load_example()
    out, part = preempted
    assert part["global_step"] == STOP
    assert _max_rel(part["weights"], _reference(ex, STOP)) <= TOL
    assert (out / "ckpt").is_dir()  # Lightning's distributed (DCP) checkpoint
    one = _lightning(1, out / "one.pt", "--resume", str(out / "ckpt"))
    assert one["global_step"] == STEPS and len(one["losses"]) == STEPS - STOP
    assert _max_rel(one["weights"], _reference(ex, STEPS)) <= TOL
    assert one["optimizer"]["num_steps"] == STEPS


def test_lightning_resume_same_topology_bitwise(preempted, tmp_path):
    import torch
    out, _ = preempted
    shutil.copytree(out / "ckpt", tmp_path / "ckpt")
    two = _lightning(2, tmp_path / "two.pt", "--resume", str(tmp_path / "ckpt"))
    full = _lightning(2, tmp_path / "full.pt")
    for k, v in full["weights"].items():
        assert torch.equal(two["weights"][k], v), k
    for n, d in full["optimizer"]["dedicated"].items():
        for k, v in d.items():
            assert torch.equal(two["optimizer"]["dedicated"][n][k], v), (n, k)
    assert full["losses"][STOP:] == two["losses"]


def test_lightning_value_clipping_equals_one_process(tmp_path):
    """``Trainer(gradient_clip_algorithm="value")``: the recipe's ``configure_gradient_clipping``
    clips by value (``dmuon.clip_grad_value_``). Before (a review of the integrations, session
    17): the recipe clipped by norm whatever the algorithm, **silently** (value clipping gave the
    norm-clipped weights, 5.5e-2 from value clipping)."""
    ex = _load_example()
    got = _lightning(2, tmp_path / "value.pt", "--max-steps", str(STOP), "--clip", "0.01",
                     "--clip-algorithm", "value")
    assert _max_rel(got["weights"], _reference(ex, STOP, clip="value")) <= TOL
    assert _max_rel(got["weights"], _reference(ex, STOP)) > 1e-3  # not what norm clipping gives
