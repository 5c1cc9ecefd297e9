"""Issue 38 on CUDA: ``offload_state=True`` (pinned host momentum, copies on the process's
offload stream ordered by events) is bitwise the on-device run, for fp32 and fp8 momentum, with
accumulation and a checkpoint round trip in the run (world 1, NCCL; more GPUs: more ranks)."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from stateful_harness import distributed_run

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
BASE = dict(device="cuda", z3=False, accum=2, ckpt=True, batch=8)
CONFIGS = [dict(BASE, id="fp32"),
           dict(BASE, id="fp32_offload", muon_kw=dict(offload_state=True)),
           dict(BASE, id="fp8", muon_kw=dict(momentum_dtype=FP8)),
           dict(BASE, id="fp8_offload", muon_kw=dict(momentum_dtype=FP8, offload_state=True))]


def _worker(rank, world, cfgs):
    return {c["id"]: distributed_run(rank, world, c) for c in cfgs}


def test_offload_is_bitwise_the_on_device_run_on_cuda():
    world = min(torch.cuda.device_count(), 2)
    results = run_ranks(_worker, world, CONFIGS, backend="nccl", timeout=300)
    for rank in range(world):
        for a, b in (("fp32_offload", "fp32"), ("fp8_offload", "fp8")):
            x, y = results[rank][a]["sd"], results[rank][b]["sd"]
            assert set(x) == set(y)
            assert all(torch.equal(x[k], y[k]) for k in y), (rank, a, b)
        # and fp8 momentum did change the run (the comparison above is not vacuous)
        x, y = results[rank]["fp8"]["sd"], results[rank]["fp32"]["sd"]
        assert any(not torch.equal(x[k], y[k]) for k in y), rank
