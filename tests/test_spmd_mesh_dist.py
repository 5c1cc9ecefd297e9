"""``dedicate_params`` on a full SPMD mesh with ``dp_mesh_dims`` (torch's
``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(...))``, torchtitan 0.3's default way of
applying FSDP2): every param a DTensor on the whole mesh (data-parallel axes and a TP axis), the
data-parallel shard / replicate axes taken from the names, not from the mesh's dims or rank count.
fp64 gloo runs equal one process (functional Muon + torch AdamW on the full batch) to <= 1e-10.

- 4 ranks, a 2-D ``(dp_shard 2, tp 2)`` mesh, ``dp_mesh_dims`` naming only the shard axis (the
  TP axis is no replicate axis): TP-sliced dedicated matrices; TP, then ``dedicate_params``.
- 4 ranks, ``(dp_replicate 2, dp_shard 2)``, shard + replicate named (HSDP), in the seeds' order
  (``dedicate_params``, then the params become DTensors, then ``fully_shard``).
- 2 ranks, ``(dp_shard 2, tp 1)``: a TP axis of size 1.
- ``fully_shard`` with ``dp_mesh_dims`` while ``dedicate_params`` got none: a clear error on every
  rank at ``dmuon.Muon``.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from spmd_models import distribute_spmd, make_spmd_model, spmd_predicate
from stateful_harness import HP, max_rel_err, reference_train
from models import make_batches

try:
    from torch.distributed.fsdp import DataParallelMeshDims  # noqa: F401
    HAS_DIMS = True
except ImportError:  # torch < 2.13
    HAS_DIMS = False

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not HAS_DIMS, reason="this torch's fully_shard has no dp_mesh_dims")]

STEPS, BATCH = 3, 4


def _train(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

    import dmuon

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", cfg["shape"], mesh_dim_names=cfg["names"])
    dims = DataParallelMeshDims(shard=cfg["shard"], replicate=cfg.get("replicate"))
    tp = cfg.get("tp")
    model = make_spmd_model()
    kw = {} if cfg.get("no_dims") else {"options": dmuon.DedicateOptions(dp_mesh_dims=dims)}
    if cfg.get("no_dims"):  # the 1-D shard mesh, as before dp_mesh_dims: refused with the fix
        try:
            distribute_spmd(model, mesh, tp)
            dmuon.dedicate_params(model, mesh[cfg["shard"]], spmd_predicate)
        except Exception as e:  # noqa: BLE001 - the result
            return {"error": f"{type(e).__name__}: {e}"}
        return {"error": None}
    if cfg.get("order") == "seeds":  # dedicate_params, then the DTensors, then fully_shard
        owners = dmuon.dedicate_params(model, mesh, spmd_predicate, **kw)
        distribute_spmd(model, mesh, tp)
    else:  # the params DTensors on the full mesh first (TP applied), then dedicate_params
        distribute_spmd(model, mesh, tp)
        owners = dmuon.dedicate_params(model, mesh, spmd_predicate, **kw)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    opt = dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                     weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                     ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"],
                     adamw_betas=HP["adamw_betas"], adamw_eps=HP["adamw_eps"],
                     adamw_weight_decay=HP["adamw_weight_decay"])
    dp_names = [n for n in cfg["names"] if n != tp]
    dp_index, stride = 0, 1
    for n in reversed(dp_names):  # this rank's data-parallel index, row-major over the dp axes
        dp_index += mesh[n].get_local_rank() * stride
        stride *= mesh[n].size()
    for ids in make_batches(STEPS, BATCH):
        opt.zero_grad()
        model(ids.chunk(stride)[dp_index]).backward()
        opt.step()
    sd = dmuon.get_model_state_dict(model, cpu_offload=True)
    rt = opt.dedicated_state
    dist.barrier()
    return {"sd": sd, "n_dedicated": len(rt.names), "tp_names": sorted(rt.tp_layouts),
            "G": rt.G, "R": rt.R, "deferred": owners == {}}


def _reference() -> dict:
    return reference_train(make_spmd_model(), make_batches(STEPS, BATCH), {})["sd"]


def _check(res: list, ref: dict) -> None:
    for r, out in enumerate(res):
        err, where = max_rel_err(out["sd"], ref)
        assert err <= 1e-10, (r, err, where)
        assert out["n_dedicated"] == 4, out["n_dedicated"]


def test_tp_axis_shard_only():
    """(dp_shard 2, tp 2), dp_mesh_dims(shard='dp_shard'): G = 2, R = 1 (the TP axis is not a
    replicate axis, as '2-D mesh = HSDP' would take it), the four matrices TP-sliced."""
    cfg = dict(shape=(2, 2), names=("dp_shard", "tp"), shard="dp_shard", tp="tp")
    res = run_ranks(_train, 4, cfg, timeout=120)
    assert (res[0]["G"], res[0]["R"]) == (2, 1)
    assert len(res[0]["tp_names"]) == 4
    _check(res, _reference())


def test_shard_and_replicate_seeds_order():
    """(dp_replicate 2, dp_shard 2), shard + replicate named; dedicate_params before the params
    become DTensors (deferred to dmuon.Muon)."""
    cfg = dict(shape=(2, 2), names=("dp_replicate", "dp_shard"), shard="dp_shard",
               replicate="dp_replicate", order="seeds")
    res = run_ranks(_train, 4, cfg, timeout=120)
    assert (res[0]["G"], res[0]["R"]) == (2, 2) and res[0]["deferred"]
    _check(res, _reference())


def test_size_one_tp_axis_two_ranks():
    cfg = dict(shape=(2, 1), names=("dp_shard", "tp"), shard="dp_shard", tp="tp")
    res = run_ranks(_train, 2, cfg, timeout=120)
    assert (res[0]["G"], res[0]["R"]) == (2, 1) and res[0]["tp_names"] == []
    _check(res, _reference())


def test_full_mesh_params_without_dp_mesh_dims_refused():
    """Params on a (dp_shard 2, tp 1) SPMD mesh, dedicate_params given the 1-D shard mesh and no
    dp_mesh_dims: a ValueError on every rank naming dp_mesh_dims and how to pass it."""
    cfg = dict(shape=(2, 1), names=("dp_shard", "tp"), shard="dp_shard", tp="tp", no_dims=True)
    res = run_ranks(_train, 2, cfg, timeout=120)
    for r in res:
        assert r["error"] is not None and r["error"].startswith("ValueError"), r["error"]
        assert "dp_mesh_dims" in r["error"] and "resolve_fsdp_mesh" in r["error"], r["error"]
