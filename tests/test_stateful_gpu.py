"""The stateful layer on CUDA + NCCL (lane streams, events): same equality as on gloo.

Runs on as many GPUs as present (1, 2 or 4 ranks); skipped on machines without CUDA."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from stateful_harness import distributed_run, max_rel_err, reference_run

pytestmark = pytest.mark.gpu

CONFIGS = [
    dict(id="z3", device="cuda", clip=0.5, batch=4),
    dict(id="z2_accum_ckpt", device="cuda", z3=False, accum=2, ckpt=True, batch=8),
    dict(id="mp_bf16", device="cuda", dtype=torch.float32, mp="fsdp", batch=4),
]


def _worker(rank, world, cfgs):
    return {c["id"]: distributed_run(rank, world, c) for c in cfgs}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_equality_cuda(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    cfgs = list(CONFIGS)
    if world == 4:
        cfgs.append(dict(id="hsdp", device="cuda", hsdp=True, batch=8))
    results = run_ranks(_worker, world, cfgs, backend="nccl", timeout=180)
    for cfg in cfgs:
        ref = reference_run({k: v for k, v in cfg.items() if k != "device"})
        for rank in range(world):
            res = results[rank][cfg["id"]]
            err, where = max_rel_err(res["sd"], ref["sd"])
            tol = 0.1 if cfg.get("mp") else 1e-10
            assert err <= tol, (cfg["id"], rank, err, where)
            if cfg.get("clip"):
                for a, b in zip(res["norms"], ref["norms"]):
                    assert abs(a - b) <= 1e-10 * abs(b)
