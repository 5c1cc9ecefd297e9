"""accelerate's own checkpointing on a dmuon model: ``Accelerator.save_state`` then, in a new
process group, ``Accelerator.load_state`` and the same steps (2 gloo ranks, fp64, a tiny HF Llama,
both file formats). The resumed run equals the uninterrupted one bitwise.

Before (a user-path review of the integrations, session 17): with ``safe_serialization=False``
every rank called ``optimizer.state_dict()`` (dmuon's sharded DTensor dict) but rank 0 alone wrote
it, so at ``load_state`` every rank read rank 0's shards as its own: 28 of 50 optimizer entries
wrong (rank 1's rows of AdamW's moments, owners' momentum) and the resumed run 3.27e-2 off,
**silently**. With safetensors (the default), ``load_state`` raised "Attempted to access the data
pointer on an invalid python storage" from safetensors' shared-tensor search over the model's
DTensor entries. Now ``save_state`` writes dmuon's full, topology-free optimizer dict (as the
Trainer integration does) and ``load_state`` gives safetensors dmuon's full model dict.
"""
from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS, STOP = 6, 3


def _build(world):
    import dmuon
    from hf_tiny import make_hf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    model = make_hf("llama")
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and "proj" in n)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)


def _steps(acc, model, opt, rank, world, idx):
    from hf_tiny import batches
    bs = batches(STEPS)
    for i in idx:
        opt.zero_grad()
        ids = bs[i].chunk(world)[rank]
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()


def _weights(model):
    import dmuon
    return {k: v.clone() for k, v in dmuon.get_model_state_dict(model).items()}


def _worker(rank, world, phase, dirs):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))  # as torchrun sets them
    torch.set_num_threads(1)
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    if phase == "save":
        model, opt = acc.prepare(*_build(world))
        _steps(acc, model, opt, rank, world, range(STOP))
        for safe, d in dirs.items():
            acc.save_state(d, safe_serialization=safe)
        _steps(acc, model, opt, rank, world, range(STOP, STEPS))
        return {"final": _weights(model)}
    out = {}
    for safe, d in dirs.items():  # a new model, optimizer and Accelerator per format
        acc = Accelerator(cpu=True) if out else acc
        model, opt = acc.prepare(*_build(world))
        acc.load_state(d)
        _steps(acc, model, opt, rank, world, range(STOP, STEPS))
        out[safe] = _weights(model)
    return out


def test_accelerate_save_state_then_load_state_resumes_bitwise(tmp_path):
    dirs = {True: str(tmp_path / "safetensors"), False: str(tmp_path / "bin")}
    full = run_ranks(_worker, 2, "save", dirs, timeout=180)
    resumed = run_ranks(_worker, 2, "resume", dirs, timeout=180)
    for rank in range(2):
        for safe in dirs:
            got, want = resumed[rank][safe], full[rank]["final"]
            assert set(got) == set(want)
            worst = max(float((got[k] - want[k]).abs().max()) for k in want)
            assert worst == 0.0, (rank, "safetensors" if safe else "bin", worst)
