"""Owner NS overlapped with the backward on one GPU (world 1, NCCL): the early updates run on the
side stream (a CUDA graph per group, replayed while its key recurs) and are committed; the result
is bitwise the one with every speculation discarded (recomputed in ``step()``), and bitwise the one
without the overlap, with constant hyper-parameters and with an lr changed at every step."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks

pytestmark = pytest.mark.gpu


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import optree
    import dmuon
    from models import make_batches, make_model, muon_predicate

    torch.cuda.set_device(0)
    results = {}
    for overlap, discard, lrs in (("off", False, False), ("on", False, False), ("on", True, False),
                                  ("off", False, True), ("on", False, True)):
        mesh = init_device_mesh("cuda", (world,))
        model = make_model(dtype=torch.float32, n_layers=4).cuda()
        dmuon.dedicate_params(model, mesh, muon_predicate)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = dmuon.Muon(model, lr=0.02)
        opt.set_ns_overlap(overlap)
        for i, ids in enumerate(make_batches(4, 4)):
            if lrs:  # an lr schedule: the early update reads the step, so it is never replayed
                for group in opt.param_groups:
                    group["lr"] = 0.02 * (1 - 0.1 * i)
            opt.zero_grad()
            model(ids.cuda()).backward()
            if discard:  # every gradient times 1.0 in place: each speculation is discarded
                dmuon.clip_grad_norm_(model, float("inf"))
            opt.step()
        torch.cuda.synchronize()
        leaves = [m.detach().cpu() for m in opt.dedicated_state.owned_masters().values()]
        leaves += [t.detach().cpu() for t in optree.tree_leaves(opt._owner.state)
                   if isinstance(t, torch.Tensor)]
        results[(overlap, discard, lrs)] = (leaves, dict(opt.ns_overlap_stats))
    return results


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return run_ranks(_worker, 1, backend="nccl", timeout=180)[0]


def test_ns_overlap_side_stream_and_commit_cuda(runs):
    on, stats = runs[("on", False, False)]
    assert stats["committed"] > 0 and stats["discarded"] == 0, stats
    assert stats["side_stream"] == stats["launched"], stats  # every early update on the side stream
    # constant hyper-parameters: each group's update captured at its second step, then replayed
    assert 0 < stats["replayed"] < stats["launched"], stats
    rec, rstats = runs[("on", True, False)]
    assert rstats["committed"] == 0 and rstats["discarded"] > 0, rstats
    assert _same(on, rec)  # the speculation is invisible: committed == recomputed, bit for bit


def test_ns_overlap_bitwise_off_cuda(runs):
    assert _same(runs[("on", False, False)][0], runs[("off", False, False)][0])


def test_ns_overlap_lr_schedule_cuda(runs):
    """lr changed before every step: committed, never replayed (a graph would bake the old lr),
    and bitwise the run without the overlap."""
    on, stats = runs[("on", False, True)]
    assert stats["committed"] > 0 and stats["replayed"] == 0, stats
    assert _same(on, runs[("off", False, True)][0])
