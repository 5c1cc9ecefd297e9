"""Issue 38 on CUDA: ``offload_state=True`` (pinned host momentum, copies on the process's
offload stream ordered by events, each hook group's copy started in backward) is bitwise the
on-device run, for fp32, bf16 and fp8 momentum (and a NorMuon variant's fp8 momentum), with
accumulation and a checkpoint round trip in the run (world 1, NCCL; more GPUs: more ranks); the chunked step's peak memory is lower than one
chunk's, and offload with a capped prefetch keeps the momentum out of the peak (world 1)."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from stateful_harness import distributed_run

from dmuon.functional.variants import normuon

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
BASE = dict(device="cuda", z3=False, accum=2, ckpt=True, batch=8)
CONFIGS = [dict(BASE, id="fp32"),
           dict(BASE, id="fp32_offload", muon_kw=dict(offload_state=True)),
           dict(BASE, id="fp8", muon_kw=dict(momentum_dtype=FP8)),
           dict(BASE, id="bf16", muon_kw=dict(momentum_dtype=torch.bfloat16)),
           dict(BASE, id="bf16_offload", muon_kw=dict(momentum_dtype=torch.bfloat16,
                                                      offload_state=True)),
           dict(BASE, id="fp8_offload", muon_kw=dict(momentum_dtype=FP8, offload_state=True)),
           # a variant's momentum field through the same storage (tests/test_variant_state.py)
           dict(BASE, id="normuon_fp8", muon_kw=dict(transform=normuon(), momentum_dtype=FP8)),
           dict(BASE, id="normuon_fp8_offload", muon_kw=dict(transform=normuon(),
                                                             momentum_dtype=FP8,
                                                             offload_state=True))]


def _worker(rank, world, cfgs):
    return {c["id"]: distributed_run(rank, world, c) for c in cfgs}


def test_offload_is_bitwise_the_on_device_run_on_cuda():
    world = min(torch.cuda.device_count(), 2)
    results = run_ranks(_worker, world, CONFIGS, backend="nccl", timeout=300)
    for rank in range(world):
        for a, b in (("fp32_offload", "fp32"), ("fp8_offload", "fp8"),
                     ("bf16_offload", "bf16"), ("normuon_fp8_offload", "normuon_fp8")):
            x, y = results[rank][a]["sd"], results[rank][b]["sd"]
            assert set(x) == set(y)
            assert all(torch.equal(x[k], y[k]) for k in y), (rank, a, b)
        # and fp8 momentum did change the run (the comparison above is not vacuous)
        x, y = results[rank]["fp8"]["sd"], results[rank]["fp32"]["sd"]
        assert any(not torch.equal(x[k], y[k]) for k in y), rank


MiB = 2**20
DIM, LAYERS, CHUNK = 2048, 8, 32 * MiB  # 16 matrices of 16 MiB (fp32): 256 MiB of momentum


def _mem_worker(rank, world):
    """Per config: the step's own peak above what was allocated before it (transient) and the
    peak of the whole iteration above what was allocated before the model was built, over 3
    iterations (the last two), on a stack of 2048 x 2048
    projections with Newton-Schulz chunked at 16 MiB (so its workspace stays small)."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.kernels.ns_engine import NSEngine
    from dmuon.newton_schulz.config import NSConfig

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.a_proj = nn.Linear(DIM, DIM, bias=False)
            self.b_proj = nn.Linear(DIM, DIM, bias=False)

        def forward(self, x):
            return x + self.b_proj(torch.relu(self.a_proj(self.norm(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = nn.Linear(DIM, 1)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x).square().mean()

    mesh = init_device_mesh("cuda", (world,))
    out = {}
    configs = {"fp32": ({}, None, None), "bf16_one_chunk": ({"momentum_dtype": torch.bfloat16},
                                                          1 << 62, None),
               "bf16": ({"momentum_dtype": torch.bfloat16}, CHUNK, None),
               "offload_capped": ({"offload_state": True}, CHUNK, CHUNK)}
    x = torch.randn(8, 256, DIM, device=dev)
    for key, (kw, chunk, cap) in configs.items():
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()  # what earlier configs may have left
        torch.manual_seed(0)
        model = Net().to(dev)
        dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and "proj" in n)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = dmuon.Muon(model, ns_engine=NSEngine(NSConfig(), max_chunk_bytes=16 * MiB), **kw)
        if chunk is not None:
            opt._storage.chunk_bytes = chunk
        opt._storage.prefetch_bytes = cap
        step_transient, iter_peak = [], []
        for i in range(3):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            opt.zero_grad()
            model(x * (1 + i)).backward()
            torch.cuda.synchronize()
            fb_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            opt.step()
            torch.cuda.synchronize()
            step_transient.append(torch.cuda.max_memory_allocated() - base)
            iter_peak.append(max(fb_peak, torch.cuda.max_memory_allocated()) - start)
        out[key] = {"step_transient": max(step_transient[1:]), "peak": max(iter_peak[1:]),
                    "chunks": opt._storage.last_chunks}
        del model, opt
        torch.cuda.empty_cache()
    return out


def test_chunked_step_and_capped_offload_peaks_on_cuda():
    """bf16 momentum decoded in 32 MiB chunks: the step's transient memory is at least half the
    fp32 momentum (256 MiB) below decoding it in one chunk; offload with the backward's copies
    capped at one chunk: the iteration's peak is the on-device fp32 peak minus the momentum, plus
    a few chunks at most."""
    r = run_ranks(_mem_worker, 1, backend="nccl", timeout=300)[0]
    print({k: {f: (v / MiB if f != "chunks" else v) for f, v in d.items()} for k, d in r.items()})
    momentum = 2 * LAYERS * DIM * DIM * 4
    assert r["bf16"]["chunks"] >= 8 and r["bf16_one_chunk"]["chunks"] == 1
    assert r["bf16"]["step_transient"] <= r["bf16_one_chunk"]["step_transient"] - momentum // 2, r
    assert r["offload_capped"]["peak"] <= r["fp32"]["peak"] - momentum + 4 * CHUNK, r
