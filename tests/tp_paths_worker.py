"""Worker and reference for tests/test_tensor_parallel_paths.py: user-shaped TP paths beyond the
supported-order tests (4 gloo ranks, a (dp 2, tp 2) mesh, fp64)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import Block, TinyLlama, make_batches
from stateful_harness import HP, lr_factor

STEPS, BATCH = 3, 4


def ReuseLlama(**kwargs) -> TinyLlama:
    """``layers.0`` runs twice per forward (weight reuse of TP-sliced dedicated matrices)."""
    return TinyLlama(reuse_first=True, **kwargs)


class SkipLlama(TinyLlama):
    """``layers.1`` is skipped while ``self.skip`` is set (its matrices get no gradient)."""

    skip = False

    def forward(self, ids):
        x = self.embed_tokens(ids[:, :-1])
        for i, layer in enumerate(self.layers):
            if not (self.skip and i == 1):
                x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class RoutedBlock(Block):
    """A block whose MLP runs on the rows ``sel`` only (none: the MLP is not called)."""

    def forward(self, x, sel):
        x = x + self.self_attn(self.input_layernorm(x))
        if bool(sel.any()):
            h = self.post_attention_layernorm(x[sel])
            x = x.clone()
            x[sel] = x[sel] + self.mlp(h)
        return x


class RoutedLlama(TinyLlama):
    """``layers.1`` runs only on the rows whose first token is 1 (data-dependent: a dp rank whose
    rows all start otherwise never calls it; see :func:`batches`). ``route = "mlp"``: only
    ``layers.1.mlp`` is skipped there (``layers.1`` itself always runs)."""

    route = "mlp"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.layers[1].__class__ = RoutedBlock

    def forward(self, ids):
        x = self.embed_tokens(ids[:, :-1])
        x = self.layers[0](x)
        sel = ids[:, 0] == 1
        if self.route == "layer":  # the FSDP2 unit itself skipped on some ranks
            if bool(sel.any()):
                x = x.clone()
                x[sel] = self.layers[1](x[sel], sel[sel])
        else:  # layers.1 always runs; its MLP only on the selected rows
            x = self.layers[1](x, sel)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def batches(cfg: dict) -> list:
    """``make_batches`` of ``cfg``; for the routed model, step 1's first dp half (rows 0, 1) never
    reaches ``layers.1`` and every other row does."""
    bs = make_batches(cfg.get("steps", STEPS), BATCH)
    if cfg.get("model") == "routed":
        for s, b in enumerate(bs):
            b[:, 0] = 1
            if s == 1:
                b[:2, 0] = 0
    return bs


class RegLlama(TinyLlama):
    """The loss plus ``1e-2 |layers.0.mlp.up_proj.weight|`` (Frobenius norm; ``reg_kind =
    "sq"``: its square), the weight read inside the block's forward, outside ``up_proj``'s own
    (as its full tensor when TP made it a DTensor, as plain TP does)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.layers[0].__class__ = RegBlock

    def forward(self, ids):
        self.layers[0].reg = None
        loss = super().forward(ids)
        return loss + 1e-2 * self.layers[0].reg


class RegBlock(Block):
    reg_kind = "norm"

    def forward(self, x):
        w = self.mlp.up_proj.weight
        w = w.full_tensor() if hasattr(w, "full_tensor") else w
        self.reg = w.norm() if self.reg_kind == "norm" else w.pow(2).sum()
        return super().forward(x)


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
    cls = {"reuse": ReuseLlama, "full_logits": FullLogitsLlama, "skip": SkipLlama,
           "routed": RoutedLlama,
           "reg": RegLlama}.get(cfg.get("model"), TinyLlama)
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
    if cfg.get("no_tp"):
        return
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    if cfg.get("sp"):  # torchtitan-style sequence parallel: activations Shard(1) between blocks
        apply_sp(model, tp_mesh)
        return
    plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN.items()
            if not (cfg.get("tp_only_mlp") and k.startswith("self_attn"))}
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, plan)
    if cfg.get("tp_lm_head") == "replicate_out":
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    elif cfg.get("tp_lm_head") == "dtensor_out":
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(use_local_output=False)})


def apply_sp(model, tp_mesh) -> None:
    """SequenceParallel norms, PrepareModuleInput(Shard(1) -> Replicate) before attention / MLP,
    Rowwise outputs Shard(1) (use_local_output=False), the embedding's output Shard(1) and
    lm_head Colwise from Shard(1) to a replicated output (the loss on the full logits)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    parallelize_module(model, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    prep = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": prep,
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": prep,
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})


def _rebuild(cfg, mesh, ded_mesh, dp_mesh, ded_kw, z3, mp):
    """A fresh model (other weights) and optimizer, prepared as in :func:`run` (order A)."""
    from torch.distributed.fsdp import fully_shard

    import dmuon
    model = build_model(cfg, seed=11)
    apply_tp(model, None if cfg.get("no_tp") else mesh["tp"], cfg)
    dmuon.dedicate_params(model, ded_mesh, predicate_of(cfg), reshard_after_forward=z3, **ded_kw)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=z3, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model, _muon(model)


def _muon(model):
    import dmuon
    return dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                      weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                      ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"],
                      adamw_betas=HP["adamw_betas"], adamw_eps=HP["adamw_eps"],
                      adamw_weight_decay=HP["adamw_weight_decay"])


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
    elif cfg.get("no_tp"):  # the same run without TP: a 1-D mesh of every rank
        mesh = dp_mesh = ded_mesh = init_device_mesh("cpu", (world,))
        ded_kw = {}
        dp_size, dp_index = world, rank
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh = ded_mesh = mesh["dp"]
        ded_kw = {}
        dp_size, dp_index = 2, mesh["dp"].get_local_rank()
    z3 = cfg.get("z3", True)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if cfg.get("mp") else MixedPrecisionPolicy())
    model = build_model(cfg, seed=5 if cfg.get("load_plain") else 0)
    RegBlock.reg_kind = cfg.get("reg_kind", "norm")
    if cfg.get("frozen"):  # a frozen TP matrix
        model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    pred = predicate_of(cfg)
    if cfg.get("boundary") == "sub":  # hooks on the attention / MLP modules
        ded_kw["hook_boundary_predicate"] = lambda m: type(m).__name__ in ("Attention", "MLP")
    if cfg.get("order") == "B":
        dmuon.dedicate_params(model, ded_mesh, pred, reshard_after_forward=z3, **ded_kw)
        apply_tp(model, None if cfg.get("no_tp") else mesh["tp"], cfg)
    else:
        apply_tp(model, None if cfg.get("no_tp") else mesh["tp"], cfg)
        dmuon.dedicate_params(model, ded_mesh, pred, reshard_after_forward=z3, **ded_kw)
    for layer in ([] if cfg.get("root_only") else model.layers):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=z3, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    opt = dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                     weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                     ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"], adamw_betas=HP["adamw_betas"],
                     adamw_eps=HP["adamw_eps"], adamw_weight_decay=HP["adamw_weight_decay"])
    if cfg.get("load_plain"):  # weights from a plain model's state_dict (e.g. pretrained)
        other = build_model(cfg, seed=0)
        dmuon.set_model_state_dict(model, other.state_dict())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor) if cfg.get("sched") else None
    accum = cfg.get("accum", 1)
    losses, norms, extra = [], [], {}
    for step, ids in enumerate(batches(cfg)):
        if not cfg.get("hf_zero"):
            opt.zero_grad(set_to_none=not cfg.get("zero_keep"))
        local = ids.chunk(dp_size)[dp_index]
        if cfg.get("model") == "skip":
            model.skip = step == 1
        if cfg.get("eval"):
            with torch.inference_mode() if cfg["eval"] == "inference" else torch.no_grad():
                model(local)
        tot = 0.0
        for i, mb in enumerate(local.chunk(accum)):
            ctx = (contextlib.nullcontext() if i == accum - 1 or cfg.get("accum_sync")
                   else dmuon.no_sync(model))
            with ctx:
                loss = model(mb) / accum
                loss.backward()
            tot += float(loss.detach())
        losses.append(tot)
        if cfg.get("clip") and cfg.get("torch_clip"):
            from dist_utils import catch
            extra["torch_clip"] = catch(lambda: torch.nn.utils.clip_grad_norm_(
                model.parameters(), cfg["clip"]))
            norms.append(float(dmuon.clip_grad_norm_(model, cfg["clip"])))
        elif cfg.get("clip"):
            norms.append(float(dmuon.clip_grad_norm_(model, cfg["clip"])))
        opt.step()
        if cfg.get("resume_at") == step:  # checkpoint, a fresh model + optimizer, resume
            msd = dmuon.get_model_state_dict(model)
            osd = dmuon.get_optimizer_state_dict(model, opt)
            model, opt = _rebuild(cfg, mesh, ded_mesh, dp_mesh, ded_kw, z3, mp)
            dmuon.set_model_state_dict(model, msd)
            dmuon.set_optimizer_state_dict(model, opt, osd)
        if cfg.get("hf_zero"):
            model.zero_grad()
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
    RegBlock.reg_kind = cfg.get("reg_kind", "norm")
    if cfg.get("frozen"):
        model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    pred = predicate_of(cfg)
    mats = {n: p for n, p in model.named_parameters() if pred(n, p) and p.requires_grad}
    rest = [p for n, p in model.named_parameters() if n not in mats and p.requires_grad]
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

    for s, ids in enumerate(batches(cfg)):
        model.zero_grad(set_to_none=True)
        if cfg.get("model") == "skip":
            model.skip = s == 1
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
