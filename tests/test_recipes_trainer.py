"""The seeds' HF ``Trainer`` recipe under ``torchrun`` (2 gloo ranks, tiny Llama, fp64), no extra code.

A 6-step schedule (each step over the whole 8-sample dataset in 2 micro-batches per rank: gradient
accumulation 2, clipping at Trainer's default 1.0, Trainer's linear LR schedule) is preempted after
step 3 (a checkpoint there), then, in new processes, resumed with
``trainer.train(resume_from_checkpoint=...)``. Checked in this plain process against an independent
single-process reference (``torch.nn.utils.clip_grad_norm_`` over *all* params of a plain model trained
with the functional Muon + ``torch.optim.AdamW`` and the same schedule), fp64:

* Trainer's logged ``grad_norm`` at every step equals the reference (clipping covers the dedicated
  matrices); the loss falls;
* checkpoint-3 loads with ``LlamaForCausalLM.from_pretrained`` and gives the distributed model's
  logits; gradient accumulation issued no reduce on the no_sync micro-batches;
* the ``dmuon_*`` telemetry entries are in the training logs, equal to the ranks' own
  ``last_step_stats()``;
* resume 2 ranks -> 1 process (global batch kept): steps 4-6 and the final weights equal the
  reference (≤ 1e-10 relative, measured ~1e-16); slow tier: resume 2 -> 2 in a new process group is
  bitwise equal to the uninterrupted 2-rank run.
Also: the seeds' ``TrainingArguments`` (no ``use_cpu``) under 2 CPU ranks raise on every rank
instead of training every rank alone on the same batches (so does a plain ``Accelerator()``'s
``prepare_model``); the hooks leave plain models alone.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import assert_all_ranks, catch, run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
STEPS, STOP, SAMPLES, ACCUM = 6, 3, 8, 2
TOL = 1e-10


def _load_example():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_ex_hf_trainer", ROOT / "examples" / "hf_trainer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(ex):
    """Single process, fp64: full-batch steps, clipping at 1.0 over every param; norms, losses, model."""
    import torch
    from dmuon.functional import muon as fmuon
    model = ex.tiny_llama().double()
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


def _torchrun(nproc: int, out: Path, probe: Path, *extra: str):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), str(ROOT / "examples" / "hf_trainer.py"), "--output-dir", str(out),
           "--samples", str(SAMPLES), "--epochs", str(STEPS), "--dtype", "float64",
           "--save-steps", str(STOP), "--probe-out", str(probe), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    import torch
    return torch.load(probe, weights_only=False)


@pytest.fixture(scope="module")
def ref():
    return _reference(_load_example())


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """2 ranks: the 6-step schedule, stopped (and saved) after step 3."""
    out = tmp_path_factory.mktemp("trainer")
    run = _torchrun(2, out / "run", out / "part.pt", "--grad-accum", str(ACCUM),
                    "--stop-after", str(STOP))
    return out, run


def _steps(run):
    return [h for h in run["log_history"] if "grad_norm" in h]


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _check_against_reference(run, ref, first: int, last: int):
    norms, losses, _ = ref
    steps = _steps(run)
    assert [h["step"] for h in steps] == list(range(1, last + 1)), run["log_history"]
    for h in steps[first - 1:]:
        t = h["step"] - 1
        assert abs(h["grad_norm"] - norms[t]) <= TOL * norms[t], (t, h, norms)
        assert abs(h["loss"] - losses[t]) <= 1e-6, (t, h, losses)  # Trainer logs fp32 losses


def test_trainer_recipe_clips_saves_and_reloads(preempted, ref):
    import torch
    from transformers import LlamaForCausalLM
    out, run = preempted
    _check_against_reference(run, ref, 1, STOP)
    assert ref[0][0] > 1.0  # clipping really acts at the first step
    losses = [h["loss"] for h in _steps(run)]
    assert losses[-1] < losses[0] - 0.2, losses

    # the checkpoint: a plain HF checkpoint, reloaded in this single process
    ckpt = run["checkpoint"]
    assert ckpt is not None and ckpt.endswith(f"checkpoint-{STOP}"), ckpt
    reloaded = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=_load_example().probe_batch()).logits
    assert float((logits - run["logits"]).abs().max()) <= 1e-12
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, run["weights"][k]), k

    # the routing table, logged once: every param, the Muon ones with their view and owner
    (table,) = run["routing_log"]
    assert table.startswith("dmuon routing:") and "model.layers.0.self_attn.q_proj.weight" in table
    assert "model.embed_tokens.weight" in table and " adamw " in table

    # gradient accumulation: one reduce per optimizer step, none on the no_sync micro-batches
    assert run["reduce_collectives"] == STOP * run["reduce_ops_per_sync"]

    # telemetry in Trainer's logs: the last step's entries are the ranks' own last_step_stats()
    last, stats = _steps(run)[-1], run["step_stats"]
    ns = [s["ns_ms"] or 0.0 for s in stats]
    owned = [s["owned_elements"] for s in stats]
    assert last["dmuon_ns_ms"] == max(ns) > 0
    assert last["dmuon_comm_bytes"] == max(s["payload_bytes"] for s in stats) > 0
    assert abs(last["dmuon_ns_imbalance"] - max(ns) / (sum(ns) / 2)) < 1e-12
    assert abs(last["dmuon_owned_imbalance"] - max(owned) / (sum(owned) / 2)) < 1e-12
    assert all("dmuon_ns_ms" in h for h in _steps(run)), run["log_history"]


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_trainer_resume_on_one_process(preempted, ref):
    """2 ranks -> 1 process, global batch kept (4 per micro-batch): Trainer's own resume."""
    import torch
    out, _ = preempted
    shutil.copytree(out / "run", out / "one")
    run = _torchrun(1, out / "one", out / "one.pt", "--grad-accum", str(ACCUM),
                    "--batch-size", "4", "--resume", "last")
    _check_against_reference(run, ref, STOP + 1, STEPS)
    want = ref[2].state_dict()
    assert set(run["weights"]) == set(want)
    errs = {k: _rel(v, want[k]) for k, v in run["weights"].items()}
    assert max(errs.values()) <= TOL, errs
    assert run["optimizer"]["num_steps"] == STEPS


@pytest.mark.slow
def test_trainer_resume_same_topology_bitwise(preempted, tmp_path):
    """2 -> 2 in a new process group equals the uninterrupted 2-rank run bit for bit."""
    import torch
    out, _ = preempted
    shutil.copytree(out / "run", tmp_path / "two")
    resumed = _torchrun(2, tmp_path / "two", tmp_path / "two.pt", "--grad-accum", str(ACCUM),
                        "--resume", "last")
    full = _torchrun(2, tmp_path / "full", tmp_path / "full.pt", "--grad-accum", str(ACCUM))
    assert set(resumed["weights"]) == set(full["weights"])
    for k, v in full["weights"].items():
        assert torch.equal(resumed["weights"][k], v), k
    for a, b in zip(_steps(full), _steps(resumed)):
        assert a["grad_norm"] == b["grad_norm"] and a["loss"] == b["loss"], (a, b)
    fo, ro = full["optimizer"], resumed["optimizer"]
    for n, d in fo["dedicated"].items():
        for k, v in d.items():
            assert torch.equal(ro["dedicated"][n][k], v), (n, k)


def _dmuon_tiny_llama(ex, world):
    """The example's tiny Llama (fp64), dedicated and fully_shard-ed over ``world`` CPU ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    mesh = init_device_mesh("cpu", (world,))
    model = ex.tiny_llama().double()
    dmuon.dedicate_params(model, mesh,
                          predicate=lambda n, p: p.ndim == 2 and any(k in n for k in ex.PROJ))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _seeds_args_worker(rank, world, out_dir):
    """The seeds' TrainingArguments verbatim (no use_cpu) on 2 CPU ranks."""
    import torch
    from transformers import Trainer, TrainingArguments

    import dmuon
    ex = _load_example()
    model = _dmuon_tiny_llama(ex, world)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    training_args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2,
                                      num_train_epochs=1, fsdp="", report_to=[])
    trainer = Trainer(model=model, args=training_args, train_dataset=ex.CountingDataset(4),
                      optimizers=(optimizer, None))
    from accelerate import Accelerator
    return {"train": catch(trainer.train), "steps": int(trainer.state.global_step),
            "accelerate": catch(lambda: Accelerator().prepare_model(model)),
            "weights_unchanged": torch.equal(dmuon.get_model_state_dict(model)["lm_head.weight"],
                                             ex.tiny_llama().double().lm_head.weight.detach())}


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_seeds_arguments_on_cpu_ranks_raise(tmp_path):
    """Before: each rank trained alone on all 4 samples (2 steps each, identical batches), both
    writing checkpoints as process 0. Now: ValueError naming use_cpu=True, on every rank, before
    any step."""
    res = run_ranks(_seeds_args_worker, 2, str(tmp_path / "o"), timeout=120)
    assert_all_ranks(res, "train", "ValueError", "use_cpu=True", "2 ranks", "same batches")
    assert_all_ranks(res, "accelerate", "ValueError", "Accelerator(cpu=True)", "1 process")
    assert all(r["steps"] == 0 and r["weights_unchanged"] for r in res), res


def _other_optimizer_worker(rank, world, out_dir):
    """A dmuon model in a Trainer (use_cpu=True, as under torchrun) without dmuon.Muon: Trainer
    building its own optimizer (its default optim), or a torch optimizer passed in."""
    import os

    import torch
    from transformers import Trainer, TrainingArguments

    import dmuon  # noqa: F401 - installs the Trainer hooks
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))  # as torchrun sets them
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    ex = _load_example()
    model = _dmuon_tiny_llama(ex, world)
    out = {}
    for key, opts in (("trainer_builds", (None, None)),
                      ("torch_adamw", (torch.optim.AdamW(model.parameters()), None))):
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, use_cpu=True,
                                 num_train_epochs=1, report_to=[])
        trainer = Trainer(model=model, args=args, train_dataset=ex.CountingDataset(4),
                          optimizers=opts)
        out[key] = catch(trainer.train)
        out[key + "_steps"] = int(trainer.state.global_step)
    return out


@pytest.mark.slow
def test_an_optimizer_other_than_dmuon_muon_raises_on_every_rank_before_any_step(tmp_path):
    """Session 13 (a user-path review): before, the optimizer's first step raised a
    DedicatedParamError about a placeholder, pointing at dmuon.Muon but not at Trainer's
    ``optimizers=`` argument."""
    res = run_ranks(_other_optimizer_worker, 2, str(tmp_path / "o"), timeout=120)
    assert_all_ranks(res, "trainer_builds", "ValueError", "optimizers=(optimizer, None)",
                     "is a AdamW")
    assert_all_ranks(res, "torch_adamw", "ValueError", "optimizers=(optimizer, None)")
    assert all(r["trainer_builds_steps"] == 0 and r["torch_adamw_steps"] == 0 for r in res), res


def test_telemetry_entries_math():
    from dmuon.integrations.hf_telemetry import telemetry_entries
    a = {"ns_ms": 3.0, "payload_bytes": 100, "owned_elements": 30}
    b = {"ns_ms": None, "payload_bytes": 120, "owned_elements": 10}
    assert telemetry_entries([a, b]) == {"dmuon_ns_ms": 3.0, "dmuon_comm_bytes": 120.0,
                                         "dmuon_ns_imbalance": 2.0, "dmuon_owned_imbalance": 1.5}
    assert telemetry_entries([a, None]) == {}
    zero = {"ns_ms": 0.0, "payload_bytes": 0, "owned_elements": 0}
    assert telemetry_entries([zero]) == {"dmuon_ns_ms": 0.0, "dmuon_comm_bytes": 0.0}


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
                "Accelerator.get_state_dict", "Trainer.save_model", "Trainer.train",
                "Trainer.log", "Trainer._save_optimizer_and_scheduler", "Trainer.create_optimizer"):
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
