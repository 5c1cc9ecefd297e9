"""The CUDA path at world 2 and 4 on the one GPU (issue 39): dmuon's ranks as threads of one
process on torch's multi-threaded process group, made stream-correct (``tests/threaded_world.py``
says why this and not NCCL, gloo or a fake group, and what it does not cover).

What runs on the GPU, each equal to the single-process fp64 reference as ``test_stateful_gpu.py``
requires of NCCL: the executor's lane streams and events (Z3 with clipping, Z2 with gradient
accumulation and activation checkpointing, bf16 mixed precision), the NS engine's CUDA-graph
replay on persistent gradient buckets (its owners' last steps report ``ns_mode == "graph"``),
and at world 4 the HSDP (2 x 2) publish. ``test_threaded_world.py`` runs the same configurations
on CPU threads (the harness checked against the reference where CI can run it).

The lead runs it on the H200::

    python -m pytest -q -m gpu tests/test_world_gpu_threads.py
"""
from __future__ import annotations

import pytest
import torch

import stateful_harness
from stateful_harness import distributed_run, max_rel_err, reference_run
from threaded_world import run_threads, serialized

pytestmark = pytest.mark.gpu

# each rank-thread builds its model with the global RNG seeded: one at a time
stateful_harness.make_model = serialized(stateful_harness.make_model)


def configs(device: str, world: int) -> list[dict]:
    cfgs = [
        dict(id="z3", device=device, clip=0.5, batch=4),
        dict(id="z2_accum_ckpt", device=device, z3=False, accum=2, ckpt=True, batch=8),
        dict(id="mp_bf16", device=device, dtype=torch.float32, mp="fsdp", batch=4),
        dict(id="graph", device=device, batch=4, ns_modes=True,
             muon_kw=dict(persistent_grad_buffers=True)),
        # the sharded style: its in-place all-gather and all-to-all refresh on the lane streams
        dict(id="sharded", device=device, batch=4, dedicate_kw={"collectives": "sharded"}),
    ]
    if world == 4:
        cfgs.append(dict(id="hsdp", device=device, hsdp=True, batch=8, ns_modes=True))
        cfgs.append(dict(id="hsdp_sharded", device=device, hsdp=True, batch=8,
                         dedicate_kw={"collectives": "sharded"}))
        # split Newton-Schulz (issue 35): its explicit-group gathers / scatters on the lane streams
        cfgs.append(dict(id="split", device=device, steps=2, batch=8,
                         dedicate_kw={"split_ns": dict(SPLIT_FORCE)}))
    return cfgs


#: matrices of the harness model split over 3, 2 and 4 ranks (as ``tests/test_split_exec.py``)
SPLIT_FORCE = {"layers.0.mlp.gate_proj.weight": 3, "layers.1.mlp.down_proj.weight": 2,
               "layers.0.self_attn.q_proj.weight": 4}


def _worker(rank: int, world: int, cfgs: list) -> dict:
    return {c["id"]: distributed_run(rank, world, c) for c in cfgs}


def check(world: int, device: str) -> dict:
    """Run every configuration on ``world`` thread-ranks; assert each equals the reference."""
    cfgs = configs(device, world)
    results = run_threads(_worker, world, cfgs, device=device, timeout=600)
    for cfg in cfgs:
        ref = reference_run({k: v for k, v in cfg.items()
                             if k not in ("device", "ns_modes", "muon_kw")})
        for rank in range(world):
            res = results[rank][cfg["id"]]
            err, where = max_rel_err(res["sd"], ref["sd"])
            tol = 0.1 if cfg.get("mp") else 1e-10
            assert err <= tol, (cfg["id"], rank, err, where)
            for a, b in zip(res["norms"], ref["norms"]):
                assert abs(a - b) <= 1e-10 * abs(b), (cfg["id"], rank, a, b)
            if cfg["id"] == "split":  # the split units ran, their bytes as the program says
                assert res["split_units"] == sorted(SPLIT_FORCE), (rank, res["split_units"])
                want = res["program_counters"]["split"]
                assert res["counters"]["split"] == {k: cfg["steps"] * v for k, v in want.items()}
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_cuda_path_at_world_2_and_4_on_one_gpu(world):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    results = check(world, "cuda")
    for rank in range(world):
        res = results[rank]["graph"]
        if res["owned"]:  # an owner's NS replays its CUDA graph once the buckets stay put
            assert res["ns_modes"][-1] == "graph", (rank, res["ns_modes"])
