"""HF ``Trainer`` on a DDP-mode dmuon model (2 gloo ranks, ``use_cpu=True``, no ``fsdp=``).

``dedicate_params(..., data_parallel="ddp")`` -> ``dmuon.Muon`` -> ``Trainer(optimizers=(opt, None))``:
Trainer (Accelerate) wraps the model in ``DistributedDataParallel`` itself, which skips the
dedicated matrices. 5 optimizer steps over the 8-sample dataset (2 micro-batches per rank:
gradient accumulation through DDP's ``no_sync``), clipping at Trainer's default 1.0. Checked against
the single-process reference of ``test_recipes_trainer`` (functional Muon + ``torch.optim.AdamW``,
Trainer's linear schedule): logged grad norms and final weights; both ranks' weights bit-identical;
Accelerate really wrapped the model in DDP; the non-final micro-batches moved no dedicated bytes.
Slow tier (~25 s on an idle 2-core machine: spawn + transformers import + the reference).
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dist_utils import run_ranks  # noqa: E402
from test_recipes_trainer import ACCUM, SAMPLES, STEPS, _load_example, _reference  # noqa: E402


def _worker(rank, world, out_dir):
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Trainer, TrainingArguments

    import dmuon

    # what torchrun gives each process (Accelerate reads it to pick MULTI_CPU, i.e. DDP)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    ex = _load_example()
    model = ex.tiny_llama()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)),
                          lambda n, p: p.ndim == 2 and any(k in n for k in ex.PROJ),
                          data_parallel="ddp")
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2,
                             gradient_accumulation_steps=ACCUM, num_train_epochs=STEPS,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=ex.CountingDataset(SAMPLES),
                      optimizers=(optimizer, None))
    trainer.train()
    rt = optimizer.dedicated_state
    return {"log_history": trainer.state.log_history,
            "sd": dmuon.get_model_state_dict(model, cpu_offload=True),
            "wrapped": type(trainer.model_wrapped).__name__,
            "collectives": rt.executor.counters()["replicate"]["collectives"],
            "per_step": sum(1 for g in rt.groups.values()
                            for op in list(g.phases.reduce) + list(g.phases.publish)
                            if op.lane == "replicate")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, 2, str(tmp_path_factory.mktemp("ddp_trainer")), timeout=240)


@pytest.mark.slow
def test_trainer_ddp_equals_single_process(results):
    import torch

    ex = _load_example()
    norms, ref_losses, ref_model = _reference(ex)
    ref_sd = ref_model.state_dict()
    for rank, res in enumerate(results):
        got = [float(h["grad_norm"]) for h in res["log_history"] if "grad_norm" in h]
        assert len(got) == STEPS
        for g, w in zip(got, norms):
            assert abs(g - w) <= 1e-4 * w, (got, norms)
        for k, v in res["sd"].items():
            err = float((v - ref_sd[k]).abs().max() / ref_sd[k].abs().max().clamp_min(1e-12))
            assert err <= 1e-4, (k, err)
        assert all(torch.equal(v, results[0]["sd"][k]) for k, v in res["sd"].items())
        assert res["wrapped"] == "DistributedDataParallel", res["wrapped"]
        # accumulation through DDP's no_sync: one reduce + publish per optimizer step, none on
        # the first micro-batch of each
        assert res["collectives"] == STEPS * res["per_step"] > 0, res
