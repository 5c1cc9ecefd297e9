"""``dmuon.integrations.torchtitan`` with torchtitan 0.3.0 itself (the ``torchtitan`` extra):
``DMuonOptimizersContainer.Config(...).build(model_parts=[model])`` (torchtitan's way of selecting
an optimizer from the job config), torchtitan's ``LRSchedulersContainer`` over it, and its
``CheckpointManager`` (DCP): save at step 3 on 2 gloo ranks -> new processes, a model with other
weights -> ``load`` restores the dedicated matrices, the FSDP2 params, Muon's momentum, AdamW's
moments and step counters and the lr schedule exactly (fp64), and 2 more steps equal the
uninterrupted run bit for bit. The container's state dict is torchtitan's flat name-keyed layout.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")

from dist_utils import run_ranks  # noqa: E402
from models import make_batches, make_model, muon_predicate  # noqa: E402

SAVE_AT, MORE = 3, 2


def _setup(seed: int, folder: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    import dmuon
    from dmuon.integrations.torchtitan import DMuonOptimizersContainer

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    model = make_model(seed=seed)
    dmuon.dedicate_params(model, mesh, muon_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = DMuonOptimizersContainer.Config(
        lr=0.02, adamw_lr=3e-3, weight_decay=0.01,
        muon_kwargs={"ns_dtype": torch.float64}).build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=10)
    ckpt = CheckpointManager.Config(enable=True, folder=folder, interval=1,
                                    last_save_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched, states={},
        sd_adapter=None)
    return model, opt, sched, ckpt


def _train(model, opt, sched, batches, rank, world):
    for ids in batches:
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()
        sched.step()


def _snapshot(model, opt) -> dict:
    import dmuon
    return {"model": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, opt.muon),
            "lrs": [g["lr"] for g in opt.muon.param_groups]}


def _first(rank: int, world: int, folder: str) -> dict:
    model, opt, sched, ckpt = _setup(0, folder)
    batches = make_batches(SAVE_AT + MORE, 4)
    _train(model, opt, sched, batches[:SAVE_AT], rank, world)
    keys = sorted(opt.state_dict())
    ckpt.save(curr_step=SAVE_AT)
    at_save = _snapshot(model, opt)
    _train(model, opt, sched, batches[SAVE_AT:], rank, world)
    ckpt.close()
    return {"keys": keys, "at_save": at_save, "end": _snapshot(model, opt)}


def _resume(rank: int, world: int, folder: str) -> dict:
    model, opt, sched, ckpt = _setup(7, folder)  # other initial weights: the load must win
    loaded = ckpt.load(step=SAVE_AT)
    at_load = _snapshot(model, opt)
    _train(model, opt, sched, make_batches(SAVE_AT + MORE, 4)[SAVE_AT:], rank, world)
    ckpt.close()
    return {"loaded": loaded, "at_load": at_load, "end": _snapshot(model, opt)}


def _equal(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.slow
def test_checkpoint_manager_save_resume(tmp_path):
    folder = str(tmp_path / "ckpt")
    first = run_ranks(_first, 2, folder, timeout=120)
    keys = first[0]["keys"]
    assert "state.layers.0.self_attn.q_proj.weight.momentum_buffer" in keys, keys[:8]
    assert any(k.startswith("param_groups.layers.0.self_attn.q_proj.weight.") for k in keys)
    assert "state.embed_tokens.weight.exp_avg" in keys
    resumed = run_ranks(_resume, 2, folder, timeout=120)
    for r in range(2):
        assert resumed[r]["loaded"] is True
        _equal(resumed[r]["at_load"], first[r]["at_save"], f"rank {r} at load")
        _equal(resumed[r]["end"], first[r]["end"], f"rank {r} end")


def _llama3_config():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    cfg = llama3_debugmodel()
    cfg.training.mixed_precision_param = "float32"
    cfg.training.seq_len = 32
    mc = cfg.model_spec.model
    mc.update_from_config(config=cfg)
    return cfg, mc


def _inputs():
    tokens = torch.arange(2 * 32).view(2, 32) % 100
    return tokens, torch.arange(32).view(1, 32).expand(2, 32)


def _llama3_meta(rank: int, world: int) -> dict:
    import torchtitan.distributed.parallel_dims as tt_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.parallelize import parallelize_llama

    import dmuon

    cfg, mc = _llama3_config()
    cfg.parallelism.data_parallel_shard_degree = world
    cfg.parallelism.spmd_backend = "partial_dtensor"
    tt_dims.device_type = "cpu"  # CPU-only torch: torchtitan would ask for a cuda mesh
    with torch.device("meta"):  # torchtitan's trainer: build on meta
        model = mc.build()
    pd = ParallelDims.from_config(cfg.parallelism, world)
    # fused wqkv is left out here: dmuon.get_model_state_dict (read below) names params, and
    # FusedQKVLinear's hooks save wqkv as wq/wk/wv (dedicated wqkv: test_torchtitan_fused_qkv.py)
    owners = dmuon.dedicate_params(model, pd.get_mesh("fsdp"),
                                   lambda n, p: p.ndim == 2 and "layers." in n and "wqkv" not in n)
    model = parallelize_llama(model, parallel_dims=pd, training=cfg.training,
                              parallelism=cfg.parallelism, compile_config=cfg.compile,
                              ac_config=None, dump_folder="")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    sd = dmuon.get_model_state_dict(model)
    tokens, pos = _inputs()
    with torch.no_grad():
        logits = model(tokens, positions=pos, attention_masks=model.get_attention_masks(pos))
    return {"sd": sd, "logits": logits, "n_dedicated": len(owners)}


@pytest.mark.slow
def test_llama3_meta_init_through_parallelize_llama():
    """torchtitan's llama3 debug model built on meta, dedicate_params, its own parallelize_llama
    (fully_shard, dp 2), to_empty, its own init_weights: the weights read back are one model
    (the same on both ranks) and the forward equals a single process loaded with them. (Its
    attention has no CPU backward in torch 2.13, so no training step here.)"""
    res = run_ranks(_llama3_meta, 2, timeout=180)
    assert res[0]["n_dedicated"] == 24  # wo, w1, w2, w3 of the 6 layers
    sd = res[0]["sd"]
    assert all(torch.equal(sd[k], res[1]["sd"][k]) for k in sd)
    _, mc = _llama3_config()
    ref = mc.build()
    torch.manual_seed(0)
    ref.init_weights(buffer_device=None)
    for k, v in ref.state_dict().items():  # every matrix has the init's distribution
        if v.ndim == 2 and "layers." in k:
            ratio = float(sd[k].std()) / float(v.std())
            assert torch.isfinite(sd[k]).all() and 0.8 < ratio < 1.25, (k, ratio)
    ref.load_state_dict(sd, strict=True)
    tokens, pos = _inputs()
    with torch.no_grad():
        want = ref(tokens, positions=pos, attention_masks=ref.get_attention_masks(pos))
    for r in res:
        assert torch.equal(r["logits"], want)


# ----------------------------------------------------------------------------- TP 2 x dp 2
TT_STEPS, TT_SEQ, TT_BATCH = 3, 32, 4
TT_HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, ns_steps=5,
             adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.1)


def _tt_predicate(n, p) -> bool:
    return p.ndim == 2 and "layers." in n and "wqkv" not in n


class _CausalSDPA(torch.nn.Module):
    """The inner attention of the TP test, in torchtitan's interface (``(B, L, N, H)`` q / k / v
    in and out): causal SDPA per rank on its local heads. torchtitan's LM attention backends (flex,
    varlen) have no CPU backward in torch 2.13 and its ``ScaledDotProductAttention`` mixes its
    plain causal mask with TP's DTensor heads on CPU; the heads are TP-local, so each rank attends
    over its own ones and hands TP back a DTensor of the same layout."""

    def forward(self, q, k, v, *, scale=None, enable_gqa=False, **kwargs):
        import torch.nn.functional as F
        from torch.distributed.tensor import DTensor
        like = q if isinstance(q, DTensor) else None
        if like is not None:
            q, k, v = q.to_local(), k.to_local(), v.to_local()
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True, scale=scale,
                                             enable_gqa=enable_gqa).transpose(1, 2)
        return DTensor.from_local(out, like.device_mesh, like.placements) if like is not None \
            else out


def _use_causal_sdpa(model) -> None:
    for layer in model.layers.values():
        layer.attention.inner_attention = _CausalSDPA()


def _llama3_tp_config():
    """torchtitan's llama3 debug model in fp64 (attention swapped in the built model:
    :class:`_CausalSDPA`)."""
    from torchtitan.config import TORCH_DTYPE_MAP
    TORCH_DTYPE_MAP.setdefault("float64", torch.float64)  # fp64 for a 1e-10 comparison
    cfg, mc = _llama3_config()
    cfg.training.mixed_precision_param = "float64"
    cfg.training.mixed_precision_reduce = "float64"
    return cfg, mc


def _tt_loss(logits, tokens):
    """torchtitan's loss convention: the local sum over tokens / the global token count (its
    FSDP2 modules sum the gradients: set_gradient_divide_factor(1.0))."""
    import torch.nn.functional as F
    full = logits.full_tensor() if hasattr(logits, "full_tensor") else logits  # loss-parallel
    return F.cross_entropy(full.reshape(-1, full.shape[-1]), tokens[:, 1:].reshape(-1),
                           reduction="sum") / (TT_BATCH * TT_SEQ)


def _tt_batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 2048, (TT_BATCH, TT_SEQ + 1), generator=g) for _ in range(TT_STEPS)]


def _llama3_tp2_dp2(rank: int, world: int) -> dict:
    import torchtitan.distributed.parallel_dims as tt_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.parallelize import parallelize_llama

    import dmuon

    cfg, mc = _llama3_tp_config()
    cfg.parallelism.data_parallel_shard_degree = 2
    cfg.parallelism.tensor_parallel_degree = 2
    cfg.parallelism.spmd_backend = "partial_dtensor"
    tt_dims.device_type = "cpu"
    torch.set_default_dtype(torch.float64)
    with torch.device("meta"):
        model = mc.build()
    _use_causal_sdpa(model)
    pd = ParallelDims.from_config(cfg.parallelism, world)
    # the seeds' torchtitan recipe: dedicate_params, then torchtitan's parallelize (TP + FSDP)
    owners = dmuon.dedicate_params(model, pd.get_mesh("fsdp"), _tt_predicate)
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
    opt = dmuon.Muon(model, **TT_HP, ns_dtype=torch.float64)
    rt = opt.dedicated_state
    init_sd = dmuon.get_model_state_dict(model, cpu_offload=True)
    dp_rank = pd.get_mesh("fsdp").get_local_rank()
    losses = []
    for tokens in _tt_batches():
        opt.zero_grad()
        local = tokens.chunk(2)[dp_rank]
        loss = _tt_loss(model(local[:, :-1]), local)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    return {"init_sd": init_sd, "sd": dmuon.get_model_state_dict(model, cpu_offload=True),
            "owners": owners, "tp_names": sorted(rt.tp_layouts), "n_dedicated": len(rt.names),
            "dims": (pd.dp_shard, pd.tp)}


def _tt_reference(init_sd: dict, *, by_param: bool = False) -> dict:
    """One process from ``init_sd``: 3 steps of functional Muon on the :func:`_tt_predicate`
    matrices and torch AdamW on the rest, full batch; the final ``state_dict()``. With
    ``by_param``, ``init_sd`` and the result are keyed by parameter name (``named_parameters``:
    the fused ``wqkv`` whole, not the ``wq`` / ``wk`` / ``wv`` its state-dict hooks split it into)."""
    from dmuon.functional import muon as fmuon
    _, mc = _llama3_tp_config()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = mc.build()
    finally:
        torch.set_default_dtype(prev)
    _use_causal_sdpa(model)
    if by_param:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(init_sd[n])
    else:
        model.load_state_dict(init_sd)
    mats = {n: p for n, p in model.named_parameters() if _tt_predicate(n, p)}
    rest = [p for n, p in model.named_parameters() if n not in mats]
    adam = torch.optim.AdamW(rest, lr=TT_HP["adamw_lr"], betas=TT_HP["adamw_betas"],
                             eps=TT_HP["adamw_eps"], weight_decay=TT_HP["adamw_weight_decay"],
                             foreach=False)
    hp = fmuon.MuonHParams(lr=TT_HP["lr"], momentum=TT_HP["momentum"], nesterov=True,
                           weight_decay=TT_HP["weight_decay"], ns_steps=5, ns_dtype=torch.float64)
    state = fmuon.init({n: p.detach() for n, p in mats.items()})
    for tokens in _tt_batches():
        model.zero_grad(set_to_none=True)
        _tt_loss(model(tokens[:, :-1]), tokens).backward()
        with torch.no_grad():
            _, state = fmuon.update({n: p.grad for n, p in mats.items()}, state,
                                    {n: p.data for n, p in mats.items()}, hp, donate=True)
        adam.step()
    items = model.named_parameters() if by_param else model.state_dict().items()
    return {k: v.detach().clone() for k, v in items}


@pytest.mark.slow
def test_llama3_tp2_dp2_through_parallelize_llama():
    """torchtitan's llama3 debug model (fp64, :class:`_CausalSDPA` attention) on 4 gloo ranks: dedicate_params
    before torchtitan's own parallelize_llama with TP 2 x dp 2 (deferred), to_empty,
    init_weights, dmuon.Muon; 3 steps with torchtitan's loss convention equal one process
    (functional Muon + torch AdamW, full batch) from the same initial weights to <= 1e-10."""
    res = run_ranks(_llama3_tp2_dp2, 4, timeout=300)
    assert res[0]["dims"] == (2, 2) and res[0]["owners"] == {}
    assert res[0]["n_dedicated"] == 24 and len(res[0]["tp_names"]) == 24
    for r in res[1:]:
        assert all(torch.equal(v, res[0]["init_sd"][k]) for k, v in r["init_sd"].items())
    ref = _tt_reference(res[0]["init_sd"])
    for r in res:
        worst = max(float((r["sd"][k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                    for k, v in ref.items())
        assert worst <= 1e-10, worst
