"""torchtitan 0.3.0's default path (``parallelism.spmd_backend="spmd_types"``) with dmuon, in
torchtitan's own venv (slow tier; skipped without torchtitan and spmd_types). There FSDP2 runs on
the full SPMD mesh with ``dp_mesh_dims`` (``resolve_fsdp_mesh``) and every param is re-registered
by ``model.parallelize`` (a plain local tensor with spmd_types annotations), so the recipe is:

    spmd_mesh, dp_mesh_dims = resolve_fsdp_mesh(parallel_dims)
    dmuon.dedicate_params(model, spmd_mesh, predicate,
                          options=dmuon.DedicateOptions(dp_mesh_dims=dp_mesh_dims))
    model = parallelize_llama(model, ...)          # torchtitan's own: parallelize + fully_shard
    model.to_empty(...); model.init_weights(...)
    optimizer = dmuon.Muon(model, ...)             # the dedication completes here

- dp 2 (no TP): torchtitan's llama3 debug model (fp64, :class:`_CausalSDPA` attention) trained 3
  steps equals one process (functional Muon + torch AdamW) to <= 1e-10.
- dp 2 x TP 2 under spmd_types: TP slices are plain tensors there, which dmuon cannot tell from
  whole matrices: ``dmuon.Muon`` raises ValueError on every rank naming the backends that work.
- dp 2 x TP 2 with ``spmd_backend="partial_dtensor"`` is ``test_torchtitan_integration.py``'s
  ``test_llama3_tp2_dp2_through_parallelize_llama`` (same venv).

Run: ``/work/venv-titan/bin/python -m pytest -q -m slow tests/test_torchtitan_spmd.py`` (a venv
with torch 2.15, ``torchtitan==0.3.0``, ``spmd_types==0.2.3`` and ``pip install -e .[test]``).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("spmd_types")

from dist_utils import run_ranks  # noqa: E402
from test_torchtitan_integration import (TT_HP, _llama3_tp_config, _tt_batches,  # noqa: E402
                                         _tt_loss, _tt_predicate, _tt_reference, _use_causal_sdpa)

pytestmark = pytest.mark.slow


def _spmd_run(rank: int, world: int, tp: int) -> dict:
    import torchtitan.distributed.parallel_dims as tt_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh
    from torchtitan.models.llama3.parallelize import parallelize_llama

    import dmuon

    torch.set_num_threads(1)
    cfg, mc = _llama3_tp_config()
    cfg.parallelism.data_parallel_shard_degree = world // tp
    cfg.parallelism.tensor_parallel_degree = tp
    assert cfg.parallelism.spmd_backend == "spmd_types"  # torchtitan 0.3.0's default
    tt_dims.device_type = "cpu"
    torch.set_default_dtype(torch.float64)
    with torch.device("meta"):
        model = mc.build()
    _use_causal_sdpa(model)
    pd = ParallelDims.from_config(cfg.parallelism, world)
    pd.build_mesh()
    # the recipe: dedicate_params gets what fully_shard will get (mesh + dp_mesh_dims)
    spmd_mesh, dp_mesh_dims = resolve_fsdp_mesh(pd)
    owners = dmuon.dedicate_params(model, spmd_mesh, _tt_predicate,
                                   options=dmuon.DedicateOptions(dp_mesh_dims=dp_mesh_dims))
    model = parallelize_llama(model, parallel_dims=pd, training=cfg.training,
                              parallelism=cfg.parallelism, compile_config=cfg.compile,
                              ac_config=None, dump_folder="")
    for m in model.modules():  # gloo has no PREMUL_SUM: FSDP2 sums, then divides (by 1.0)
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    try:
        opt = dmuon.Muon(model, **TT_HP, ns_dtype=torch.float64)
    except ValueError as e:
        return {"error": str(e)}
    init_sd = dmuon.get_model_state_dict(model, cpu_offload=True)
    dp_rank = pd.get_mesh("dp_shard").get_local_rank()
    for tokens in _tt_batches():
        opt.zero_grad()
        local = tokens.chunk(world // tp)[dp_rank]
        _tt_loss(model(local[:, :-1]), local).backward()
        opt.step()
    return {"init_sd": init_sd, "sd": dmuon.get_model_state_dict(model, cpu_offload=True),
            "deferred": owners == {}, "n_dedicated": len(opt.dedicated_state.names),
            "dims": (dp_mesh_dims.shard, dp_mesh_dims.replicate), "error": None}


def test_llama3_spmd_types_dp2_equals_one_process():
    res = run_ranks(_spmd_run, 2, 1, timeout=300)
    assert res[0]["error"] is None, res[0]["error"]
    assert res[0]["deferred"] and res[0]["n_dedicated"] == 24
    assert res[0]["dims"] == ("dp_shard", None)
    assert all(torch.equal(v, res[0]["init_sd"][k]) for k, v in res[1]["init_sd"].items())
    ref = _tt_reference(res[0]["init_sd"])
    for r in res:
        worst = max(float((r["sd"][k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                    for k, v in ref.items())
        assert worst <= 1e-10, worst


def test_llama3_spmd_types_tp2_refused_with_the_fix():
    res = run_ranks(_spmd_run, 4, 2, timeout=300)
    for r in res:
        assert r["error"] is not None and "full_dtensor" in r["error"], r["error"]
        assert "plain tensors" in r["error"], r["error"]
