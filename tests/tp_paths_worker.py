"""Worker and reference for tests/test_tensor_parallel_paths.py: user-shaped TP paths beyond the
supported-order tests (4 gloo ranks, a (dp 2, tp 2) mesh, fp64)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import TinyLlama, make_batches
from stateful_harness import HP, lr_factor

STEPS, BATCH = 3, 4


class ReuseLlama(TinyLlama):
    """``layers.0`` runs twice per forward (weight reuse of TP-sliced dedicated matrices)."""

    def forward(self, ids):
        x = self.embed_tokens(ids[:, :-1])
        for layer in [self.layers[0], self.layers[0], *self.layers[1:]]:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class FullLogitsLlama(TinyLlama):
    """``lm_head`` output may be a DTensor (ColwiseParallel, use_local_output=False): the loss is
    computed on its ``full_tensor()``."""

    def forward(self, ids):
        x = self.embed_tokens(ids[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def build_model(cfg: dict, seed: int = 0) -> nn.Module:
    """The fp64 model of ``cfg`` with the same weights on every process."""
    cls = {"reuse": ReuseLlama, "full_logits": FullLogitsLlama}.get(cfg.get("model"), TinyLlama)
    gen = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = cls(checkpointing=cfg.get("ckpt", False))
    if cfg.get("bias"):  # biases on a Colwise (Shard(0) bias) and a Rowwise (Replicate bias) Linear
        for layer in model.layers:
            for name in ("q_proj", "o_proj"):
                lin = getattr(layer.self_attn, name)
                new = nn.Linear(lin.in_features, lin.out_features, bias=True)
                with torch.no_grad():
                    new.weight.copy_(lin.weight)
                setattr(layer.self_attn, name, new)
    model = model.to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    torch.random.set_rng_state(gen)
    return model


def predicate_of(cfg: dict):
    kind = cfg.get("pred", "proj")
    if kind == "proj":
        return lambda n, p: p.ndim == 2 and "proj" in n
    if kind == "some":  # only some TP matrices (the attention's); the MLP's go to AdamW
        return lambda n, p: p.ndim == 2 and "self_attn" in n
    if kind == "lm_head":  # the projections and lm_head
        return lambda n, p: p.ndim == 2 and ("proj" in n or n == "lm_head.weight")
    raise ValueError(kind)


TP_PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
           "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col",
           "mlp.down_proj": "row"}


def apply_tp(model, tp_mesh, cfg: dict) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN.items()}
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, plan)
    if cfg.get("tp_lm_head") == "replicate_out":
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    elif cfg.get("tp_lm_head") == "dtensor_out":
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(use_local_output=False)})


def run(rank: int, world: int, cfg: dict) -> dict:
    """One training run of ``cfg`` with dmuon on a (dp 2, tp 2) mesh (or ``cfg["hsdp3"]``: a
    (replicate 2, shard 1, tp 2) mesh); returns the full state dict, the norms and the losses."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dmuon

    if cfg.get("hsdp3"):
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh = mesh["replicate", "shard"]
        ded_kw = dict(replicate_mesh=mesh["replicate"])
        ded_mesh = mesh["shard"]
        dp_size, dp_index = 2, mesh["replicate"].get_local_rank()
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh = ded_mesh = mesh["dp"]
        ded_kw = {}
        dp_size, dp_index = 2, mesh["dp"].get_local_rank()
    z3 = cfg.get("z3", True)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if cfg.get("mp") else MixedPrecisionPolicy())
    model = build_model(cfg)
    pred = predicate_of(cfg)
    if cfg.get("order") == "B":
        dmuon.dedicate_params(model, ded_mesh, pred, reshard_after_forward=z3, **ded_kw)
        apply_tp(model, mesh["tp"], cfg)
    else:
        apply_tp(model, mesh["tp"], cfg)
        dmuon.dedicate_params(model, ded_mesh, pred, reshard_after_forward=z3, **ded_kw)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=z3, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    opt = dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                     weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                     ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"], adamw_betas=HP["adamw_betas"],
                     adamw_eps=HP["adamw_eps"], adamw_weight_decay=HP["adamw_weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor) if cfg.get("sched") else None
    accum = cfg.get("accum", 1)
    losses, norms, extra = [], [], {}
    for step, ids in enumerate(make_batches(cfg.get("steps", STEPS), BATCH)):
        opt.zero_grad(set_to_none=not cfg.get("zero_keep"))
        local = ids.chunk(dp_size)[dp_index]
        tot = 0.0
        for i, mb in enumerate(local.chunk(accum)):
            ctx = contextlib.nullcontext() if i == accum - 1 else dmuon.no_sync(model)
            with ctx:
                loss = model(mb) / accum
                loss.backward()
            tot += float(loss.detach())
        losses.append(tot)
        if cfg.get("clip"):
            norms.append(float(dmuon.clip_grad_norm_(model, cfg["clip"])))
        opt.step()
        if sched is not None:
            sched.step()
    if cfg.get("step_twice"):
        from dist_utils import catch
        ids = make_batches(1, BATCH, seed=9)[0].chunk(dp_size)[dp_index]
        opt.zero_grad()
        model(ids).backward()
        opt.step()
        extra["second_step"] = catch(lambda: opt.step())
    sd = dmuon.get_model_state_dict(model, cpu_offload=True)
    dist.barrier()
    return {"sd": sd, "losses": losses, "norms": norms, **extra}


def reference(cfg: dict) -> dict:
    """Single process, full batch: functional Muon (fp64 NS) for the predicate's matrices, torch
    AdamW for the rest, torch's clip_grad_norm_, HP's settings."""
    from dmuon.functional import muon as fmuon

    model = build_model(cfg)
    pred = predicate_of(cfg)
    mats = {n: p for n, p in model.named_parameters() if pred(n, p)}
    rest = [p for n, p in model.named_parameters() if n not in mats]
    adam = torch.optim.AdamW(rest, lr=HP["adamw_lr"], betas=HP["adamw_betas"], eps=HP["adamw_eps"],
                             weight_decay=HP["adamw_weight_decay"], foreach=False)
    state = fmuon.init({n: p.detach() for n, p in mats.items()})
    norms, losses = [], []

    def step(f: float) -> None:
        nonlocal state
        hp = fmuon.MuonHParams(lr=HP["lr"] * f, momentum=HP["momentum"], nesterov=HP["nesterov"],
                               weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                               ns_dtype=torch.float64)
        with torch.no_grad():
            _, state = fmuon.update({n: p.grad for n, p in mats.items()}, state,
                                    {n: p.data for n, p in mats.items()}, hp, donate=True)
        for g in adam.param_groups:
            g["lr"] = HP["adamw_lr"] * f
        adam.step()

    for s, ids in enumerate(make_batches(cfg.get("steps", STEPS), BATCH)):
        model.zero_grad(set_to_none=True)
        loss = model(ids)
        loss.backward()
        losses.append(float(loss.detach()))
        if cfg.get("clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])))
        step(lr_factor(s) if cfg.get("sched") else 1.0)
    if cfg.get("step_twice"):
        model.zero_grad(set_to_none=True)
        model(make_batches(1, BATCH, seed=9)[0]).backward()
        step(1.0)
    return {"sd": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "norms": norms, "losses": losses}


def run_many(rank: int, world: int, cfgs: list) -> list:
    """``run`` of each of ``cfgs`` (exploration: a failure is returned as its traceback)."""
    import traceback
    out = []
    for cfg in cfgs:
        try:
            out.append(run(rank, world, cfg))
        except Exception as e:  # noqa: BLE001
            out.append({"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()})
    return out
