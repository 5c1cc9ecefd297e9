"""Shared training harness for the stateful-layer tests: a distributed run (dedicate_params +
fully_shard + dmuon.Muon) and an independent single-process reference (functional Muon with fp64
Newton–Schulz for the matrices, ``torch.optim.AdamW`` for the rest, full batch)."""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from models import make_batches, make_model, muon_predicate

HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, ns_steps=5,
          adamw_lr=3e-3, adamw_betas=(0.9, 0.99), adamw_eps=1e-8, adamw_weight_decay=0.02)


def lr_factor(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def model_kwargs(cfg: dict) -> dict:
    return dict(mha_style=cfg.get("mha", False), checkpointing=cfg.get("ckpt", False),
                tie=cfg.get("tie", False), n_layers=cfg.get("layers", 2),
                root_proj=cfg.get("root_proj", False), tie_proj=cfg.get("tie_proj", False))


def reference_run(cfg: dict) -> dict[str, Any]:
    """Single-process reference; returns final state dict, per-step grad norms and losses."""
    steps, batch = cfg.get("steps", 10), cfg.get("batch", 4)
    return reference_train(make_model(**model_kwargs(cfg)), make_batches(steps, batch), cfg)


def reference_train(model: torch.nn.Module, batches: list, cfg: dict,
                    loss_of: Any = lambda out: out) -> dict[str, Any]:
    """Train ``model`` in one process on the full ``batches`` with functional Muon (fp64 NS) for
    the ``muon_predicate`` matrices and ``torch.optim.AdamW`` for the rest, ``HP``'s settings
    (``cfg``: ``sched``, ``clip``). ``loss_of(model(ids))`` is the loss."""
    from dmuon.functional import muon as fmuon

    mats = {n: p for n, p in model.named_parameters() if muon_predicate(n, p)}
    rest = [p for n, p in model.named_parameters() if n not in mats]
    adam = torch.optim.AdamW(rest, lr=HP["adamw_lr"], betas=HP["adamw_betas"], eps=HP["adamw_eps"],
                             weight_decay=HP["adamw_weight_decay"], foreach=False)
    state = fmuon.init({n: p.detach() for n, p in mats.items()})
    norms, losses = [], []
    for step, ids in enumerate(batches):
        f = lr_factor(step) if cfg.get("sched") else 1.0
        model.zero_grad(set_to_none=True)
        loss = loss_of(model(ids))
        loss.backward()
        losses.append(float(loss.detach()))
        if cfg.get("clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])))
        if cfg.get("clip_value"):
            torch.nn.utils.clip_grad_value_(model.parameters(), cfg["clip_value"])
        hp = fmuon.MuonHParams(lr=HP["lr"] * f, momentum=HP["momentum"], nesterov=HP["nesterov"],
                               weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                               ns_dtype=torch.float64)
        with torch.no_grad():
            _, state = fmuon.update({n: p.grad for n, p in mats.items()}, state,
                                    {n: p.data for n, p in mats.items()}, hp, donate=True)
            if cfg.get("momentum_dtype") is not None:  # stored rounded, as dmuon stores it
                from dmuon.functional.state_dtype import round_trip
                state = state._replace(momentum={n: round_trip(b, cfg["momentum_dtype"])
                                                 for n, b in state.momentum.items()})
        for g in adam.param_groups:
            g["lr"] = HP["adamw_lr"] * f
        adam.step()
        if cfg.get("adamw_state_dtype") is not None:  # moments stored rounded, as dmuon stores them
            from dmuon.functional.state_dtype import round_trip
            for st in adam.state.values():
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k].copy_(round_trip(st[k], cfg["adamw_state_dtype"]))
    return {"sd": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "norms": norms, "losses": losses}


def _local_numel(p: torch.Tensor) -> int:
    """The elements of ``p``'s local tensor (a dedicated placeholder's ``.data`` raises: read it
    past the guard)."""
    from dmuon.compat.torch_api import torch_function_disabled
    with torch_function_disabled():
        return p.data.numel()


def build_dmuon(rank: int, world: int, model: torch.nn.Module, blocks, cfg: dict,
                **dedicate_kw: Any):
    """``dedicate_params`` + ``fully_shard`` (each of ``blocks``, then the model with FSDP2's
    default root setting) + ``dmuon.Muon`` with ``HP`` and fp64 NS, on a 1-D mesh of ``world``
    ranks or (``cfg["hsdp"]``) a 2 x (world / 2) HSDP mesh; ``cfg["z3"]`` (default True);
    ``cfg["predicate"]`` (default ``muon_predicate``) picks the dedicated matrices.
    Returns ``(model, optimizer)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    z3, R = cfg.get("z3", True), 2 if cfg.get("hsdp") else 1
    if R > 1:
        mesh = init_device_mesh("cpu", (R, world // R), mesh_dim_names=("replicate", "shard"))
        shard_mesh, rep_mesh = mesh["shard"], mesh["replicate"]
    else:
        mesh = shard_mesh = init_device_mesh("cpu", (world,))
        rep_mesh = None
    dmuon.dedicate_params(model, shard_mesh, cfg.get("predicate", muon_predicate), replicate_mesh=rep_mesh,
                          reshard_after_forward=z3, **dedicate_kw)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=z3)
    # the root with FSDP2's default (not resharded after forward): FSDP2's own pre-backward hook
    # cannot see into a plain object output, so a resharded root would fail in FSDP2 there
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                     weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                     ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"], adamw_betas=HP["adamw_betas"],
                     adamw_eps=HP["adamw_eps"], adamw_weight_decay=HP["adamw_weight_decay"],
                     **cfg.get("muon_kw", {}))
    return model, opt


class _count_guard_calls:
    """Counts the calls of dmuon's ``__torch_function__`` guards (a Python dispatch each) until
    :meth:`stop`, except while :meth:`paused`: dmuon's own per-step reads and writes of its
    placeholders and markers go around them (``guard_base.plain_access``), so the training loop's
    ``zero_grad()``, forward, backward, clip and step make none."""

    def __init__(self) -> None:
        from dmuon.stateful.runtime.guard_base import TorchGuard
        self.n, self._on, self._cls = 0, True, TorchGuard
        self._orig = TorchGuard.__dict__["__torch_function__"]
        orig = self._orig.__func__

        def counted(cls, func, types, args=(), kwargs=None):
            self.n += self._on
            return orig(cls, func, types, args, kwargs)
        TorchGuard.__torch_function__ = classmethod(counted)

    @contextlib.contextmanager
    def paused(self):
        self._on = False
        try:
            yield
        finally:
            self._on = True

    def stop(self) -> None:
        self._cls.__torch_function__ = self._orig


def distributed_run(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    """The same training with dmuon on ``world`` gloo ranks, each on its slice of the batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.stateful.extras.grad_clip import clip_grad_norm_
    from dmuon.stateful.runtime.no_sync import no_sync
    from dmuon.stateful.optimizer.muon import Muon
    from dmuon.stateful.runtime.state import get_state
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict

    steps, batch = cfg.get("steps", 10), cfg.get("batch", 4)
    z3 = cfg.get("z3", True)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dev = cfg.get("device", "cpu")
    if dev == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    R = 2 if cfg.get("hsdp") else 1
    if R > 1:
        mesh = init_device_mesh(dev, (R, world // R), mesh_dim_names=("replicate", "shard"))
        shard_mesh, rep_mesh = mesh["shard"], mesh["replicate"]
    else:
        mesh = shard_mesh = init_device_mesh(dev, (world,))
        rep_mesh = None
    model = make_model(dtype=cfg.get("dtype", torch.float64), **model_kwargs(cfg)).to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.get("mp") else MixedPrecisionPolicy()
    boundary = None
    if cfg.get("boundary") == "sub":  # attention / MLP modules instead of the layers.N blocks
        boundary = lambda m: type(m).__name__ in ("Attention", "MHAStyleAttention", "MLP")  # noqa
    owners = dedicate_params(model, shard_mesh, muon_predicate, replicate_mesh=rep_mesh,
                             reshard_after_forward=z3, hook_boundary_predicate=boundary,
                             mp_policy=mp if cfg.get("mp") == "explicit" else None,
                             **cfg.get("dedicate_kw", {}))
    if cfg.get("fsdp", True):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=z3, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=z3, mp_policy=mp)
    seen_dtypes = []
    model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a: seen_dtypes.append(str(m.q_proj.weight.dtype if hasattr(m, "q_proj")
                                            else m.in_proj_weight.dtype)))
    from torch.distributed.tensor import DTensor
    ded = set(owners)
    layout = {"dedicated_dtensor": [n for n, p in model.named_parameters()
                                    if p in ded and isinstance(p, DTensor)],
              "fsdp_plain": [n for n, p in model.named_parameters()
                             if p not in ded and not isinstance(p, DTensor)],
              "dedicated_bytes": sum(rt_p.numel() * rt_p.element_size()
                                     for rt_p in get_state(model).masters.values()),
              "placeholder_numel": [_local_numel(p) for p in ded]}  # the local storage
    opt = Muon(model, **{**dict(
        lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
        weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"], ns_dtype=torch.float64,
        adamw_lr=HP["adamw_lr"], adamw_betas=HP["adamw_betas"], adamw_eps=HP["adamw_eps"],
        adamw_weight_decay=HP["adamw_weight_decay"]), **cfg.get("muon_kw", {})})
    ns_modes = []
    sched = None
    if cfg.get("sched"):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    accum = cfg.get("accum", 1)
    norms, losses, lrs = [], [], []
    rt = opt.dedicated_state
    guard_calls = _count_guard_calls()
    for step, ids in enumerate(make_batches(steps, batch)):
        if not cfg.get("hf_zero"):
            opt.zero_grad()  # (set_to_none=True: around the guards too)
        local = ids.chunk(world)[rank].to(dev)
        if cfg.get("eval"):  # an extra no-grad forward must not change anything
            with torch.no_grad():
                model(local)
        micro = local.chunk(accum)
        tot = 0.0
        for i, mb in enumerate(micro):
            sync = i == accum - 1 or cfg.get("accum_sync")  # accum_sync: reduce every micro-batch
            ctx = contextlib.nullcontext() if sync else no_sync(model)
            with ctx:
                loss = model(mb) / accum
                loss.backward()
            tot += float(loss.detach())
        losses.append(tot)
        if cfg.get("clip"):
            norms.append(float(clip_grad_norm_(model, cfg["clip"])))
        lrs.append((opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]))
        opt.step()
        if cfg.get("ns_modes"):  # how the owner's NS ran (a host sync: only when asked)
            ns_modes.append(opt.last_step_stats().ns_mode)
        if cfg.get("hf_zero"):  # HF Trainer: only model.zero_grad() after the step
            with guard_calls.paused():  # torch's Module.zero_grad: a guarded get and set each
                model.zero_grad()
        if sched is not None:
            sched.step()
    guard_calls.stop()
    sd = get_model_state_dict(model, cpu_offload=True)
    layout["gathered_bytes_after_step"] = sum(b.untyped_storage().size()
                                              for g in rt.groups.values() for b in g.unshard_buffers.values())
    layout["master_columns_ok"] = all(rt.owners[n][0] == rt.coord[0] for n in rt.masters)
    groups = sorted(rt.groups)
    return {"sd": sd, "groups": groups, "norms": norms, "losses": losses, "lrs": lrs,
            "owners": sorted(owners.values()), "counters": rt.executor.counters(),
            "program_counters": opt.program.rank_counters(rt.coord),
            "split_units": [sp.param for sp in rt.plan.splits],
            "collective_styles": {k: getattr(g, "collectives", "per_owner")
                                  for k, g in rt.program.groups.items()},
            "collective_reasons": {k: getattr(g, "collectives_reason", "")
                                   for k, g in rt.program.groups.items()},
            "owned": list(rt.owned_names), "layout": layout, "R": R, "ns_modes": ns_modes,
            "guard_calls": guard_calls.n,
            "seen_dtypes": sorted(set(seen_dtypes)),
            "master_dtypes": sorted({str(m.dtype) for m in rt.masters.values()}),
            "reduce_dtypes": sorted({str(g.reduce_dtype) for g in rt.groups.values()}),
            "total_dedicated_bytes": sum(math.prod(rt.shape[n]) * rt.orig_dtype[n].itemsize
                                         for n in rt.names),
            # the reduces' presence elements: one per matrix, in its group's reduce dtype
            "presence_bytes": sum(rt.groups[rt.group_of[n]].reduce_dtype.itemsize
                                  for n in rt.names)}


def max_rel_err(a: dict, b: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for k in b:
        x, y = a[k].double(), b[k].double()
        err = float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
        if err > worst:
            worst, where = err, k
    return worst, where
