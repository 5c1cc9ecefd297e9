"""Tensor parallelism: what dmuon does not support raises a clear error on every rank, in
bounded time, instead of training silently wrong (issue 21; the supported orders are
tests/test_tensor_parallel.py).

4 gloo ranks, a (dp 2, tp 2) mesh: TP applied after ``dedicate_params`` on a mesh over every
rank (materialized and meta-built); a TP-sharded dim that the TP degree does not divide; a
replicated 2-D DTensor; a policy view on a TP matrix; ``data_parallel="ddp"`` with TP;
``collectives="per_bucket"`` with TP; a mesh with
two dims besides dp; a dedicated matrix without TP whose gradient differs across the TP group
(its copies would diverge). After the errors the ranks still meet in a barrier.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import assert_all_ranks, catch, run_ranks
from models import make_batches, make_model, muon_predicate
from test_tensor_parallel import apply_tp


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import dmuon
    from dmuon.functional.matrix_view import Heads
    from dmuon.functional.policy import ParamPolicy, Rule

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    world_mesh = init_device_mesh("cpu", (world,))
    out = {}
    # TP after dedicate_params on a mesh over every rank: the placeholder's first read raises
    m = make_model()
    dmuon.dedicate_params(m, world_mesh, muon_predicate)
    out["B_world_then_tp"] = catch(lambda: apply_tp(m, mesh["tp"]))
    with torch.device("meta"):
        mm = make_model()
    dmuon.dedicate_params(mm, world_mesh, muon_predicate)
    out["B_meta_world_then_tp"] = catch(lambda: apply_tp(mm, mesh["tp"]))
    # a sharded dim the TP degree does not divide
    odd = nn.Sequential(nn.Linear(16, 15, bias=False)).double()
    parallelize_module(odd, mesh["tp"], {"0": ColwiseParallel()})
    out["uneven"] = catch(lambda: dmuon.dedicate_params(odd, mesh["dp"], lambda n, p: True))
    # a replicated 2-D DTensor param
    rep = nn.Sequential(nn.Linear(16, 16, bias=False)).double()
    rep[0].weight = nn.Parameter(distribute_tensor(rep[0].weight.detach(), mesh["tp"],
                                                   [Replicate()]))
    out["replicated"] = catch(lambda: dmuon.dedicate_params(rep, mesh["dp"], lambda n, p: True))
    # a policy view on a TP matrix; DDP with TP
    m = make_model()
    apply_tp(m, mesh["tp"])
    pol = ParamPolicy((Rule("*.q_proj.weight", view=Heads(2, "rows")),))
    out["view"] = catch(lambda: dmuon.dedicate_params(m, mesh["dp"], muon_predicate, policy=pol))
    out["ddp"] = catch(lambda: dmuon.dedicate_params(m, mesh["dp"], muon_predicate,
                                                     data_parallel="ddp"))
    out["per_bucket"] = catch(lambda: dmuon.dedicate_params(m, mesh["dp"], muon_predicate,
                                                            collectives="per_bucket"))
    # two dims besides dp
    m3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    m = make_model()
    apply_tp(m, m3["tp"])
    out["two_dims"] = catch(lambda: dmuon.dedicate_params(m, m3["dp"], muon_predicate))
    # a non-TP dedicated matrix (the root in_proj) whose input differs across the TP group
    m = make_model(root_proj=True)
    apply_tp(m, mesh["tp"])
    dmuon.dedicate_params(m, mesh["dp"], muon_predicate)
    for layer in m.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    opt = dmuon.Muon(m, lr=0.02)
    ids = make_batches(1, 4)[0][rank:rank + 1]  # every rank its own row: the TP ranks differ
    m(ids).backward()
    out["diverging"] = catch(lambda: opt.step())
    # the same matrix, equal inputs on every rank, but a NaN in its gradient on one TP index's
    # owner only (a MAX all-reduce may drop the NaN: the copies would diverge silently)
    m = make_model(root_proj=True)
    apply_tp(m, mesh["tp"])
    dmuon.dedicate_params(m, mesh["dp"], muon_predicate)
    for layer in m.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    opt = dmuon.Muon(m, lr=0.02, check_finite=False)
    m(make_batches(1, 4)[0][:1]).backward()
    rt = opt.dedicated_state
    if mesh["tp"].get_local_rank() == 1 and "in_proj.weight" in rt.owned_names:
        rt.reduced_grads()["in_proj.weight"].view(-1)[0] = float("nan")
    out["nan_one_tp_rank"] = catch(lambda: opt.step())
    dist.barrier()
    out["barrier"] = True
    return out


@pytest.mark.slow  # the default tier's 600 s budget (issue 46's tests); the slow tier runs it
def test_tensor_parallel_unsupported_raises_on_every_rank():
    res = run_ranks(_worker, 4, timeout=120)
    for key in ("B_world_then_tp", "B_meta_world_then_tp"):
        assert_all_ranks(res, key, "TensorParallelUnsupported", "after dedicate_params",
                         "layers.0.self_attn.q_proj.weight", "apply tensor parallelism first")
    assert_all_ranks(res, "uneven", "TensorParallelUnsupported", "not divisible by the TP degree")
    assert_all_ranks(res, "replicated", "TensorParallelUnsupported", "not a row- or column-sharded")
    assert_all_ranks(res, "view", "TensorParallelUnsupported", "default view", "heads(2,rows)")
    assert_all_ranks(res, "ddp", "TensorParallelUnsupported", "data_parallel='ddp'")
    assert_all_ranks(res, "per_bucket", "NotImplementedError", "collectives='per_bucket'",
                     "tensor parallelism", "'per_owner' or 'auto'")
    assert_all_ranks(res, "two_dims", "ValueError", "TP index", "context parallel")
    assert_all_ranks(res, "diverging", "TensorParallelUnsupported", "different gradients",
                     "Nothing was updated")
    assert_all_ranks(res, "nan_one_tp_rank", "TensorParallelUnsupported", "different gradients")
    assert all(r["barrier"] for r in res)
