"""The seeds' HF ``Trainer`` recipe under ``torchrun`` (2 gloo ranks, tiny Llama), with no extra code.

One run of ``examples/hf_trainer.py`` (5 optimizer steps, each over the whole 8-sample dataset in 2
micro-batches per rank: gradient accumulation 2, clipping at Trainer's default 1.0, a checkpoint per
epoch), then, in this plain process:

* Trainer's logged ``grad_norm`` at every step equals an independent single-process reference
  (``torch.nn.utils.clip_grad_norm_`` over *all* params of a plain model trained with the functional
  Muon + ``torch.optim.AdamW`` and Trainer's linear LR schedule), so clipping covers the dedicated
  matrices; the loss falls;
* the final checkpoint loads with ``LlamaForCausalLM.from_pretrained`` and gives the trained
  distributed model's logits; its weights equal the reference's;
* gradient accumulation issued no reduce on the non-final micro-batches (``model.no_sync``).
Also: the integration hooks are installed on the versions in the venv, and leave plain models alone.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAMPLES, ACCUM = 5, 8, 2


def _load_example():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_ex_hf_trainer", ROOT / "examples" / "hf_trainer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(ex):
    """Single process: full-batch steps with clipping at 1.0 over every param; returns norms, model."""
    import torch
    from dmuon.functional import muon as fmuon
    model = ex.tiny_llama()
    ds = ex.CountingDataset(SAMPLES)
    ids = torch.stack([ds[i]["input_ids"] for i in range(SAMPLES)])
    mats = {n: p for n, p in model.named_parameters()
            if p.ndim == 2 and any(k in n for k in ex.PROJ)}
    rest = [p for n, p in model.named_parameters() if n not in mats]
    adam = torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01, foreach=False)
    st = fmuon.init({n: p.detach() for n, p in mats.items()})
    norms, losses = [], []
    model.train()
    for t in range(STEPS):
        f = (STEPS - t) / STEPS  # Trainer's default linear schedule, no warm-up
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        with torch.no_grad():
            _, st = fmuon.update({n: p.grad for n, p in mats.items()}, st,
                                 {n: p.data for n, p in mats.items()},
                                 fmuon.MuonHParams(lr=0.02 * f), donate=True)
        for g in adam.param_groups:
            g["lr"] = 3e-3 * f
        adam.step()
    return norms, losses, model


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer")
    probe = out / "probe.pt"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "hf_trainer.py"), "--output-dir", str(out / "run"),
           "--samples", str(SAMPLES), "--epochs", str(STEPS), "--grad-accum", str(ACCUM),
           "--probe-out", str(probe)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    import torch
    return torch.load(probe, weights_only=False)


def test_trainer_recipe_clips_saves_and_reloads(trainer_run):
    import torch
    from transformers import LlamaForCausalLM
    ex = _load_example()
    steps = [h for h in trainer_run["log_history"] if "grad_norm" in h]
    assert len(steps) == STEPS, trainer_run["log_history"]
    norms, ref_losses, ref_model = _reference(ex)
    got_norms = [float(h["grad_norm"]) for h in steps]
    for got, want in zip(got_norms, norms):
        assert abs(got - want) <= 1e-4 * want, (got_norms, norms)
    assert norms[0] > 1.0  # clipping really acts at the first step
    losses = [float(h["loss"]) for h in steps]
    assert losses[-1] < losses[0] - 0.2, losses
    assert abs(losses[0] - ref_losses[0]) < 1e-4, (losses, ref_losses)

    # the checkpoint: a plain HF checkpoint, reloaded in this single process
    ckpt = trainer_run["checkpoint"]
    assert ckpt is not None and ckpt.endswith(f"checkpoint-{STEPS}"), ckpt
    reloaded = LlamaForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=ex.probe_batch()).logits
    diff = float((logits - trainer_run["logits"]).abs().max())
    assert diff <= 1e-5, diff
    ref_sd = ref_model.state_dict()
    for k, v in reloaded.state_dict().items():
        err = float((v - ref_sd[k]).abs().max() / ref_sd[k].abs().max().clamp_min(1e-12))
        assert err <= 1e-4, (k, err)

    # gradient accumulation: one reduce per optimizer step, none on the no_sync micro-batches
    assert trainer_run["reduce_collectives"] == STEPS * trainer_run["reduce_ops_per_sync"]


def test_hooks_installed_and_plain_models_untouched():
    import torch
    from accelerate import Accelerator
    from transformers import Trainer

    import dmuon  # noqa: F401
    from dmuon.integrations import install, status
    install()
    install()  # idempotent
    st = status()
    for key in ("Accelerator.prepare_model", "Accelerator.clip_grad_norm_",
                "Accelerator.get_state_dict", "Trainer.save_model"):
        assert st.get(key) == "installed", st
    assert getattr(Accelerator.prepare_model, "_dmuon_wrapped", False)
    assert getattr(Trainer.save_model, "_dmuon_wrapped", False)
    # a plain model goes through the original code (single process: no wrapping, normal clipping)
    acc = Accelerator(cpu=True)
    lin = torch.nn.Linear(3, 2)
    m = acc.prepare_model(lin)
    assert m is lin and getattr(m, "no_sync", None) is None
    lin(torch.ones(1, 3)).sum().backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in lin.parameters()]))
    got = acc.clip_grad_norm_(lin.parameters(), 1e9)
    assert abs(float(got) - float(want)) < 1e-6
    assert set(acc.get_state_dict(m)) == {"weight", "bias"}
