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
- dp 2 x TP 2 under spmd_types: TP slices are plain local tensors there whose layout is in their
  spmd_types annotations (``{dp: R, tp: V}`` and a ``PartitionSpec`` naming the sliced dim);
  dmuon reads them as the TP layout it derives from DTensor placements. 3 steps equal one process
  (the whole model from the same initial values, full batch) to <= 1e-10 (5.2e-13 measured:
  the TP forward's own summation order, the reference below differs from one process by the
  same), and equal bitwise the same torchtitan model and mesh without dmuon whose Muon matrices
  are updated whole (gradients gathered, functional Muon on the full matrix, slices written back)
  and the rest by torch AdamW (:func:`_spmd_reference`). Forward, loss and backward run inside
  torchtitan's SPMD mesh context (:func:`_spmd_context`, what its trainer enters): outside it
  spmd_types skips every TP collective without an error (torchtitan's
  ``spmd_redistribute_per_axis`` returns its input when no mesh is current), the embedding's
  vocab-parallel partial sums are never added and the TP model is not the one-process model
  (first loss 7.6562 against one process 7.6679 without it). The initial values are drawn whole
  and written through the slices (:func:`_distinct_values`). The loss gathers the vocab-sliced
  logits (:class:`_VocabGather`): torchtitan's loss-parallel CE computes in fp32.
- dp 2 x TP 2 where rank 0 alone lost a matrix's annotations: refused on every rank.
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


class _VocabGather(torch.autograd.Function):
    """The whole logits from each TP rank's vocab slice (the last dim), in fp64: every rank of the
    TP group computes the same loss from them, so a slice's gradient is that slice of the whole
    gradient (no collective backward; torchtitan's own loss-parallel CE computes in fp32)."""

    @staticmethod
    def forward(ctx, local, group):
        import torch.distributed as dist
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.index, ctx.n = dist.get_rank(group), len(parts)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.n, dim=-1)[ctx.index], None


def _spmd_context(parallel_dims):
    """torchtitan's SPMD mesh context, which its trainer enters around forward, loss and backward
    (``train_context``). spmd_types modules run TP's collectives (the vocab-parallel embedding's
    sum, the row-parallel outputs' reduction, sequence parallelism's gathers) only inside it:
    outside it they are skipped without an error and each TP rank computes a different model."""
    from torchtitan.distributed.utils import get_spmd_context
    return get_spmd_context(parallel_dims=parallel_dims)()


def _distinct_values(model, tp: int, tp_rank: int) -> None:
    """Overwrite ``init_weights``' values with whole tensors drawn from one seed, each rank
    writing its part (FSDP2's DTensors by their placements, a dedicated TP slice on the dim where
    it is smaller than the whole). On a CPU mesh every rank fills its local shard from the same
    seed, so each whole matrix would be copies of one block: a slice put in the wrong place would
    not show."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    _, mc = _llama3_tp_config()
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in mc.build().named_parameters()}
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():  # the same order on every rank
            whole = torch.randn(shapes[n], generator=g, dtype=torch.float64)
            whole = 1 + 0.1 * whole if whole.ndim == 1 else \
                whole * (1.0 if "tok_embeddings" in n else 0.02)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(whole, p.device_mesh,
                                                     p.placements).to_local())
                continue
            cut = [d for d in range(whole.ndim) if p.shape[d] != whole.shape[d]]
            p.copy_(whole.chunk(tp, cut[0])[tp_rank] if cut else whole)


def _full_params(model, sd: dict) -> dict:
    """``{param name: full value}``: FSDP2's DTensors gathered, the dedicated ones from ``sd``
    (``dmuon.get_model_state_dict``'s, the same names)."""
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else sd[n]).detach().clone()
            for n, p in model.named_parameters()}


def _meta_tp_model(world: int, tp: int):
    """``(config, meta model, parallel dims with their mesh)``: torchtitan's llama3 debug model in
    fp64 on the meta device, dp ``world // tp`` x TP ``tp`` on CPU (what both runs build)."""
    import torchtitan.distributed.parallel_dims as tt_dims
    from torchtitan.distributed import ParallelDims

    torch.set_num_threads(1)
    cfg, mc = _llama3_tp_config()
    cfg.parallelism.data_parallel_shard_degree = world // tp
    cfg.parallelism.tensor_parallel_degree = tp
    tt_dims.device_type = "cpu"
    torch.set_default_dtype(torch.float64)
    with torch.device("meta"):
        model = mc.build()
    _use_causal_sdpa(model)
    pd = ParallelDims.from_config(cfg.parallelism, world)
    pd.build_mesh()
    return cfg, model, pd


def _spmd_reference(rank: int, world: int, init: dict) -> dict:
    """The reference of the TP run: the same torchtitan spmd_types model and TP 2 x dp 2 (its own
    forward and backward, FSDP2 on every param), from the same values ``init``; each step the
    Muon matrices' gradients are gathered whole and updated by functional Muon on the whole
    matrix (what one device does), the rest by torch AdamW."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import distribute_tensor
    from torchtitan.models.llama3.parallelize import parallelize_llama

    from dmuon.functional import muon as fmuon

    cfg, model, pd = _meta_tp_model(world, 2)
    model = parallelize_llama(model, parallel_dims=pd, training=cfg.training,
                              parallelism=cfg.parallelism, compile_config=cfg.compile,
                              ac_config=None, dump_folder="")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for n, p in model.named_parameters():
            p._local_tensor.copy_(distribute_tensor(init[n], p.device_mesh, p.placements).to_local())
    mats = {n: p for n, p in model.named_parameters() if _tt_predicate(n, p)}
    rest = [p for n, p in model.named_parameters() if n not in mats]
    adam = torch.optim.AdamW(rest, lr=TT_HP["adamw_lr"], betas=TT_HP["adamw_betas"],
                             eps=TT_HP["adamw_eps"], weight_decay=TT_HP["adamw_weight_decay"],
                             foreach=False)
    hp = fmuon.MuonHParams(lr=TT_HP["lr"], momentum=TT_HP["momentum"], nesterov=True,
                           weight_decay=TT_HP["weight_decay"], ns_steps=5, ns_dtype=torch.float64)
    full = {n: p.full_tensor().detach().clone() for n, p in mats.items()}
    state = fmuon.init(full)
    dp_rank = pd.get_mesh("dp_shard").get_local_rank()
    for tokens in _tt_batches():
        model.zero_grad(set_to_none=True)
        local = tokens.chunk(world // 2)[dp_rank]
        with _spmd_context(pd):
            logits = _VocabGather.apply(model(local[:, :-1]), pd.get_mesh("tp").get_group())
            _tt_loss(logits, local).backward()
        with torch.no_grad():
            grads = {n: p.grad.full_tensor().clone() for n, p in mats.items()}
            _, state = fmuon.update(grads, state, full, hp, donate=True)
            for n, p in mats.items():
                p._local_tensor.copy_(distribute_tensor(full[n], p.device_mesh,
                                                     p.placements).to_local())
        adam.step()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _spmd_run(rank: int, world: int, tp: int, spoil: bool = False) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh
    from torchtitan.models.llama3.parallelize import parallelize_llama

    import dmuon

    cfg, model, pd = _meta_tp_model(world, tp)
    assert cfg.parallelism.spmd_backend == "spmd_types"  # torchtitan 0.3.0's default
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
    if spoil and rank == 0:  # one rank's w1 of layer 0 loses its kept spmd_types annotations
        from dmuon.compat.spmd_mesh import KEPT_ATTR
        model.get_submodule("layers.0.feed_forward.w1").__dict__.pop(KEPT_ATTR)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    _distinct_values(model, tp, pd.get_mesh("tp").get_local_rank() if tp > 1 else 0)
    try:
        opt = dmuon.Muon(model, **TT_HP, ns_dtype=torch.float64)
    except ValueError as e:
        return {"error": str(e)}
    init_sd = dmuon.get_model_state_dict(model, cpu_offload=True)
    init_params = _full_params(model, init_sd)
    dp_rank = pd.get_mesh("dp_shard").get_local_rank()
    tp_rank = pd.get_mesh("tp").get_local_rank() if tp > 1 else 0
    losses = []
    for tokens in _tt_batches():
        opt.zero_grad()
        local = tokens.chunk(world // tp)[dp_rank]
        with _spmd_context(pd):
            logits = model(local[:, :-1])
            if tp > 1:  # spmd_types: this rank's vocab slice (colwise lm_head), gathered exactly
                logits = _VocabGather.apply(logits, pd.get_mesh("tp").get_group())
            loss = _tt_loss(logits, local)
            loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    sd = dmuon.get_model_state_dict(model, cpu_offload=True)
    return {"init_sd": init_sd, "sd": sd, "init_params": init_params,
            "params": _full_params(model, sd),
            "deferred": owners == {}, "n_dedicated": len(opt.dedicated_state.names),
            "dims": (dp_mesh_dims.shard, dp_mesh_dims.replicate), "error": None,
            "tp_rank": tp_rank, "losses": losses, "tp_names": sorted(opt.dedicated_state.tp_layouts)}


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


@pytest.fixture(scope="module")
def tp2_dp2_run() -> list:
    """The dmuon run at TP 2 x dp 2 (4 gloo ranks), shared by the two comparisons below."""
    return run_ranks(_spmd_run, 4, 2, timeout=300)


def test_llama3_spmd_types_tp2_dp2_equals_whole_matrix_muon(tp2_dp2_run):
    """torchtitan 0.3.0's default backend with TP 2 x dp 2 (4 gloo ranks), the recipe verbatim:
    3 steps equal the same model and mesh without dmuon whose Muon matrices are updated whole
    (their gradients gathered, functional Muon) and the rest by torch AdamW, to <= 1e-10 in fp64
    (:func:`_spmd_reference`: the same TP forward and backward, so this isolates dmuon's update;
    bitwise here)."""
    res = tp2_dp2_run
    assert res[0]["error"] is None, res[0]["error"]
    assert res[0]["deferred"] and res[0]["n_dedicated"] == 24
    assert len(res[0]["tp_names"]) == 24  # every dedicated matrix is a TP slice
    assert res[0]["dims"] == ("dp_shard", None)
    ref = run_ranks(_spmd_reference, 4, res[0]["init_params"], timeout=300)[0]
    for r in res:
        assert all(torch.equal(v, res[0]["init_params"][k]) for k, v in r["init_params"].items())
        worst = max(float((r["params"][k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                    for k, v in ref.items())
        assert worst <= 1e-10, worst


def test_llama3_spmd_types_tp2_dp2_equals_one_process(tp2_dp2_run):
    """The same TP 2 x dp 2 dmuon run: 3 steps equal one process (the whole model from the same
    initial values, full batch, functional Muon + torch AdamW) to <= 1e-10 in fp64 (5.2e-13 here,
    as the whole-matrix reference: TP's reductions sum in another order). Fails (0.65) when the
    run leaves :func:`_spmd_context` out."""
    res = tp2_dp2_run
    assert res[0]["error"] is None, res[0]["error"]
    ref = _tt_reference(res[0]["init_params"], by_param=True)
    for r in res:
        worst = max(float((r["params"][k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                    for k, v in ref.items())
        assert worst <= 1e-10, worst


def test_llama3_spmd_types_tp2_unannotated_refused_on_every_rank():
    """A dedicated TP slice whose spmd_types annotations are gone on rank 0 only (a plain tensor
    dmuon cannot tell from a whole matrix): dmuon.Muon raises ValueError on all 4 ranks, naming
    the param and what dmuon reads TP from."""
    res = run_ranks(_spmd_run, 4, 2, True, timeout=300)
    for r in res:
        assert r["error"] is not None, "a rank went on"
        assert "without spmd_types annotations" in r["error"], r["error"]
        assert "layers.0.feed_forward.w1.weight" in r["error"], r["error"]
