"""Owner NS overlapped with the backward on one GPU (world 1, NCCL): the early updates run on the
side stream and are committed; the result is bitwise the one with every speculation discarded
(recomputed in ``step()``), and bitwise the one without the overlap."""
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
    for overlap, discard in (("off", False), ("on", False), ("on", True)):
        mesh = init_device_mesh("cuda", (world,))
        model = make_model(dtype=torch.float32, n_layers=4).cuda()
        dmuon.dedicate_params(model, mesh, muon_predicate)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = dmuon.Muon(model, lr=0.02)
        opt.set_ns_overlap(overlap)
        for ids in make_batches(4, 4):
            opt.zero_grad()
            model(ids.cuda()).backward()
            if discard:  # every gradient times 1.0 in place: each speculation is discarded
                dmuon.clip_grad_norm_(model, float("inf"))
            opt.step()
        torch.cuda.synchronize()
        leaves = [m.detach().cpu() for m in opt.dedicated_state.owned_masters().values()]
        leaves += [t.detach().cpu() for t in optree.tree_leaves(opt._owner.state)
                   if isinstance(t, torch.Tensor)]
        results[(overlap, discard)] = (leaves, dict(opt.ns_overlap_stats))
    return results


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return run_ranks(_worker, 1, backend="nccl", timeout=180)[0]


def test_ns_overlap_side_stream_and_commit_cuda(runs):
    on, stats = runs[("on", False)]
    assert stats["committed"] > 0 and stats["discarded"] == 0, stats
    assert stats["side_stream"] == stats["launched"], stats  # every early update on the side stream
    rec, rstats = runs[("on", True)]
    assert rstats["committed"] == 0 and rstats["discarded"] > 0, rstats
    assert _same(on, rec)  # the speculation is invisible: committed == recomputed, bit for bit


def test_ns_overlap_bitwise_off_cuda(runs):
    assert _same(runs[("on", False)][0], runs[("off", False)][0])
