"""Issue 24: a dmuon training step on CUDA at the hardware's pace — no allocator churn.

After a few warm-up steps, ten steps of FSDP2 + ``dmuon.Muon`` at default settings (released
gradient buckets; NS eager, or graph-replayed where the buckets' addresses happen to stay put,
as on this small model) and with ``persistent_grad_buffers=True`` (graph-replayed NS) make no
``cudaMalloc`` / ``cudaFree`` (the caching allocator's ``num_device_alloc`` / ``num_device_free``
counters stay put) and keep the reserved size constant. A capture through ``torch.cuda.graph``
(which empties the allocator's cache) or one that recurs as buffer addresses cycle breaks it.
Forward + backward make no synchronizing CUDA call (``torch.cuda.set_sync_debug_mode("error")``):
one per gradient bucket (a host scalar written into a device tensor) made the 1B H200 backward
host-bound, +27 ms.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks

pytestmark = pytest.mark.gpu

WARMUP, STEPS = 3, 10


def _worker(rank, world, persistent):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dmuon
    from models import make_batches, make_model, muon_predicate
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world,))
    model = make_model(dtype=torch.float32, vocab=512, dim=256, heads=4, hidden=1024,
                       n_layers=4).to(device)
    dmuon.dedicate_params(model, mesh, muon_predicate)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = dmuon.Muon(model, lr=0.02, weight_decay=0.01, persistent_grad_buffers=persistent)
    batches = [b.to(device) for b in make_batches(4, batch=8, seq=129, vocab=512)]
    counts, reserved, modes = [], [], []
    for i in range(WARMUP + STEPS):
        opt.zero_grad(set_to_none=True)
        model(batches[i % len(batches)]).backward()
        opt.step()
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats()
        counts.append((st["num_device_alloc"], st["num_device_free"]))
        reserved.append(torch.cuda.memory_reserved())
        modes.append(opt.last_step_stats().ns_mode)
    # forward + backward never block the host (a blocking call makes the step host-bound)
    sync_error = None
    opt.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(batches[0]).backward()
    except RuntimeError as exc:
        sync_error = str(exc)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return dict(counts=counts, reserved=reserved, modes=modes, sync_error=sync_error)


@pytest.mark.parametrize("persistent", [False, True], ids=["released", "persistent"])
def test_no_device_malloc_or_free_after_warmup(persistent):
    res = run_ranks(_worker, 1, persistent, backend="nccl", timeout=120)[0]
    counts, reserved, modes = res["counts"], res["reserved"], res["modes"]
    base = counts[WARMUP - 1]
    per_step = [(a - pa, f - pf) for (a, f), (pa, pf) in zip(counts[WARMUP:], counts[WARMUP - 1:])]
    assert counts[-1] == base, f"cudaMalloc/cudaFree per step after warm-up: {per_step}"
    assert len(set(reserved[WARMUP - 1:])) == 1, f"reserved bytes per step: {reserved}"
    assert res["sync_error"] is None, res["sync_error"]
    if persistent:   # stable buckets: the NS graph is captured once and replayed every step
        assert set(modes[WARMUP:]) == {"graph"}, modes


def _stats():
    st = torch.cuda.memory_stats()
    return st["num_device_alloc"], st["num_device_free"]


def test_engine_inplace_captures_without_churn():
    """``NSEngine.orthogonalize_``: buffers whose addresses cycle (A, B, C, A, ...) stay eager and
    cost no malloc/free after the first round; stable buffers capture at their second call
    without freeing the allocator's cached blocks, then replay."""
    from dmuon.kernels.ns_engine import NSEngine
    torch.manual_seed(0)
    eng = NSEngine()
    sets = [[torch.randn(3, 64, 96, device="cuda"), torch.randn(2, 128, 64, device="cuda")]
            for _ in range(3)]
    for xs in sets:                                   # first round: eager, allocates workspace
        eng.orthogonalize_(xs, batch_dims=1)
    torch.cuda.synchronize()
    before = _stats()
    for i in range(9):
        eng.orthogonalize_(sets[i % 3], batch_dims=1)
        assert eng.last_mode == "eager", i
    torch.cuda.synchronize()
    assert _stats() == before, (before, _stats())
    spare = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del spare                                          # a cached block an empty_cache would free
    stable = [torch.randn(3, 64, 96, device="cuda"), torch.randn(2, 128, 64, device="cuda")]
    frees = _stats()[1]
    ref = [x.clone() for x in stable]
    eng.orthogonalize_(stable, batch_dims=1)           # eager
    eng.orthogonalize_(ref, batch_dims=1)              # another key between: no capture yet
    eng.orthogonalize_(stable, batch_dims=1)
    eng.orthogonalize_(stable, batch_dims=1)           # consecutive: captured, then replayed
    assert eng.last_mode == "graph"
    torch.cuda.synchronize()
    assert _stats()[1] == frees, "the capture handed cached memory back to the driver"
    fresh = [torch.randn_like(x) for x in stable]      # the replay computes NS of new values
    for x, f in zip(stable, fresh):
        x.copy_(f)
    eng.orthogonalize_(stable, batch_dims=1)
    assert eng.last_mode == "graph"
    want = NSEngine(cuda_graphs=False).orthogonalize_([f.clone() for f in fresh], batch_dims=1)
    for got, w in zip(stable, want):
        assert ((got - w).norm() / w.norm()).item() <= 1e-3
