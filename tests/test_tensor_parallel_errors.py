"""Tensor parallelism is not supported yet (issue 21): every way of combining DTensor TP with
dmuon raises a clear error on every rank, in bounded time, instead of training silently wrong.

4 gloo ranks, a (dp 2, tp 2) mesh, torch's ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` on the blocks' projections: order A (TP, then ``dedicate_params(model,
mesh["dp"])``; also with a predicate that picks only non-TP matrices), order B (``dedicate_params``
first on ``mesh["dp"]``, or on a mesh over every rank and then TP; a materialized and a meta-built
model), a 3-D ``(replicate, shard, tp)`` mesh. After the errors the ranks still meet in a barrier
(no rank was left inside a collective).
"""
from __future__ import annotations

import torch

from dist_utils import assert_all_ranks, catch, run_ranks
from models import make_model, muon_predicate

TP_PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
           "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col",
           "mlp.down_proj": "row"}


def _tp(model, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN.items()}
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, plan)


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    world_mesh = init_device_mesh("cpu", (world,))
    out = {}
    # order A: TP, then dedicate_params on the dp mesh
    m = make_model()
    _tp(m, mesh["tp"])
    out["A_dtensor"] = catch(lambda: dmuon.dedicate_params(m, mesh["dp"], muon_predicate))
    out["A_non_tp_only"] = catch(lambda: dmuon.dedicate_params(
        m, mesh["dp"], lambda n, p: n == "lm_head.weight"))
    # order B: dedicate_params first
    out["B_dp_mesh"] = catch(lambda: dmuon.dedicate_params(make_model(), mesh["dp"],
                                                           muon_predicate))
    m = make_model()
    dmuon.dedicate_params(m, world_mesh, muon_predicate)
    out["B_then_tp"] = catch(lambda: _tp(m, mesh["tp"]))
    with torch.device("meta"):
        mm = make_model()
    dmuon.dedicate_params(mm, world_mesh, muon_predicate)
    out["B_meta_then_tp"] = catch(lambda: _tp(mm, mesh["tp"]))
    # a 3-D (replicate, shard, tp) mesh
    m3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    out["3d"] = catch(lambda: dmuon.dedicate_params(make_model(), m3["shard"], muon_predicate,
                                                     replicate_mesh=m3["replicate"]))
    dist.barrier()
    out["barrier"] = True
    return out


def test_tensor_parallel_raises_on_every_rank():
    res = run_ranks(_worker, 4)
    assert_all_ranks(res, "A_dtensor", "TensorParallelUnsupported", "is a DTensor",
                     "tensor parallelism", "tp = 1")
    assert_all_ranks(res, "A_non_tp_only", "ValueError", "Tensor / context / pipeline", "tp = 1")
    assert_all_ranks(res, "B_dp_mesh", "ValueError", "Tensor / context / pipeline", "tp = 1")
    for key in ("B_then_tp", "B_meta_then_tp"):
        assert_all_ranks(res, key, "TensorParallelUnsupported", "after dedicate_params",
                         "layers.0.self_attn.q_proj.weight", "tp = 1")
    assert_all_ranks(res, "3d", "ValueError", "tensor parallel")
    assert all(r["barrier"] for r in res)
