"""The bitwise zoo: short real training runs in every mode of dmuon's runtime, digested exactly, so
that two commits (e.g. a refactor and its base) can be compared bit for bit.

Usage::

    python benchmarks/bitwise_zoo.py --out FILE.json [--only NAME ...]   # run, write digests
    python benchmarks/bitwise_zoo.py --compare A.json B.json [--ignore REGEX ...] [--common]
    python benchmarks/bitwise_zoo.py --list

To run another checkout (e.g. the base commit) with this script, copy it out of the tree and put
that checkout first on the path::

    cp benchmarks/bitwise_zoo.py /tmp/ && cd /path/to/base && \\
        PYTHONPATH=$PWD python /tmp/bitwise_zoo.py --out /tmp/base.json

Each scenario (``--list``) is 3 fp64 training steps (fp32/bf16 where it tests mixed precision) of a
tiny model defined here, on gloo CPU ranks (``dmuon.launch.run_local_ranks``; one spawned group
per world size, ``torch.set_num_threads(1)`` per rank), through dmuon's public API as of f573449
(``dedicate_params`` keywords, ``dmuon.Muon`` keywords, ``no_sync``, ``clip_grad_norm_``, the state
dict functions). After the run every rank records, per category:

* ``model``: ``dmuon.get_model_state_dict(model)``;
* ``optim_full``: ``dmuon.get_optimizer_state_dict(model, optimizer)`` (whatever it returns, the
  variants' state and scalars included);
* ``optim_torch``: ``optimizer.state_dict()`` (DTensor entries: the rank's local shard plus its
  placements; where it raises, e.g. under TP, the exception);
* ``traffic``: ``optimizer.last_step_stats()``'s per-lane collectives and payload bytes of the last
  step (lanes with no traffic left out) and the owned matrices / elements (no times);
* ``trace``: per-step losses, clip norms and the two groups' lrs (exact, ``float.hex``).

A tensor is recorded as the SHA-256 of its raw bytes (with its dtype and shape), plus its norm
to help debugging (not compared); any other leaf as its exact text (floats as ``float.hex``).
``--compare`` compares digests exactly (no tolerance) and exits 1 on any difference, naming the
tensors that differ, the keys present in one file only (and whether the same tensor is found
under another name: a rename) and the scenarios that raised in one run only. A scenario that
raises records its exception (type and message) per rank. ``--ignore`` drops
``scenario/category/key`` paths matching a regular expression (e.g. a renamed option in the
param groups), and is reported; ``--common`` compares only the scenarios both files have (after
an ``--only`` run). The committed digests of the base commit f573449 are
``benchmarks/results/bitwise_zoo_f573449.json`` (compare on the same torch version: the math of
torch's kernels is part of every digest).

Robustness: a scenario that raises on some rank may leave the group's collectives misaligned, so
the scenarios after it run again in a fresh spawned group (each alone if a group dies). Warnings
(e.g. a refactor's DeprecationWarning for an old spelling) never fail a run; they are listed per
scenario (not compared).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "dmuon")):  # run from a checkout: use its dmuon
    sys.path.insert(0, _ROOT)

log = logging.getLogger("bitwise_zoo")

STEPS, BATCH, SEQ, VOCAB = 3, 8, 9, 32
HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, ns_steps=5,
          ns_dtype=torch.float64, adamw_lr=3e-3, adamw_betas=(0.9, 0.99), adamw_eps=1e-8,
          adamw_weight_decay=0.02)
TP_PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
           "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col",
           "mlp.down_proj": "row"}
SPLIT = {"layers.0.mlp.gate_proj.weight": 3, "layers.1.mlp.down_proj.weight": 2,
         "layers.0.self_attn.q_proj.weight": 4}
FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------ tiny models
class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.hd = dim // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape

        def split(y):  # heads from the projection's width (fewer per rank under TP)
            return y.view(b, t, -1, self.hd).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return self.o_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedExperts(nn.Module):
    """An MoE experts module holding each kind of matrix as one 3-D stack ``(E, out, in)``
    (dmuon's default view: one matrix per expert). Token-id routing, router-weighted."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(n_experts, 2 * hidden, dim) / dim ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(n_experts, dim, hidden) / hidden ** 0.5)

    def forward(self, x, ids, gates):
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            sel = (ids % self.gate_up_proj.shape[0]) == e
            if not bool(sel.any()):
                continue
            g, u = (x[sel] @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            y = (F.silu(g) * u) @ self.down_proj[e].T
            out = out.index_put((sel,), out[sel] + gates[..., e][sel][:, None] * y)
        return out


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, experts: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = Attention(dim, heads)
        self.post_attention_layernorm = RMSNorm(dim)
        if experts:
            self.router = nn.Linear(dim, experts, bias=False)
            self.experts = FusedExperts(dim, hidden, experts)
        else:
            self.mlp = MLP(dim, hidden)

    def forward(self, x, ids):
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        if hasattr(self, "experts"):
            return x + self.experts(h, ids, self.router(h).softmax(-1))
        return x + self.mlp(h)


class TinyLM(nn.Module):
    """Llama-shaped causal LM, ``forward(ids)`` = mean next-token loss. ``root_proj``: a matrix
    outside the ``layers.N`` blocks, skipped on the ranks in ``skip_on``; ``experts``: the last
    block is an MoE block; ``ckpt``: activation checkpointing of the blocks; ``tie_proj``: the
    last block's ``up_proj`` is the first's."""

    def __init__(self, dim: int = 16, heads: int = 2, hidden: int = 24, n_layers: int = 2,
                 root_proj: bool = False, experts: int = 0, ckpt: bool = False,
                 tie_proj: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, dim)
        self.in_proj = nn.Linear(dim, dim, bias=False) if root_proj else None
        self.layers = nn.ModuleList(
            Block(dim, heads, hidden, experts if i == n_layers - 1 else 0) for i in range(n_layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        if tie_proj:  # one dedicated matrix used by two blocks
            self.layers[-1].mlp.up_proj.weight = self.layers[0].mlp.up_proj.weight
        self.ckpt = ckpt
        self.skip_on: frozenset = frozenset()
        self.rank = 0

    def forward(self, ids):
        inp = ids[:, :-1]
        x = self.embed_tokens(inp)
        if self.in_proj is not None and self.rank not in self.skip_on:
            x = x + self.in_proj(x)
        for layer in self.layers:
            if self.ckpt and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, inp, use_reentrant=False)
            else:
                x = layer(x, inp)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def make_model(dtype: torch.dtype = torch.float64, seed: int = 0, **kw: Any) -> TinyLM:
    """Deterministic weights (the same on every rank), vectors perturbed so they train."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = TinyLM(**kw).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    torch.random.set_rng_state(state)
    return model.to(dtype)


def batches(steps: int = STEPS, batch: int = BATCH) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(steps)]


def predicate(name: str, p: torch.Tensor) -> bool:
    """Muon: every >= 2-D param but the embedding, the head and the router."""
    return p.ndim >= 2 and not any(s in name for s in ("embed", "lm_head", "router"))


# ------------------------------------------------------------------------------ building blocks
@dataclass
class Run:
    """A finished scenario: what is digested."""

    model: nn.Module
    opt: Any
    trace: dict


def _muon(model: nn.Module, **kw: Any):
    import dmuon
    return dmuon.Muon(model, **{**HP, **kw})


def _fsdp(model: nn.Module, world: int, *, hsdp: bool = False, z3: bool = True, mp: Any = None,
          **dedicate_kw: Any) -> nn.Module:
    """``dedicate_params`` + ``fully_shard`` (each block, then the root) on a 1-D mesh or an HSDP
    (replicate 2, shard world/2) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dmuon
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        shard, rep = mesh["shard"], mesh["replicate"]
    else:
        mesh = shard = init_device_mesh("cpu", (world,))
        rep = None
    dmuon.dedicate_params(model, shard, predicate, replicate_mesh=rep, reshard_after_forward=z3,
                          **dedicate_kw)
    mp = mp or MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=z3, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=z3, mp_policy=mp)
    return model


def _ddp(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dmuon
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), predicate, data_parallel="ddp")
    return DDP(model)


def _tp(model: nn.Module, world: int) -> tuple[nn.Module, Any]:
    """dp (world/2) x tp 2: TP on every block's projections, then dedicate on dp, then
    ``fully_shard`` on dp. Returns the model and the dp mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    import dmuon
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN.items()}
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    dp = mesh["dp"]
    dmuon.dedicate_params(model, dp, predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, dp


def _lr_factor(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def _train(model: nn.Module, opt: Any, index: int, size: int, *, accum: int = 1,
           clip: float | None = None, sched: bool = False,
           skip: Callable[[int], frozenset] | None = None, steps: slice = slice(None)) -> Run:
    """``STEPS`` steps, each rank on its ``index`` of ``size`` slices of the global batch;
    ``accum`` micro-batches (all but the last under ``dmuon.no_sync``); ``clip``:
    ``dmuon.clip_grad_norm_``; ``sched``: a ``LambdaLR``; ``skip(step)``: the ranks that skip the
    root matrix in that step; ``steps``: which of the ``STEPS`` batches."""
    import dmuon
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor) if sched else None
    inner = getattr(model, "module", model)
    trace: dict = {"loss": [], "clip_norm": [], "lr": []}
    for step, ids in list(enumerate(batches()))[steps]:
        if skip is not None:
            inner.skip_on = skip(step)
        opt.zero_grad()
        micro = ids.chunk(size)[index].chunk(accum)
        total = 0.0
        for i, mb in enumerate(micro):
            ctx = dmuon.no_sync(model) if i < accum - 1 else contextlib.nullcontext()
            with ctx:
                loss = model(mb) / accum
                loss.backward()
            total += float(loss.detach())
        trace["loss"].append(total)
        if clip is not None:
            trace["clip_norm"].append(float(dmuon.clip_grad_norm_(model, clip)))
        trace["lr"].append([g["lr"] for g in opt.param_groups])
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return Run(model, opt, trace)


def _plain(world: int, rank: int, *, model_kw: dict | None = None, muon_kw: dict | None = None,
           hsdp: bool = False, train_kw: dict | None = None, dtype=torch.float64,
           **fsdp_kw: Any) -> Run:
    model = _fsdp(make_model(dtype, **(model_kw or {})), world, hsdp=hsdp, **fsdp_kw)
    model.rank = rank
    return _train(model, _muon(model, **(muon_kw or {})), rank, world, **(train_kw or {}))


# ------------------------------------------------------------------------------ scenarios
def _variant(name: str):
    from dmuon.functional import variants
    return getattr(variants, name)()


def _policy():
    from dmuon.functional.policy import ParamPolicy, Rule
    return ParamPolicy(rules=(Rule("*.q_proj.weight", lr_mult=0.5, wd_mult=2.0),
                              Rule("*.down_proj.weight", lr_mult=1.5)))


def _mp_fsdp():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def sc_ddp(rank: int, world: int, **muon_kw: Any) -> Run:
    model = _ddp(make_model(), world)
    return _train(model, _muon(model, **muon_kw), rank, world, accum=2, clip=0.5)


def sc_defaults(rank: int, world: int) -> Run:
    import dmuon
    model = _fsdp(make_model(), world)
    return _train(model, dmuon.Muon(model), rank, world)


def sc_tp(rank: int, world: int, **muon_kw: Any) -> Run:
    model, dp = _tp(make_model(), world)
    return _train(model, _muon(model, **muon_kw), dp.get_local_rank(), dp.size(), clip=0.5)


def sc_meta_init(rank: int, world: int) -> Run:
    """Built on meta, dedicated and sharded there, ``to_empty`` then each module's
    ``reset_parameters`` under one seed."""
    with torch.device("meta"):
        model = TinyLM()
    model = _fsdp(model.to(torch.float64), world)
    model.to_empty(device="cpu")
    torch.manual_seed(100)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.1)  # (an FSDP2 DTensor: the same value on every shard)
    return _train(model, _muon(model), rank, world)


def sc_resume(rank: int, world: int, how: str, **muon_kw: Any) -> Run:
    """2 steps, then a fresh model (other weights) and optimizer load the model's and the
    optimizer's state (``how``: dmuon's full dicts or torch's protocol) and take step 3."""
    import dmuon
    model = _fsdp(make_model(), world)
    opt = _muon(model, **muon_kw)
    first = _train(model, opt, rank, world, steps=slice(0, 2))
    msd = dmuon.get_model_state_dict(model)
    osd = dmuon.get_optimizer_state_dict(model, opt) if how == "full" else \
        copy.deepcopy(opt.state_dict())
    model2 = _fsdp(make_model(seed=5), world)
    opt2 = _muon(model2, **muon_kw)
    dmuon.set_model_state_dict(model2, msd)
    if how == "full":
        dmuon.set_optimizer_state_dict(model2, opt2, osd)
    else:
        opt2.load_state_dict(osd)
    run = _train(model2, opt2, rank, world, steps=slice(2, None))
    run.trace = {k: first.trace[k] + v for k, v in run.trace.items()}
    return run


def _sub_boundary(m: nn.Module) -> bool:
    return type(m).__name__ in ("Attention", "MLP")


#: name -> (world, fn(rank, world) -> Run, what it covers)
SCENARIOS: dict[str, tuple[int, Callable[[int, int], Run], str]] = {
    "z3": (2, lambda r, w: _plain(w, r), "ZeRO-3 (reshard after forward), 2 ranks"),
    "z2": (2, lambda r, w: _plain(w, r, z3=False), "ZeRO-2, 2 ranks"),
    "defaults": (2, sc_defaults, "dmuon.Muon(model) with every option at its default"),
    "z3_accum_no_sync": (2, lambda r, w: _plain(w, r, train_kw=dict(accum=2)),
                         "Z3, 2 micro-batches, the first under dmuon.no_sync"),
    "z2_accum_no_sync": (2, lambda r, w: _plain(w, r, z3=False, train_kw=dict(accum=2)),
                         "Z2, 2 micro-batches under dmuon.no_sync"),
    "tied_dedicated": (2, lambda r, w: _plain(w, r, model_kw=dict(tie_proj=True)),
                       "a dedicated matrix shared by two blocks"),
    "per_bucket": (2, lambda r, w: _plain(w, r, collectives="per_bucket"),
                   "collectives='per_bucket' (one collective per hook group's bucket)"),
    "per_bucket_z2": (2, lambda r, w: _plain(w, r, z3=False, collectives="per_bucket"),
                      "Z2 with collectives='per_bucket'"),
    "ddp": (2, sc_ddp, "data_parallel='ddp' + DistributedDataParallel, no_sync accumulation, "
                       "dmuon.clip_grad_norm_"),
    "ddp_fp8_offload": (2, lambda r, w: sc_ddp(r, w, momentum_dtype=FP8, offload_state=True),
                        "DDP mode with fp8 momentum offloaded"),
    "normuon": (2, lambda r, w: _plain(w, r, muon_kw=dict(transform=_variant("normuon"))),
                "variant NorMuon (transform=variants.normuon())"),
    "muon_hyperball": (2, lambda r, w: _plain(w, r, muon_kw=dict(
        transform=_variant("muon_hyperball"), weight_decay=0.0)), "variant Muon-Hyperball"),
    "momentum_bf16": (2, lambda r, w: _plain(w, r, muon_kw=dict(momentum_dtype=torch.bfloat16)),
                      "momentum_dtype=bfloat16"),
    "momentum_fp8": (2, lambda r, w: _plain(w, r, muon_kw=dict(momentum_dtype=FP8)),
                     "momentum_dtype=float8_e4m3fn (scaled)"),
    "offload": (2, lambda r, w: _plain(w, r, muon_kw=dict(offload_state=True)),
                "offload_state=True (fp32 momentum on the host)"),
    "offload_fp8_z2": (2, lambda r, w: _plain(w, r, z3=False, muon_kw=dict(
        momentum_dtype=FP8, offload_state=True)), "fp8 momentum offloaded, Z2"),
    "adamw_state_bf16": (2, lambda r, w: _plain(w, r, muon_kw=dict(
        adamw_state_dtype=torch.bfloat16)), "adamw_state_dtype=bfloat16"),
    "moe_expert_stack": (2, lambda r, w: _plain(w, r, model_kw=dict(experts=4)),
                         "MoE block with fused 3-D expert stacks (one matrix per expert)"),
    "mixed_precision": (2, lambda r, w: _plain(w, r, dtype=torch.float32, mp=_mp_fsdp()),
                        "fp32 model, FSDP2 MixedPrecisionPolicy(bf16 params, fp32 reduce): "
                        "bf16 compute, fp32 masters"),
    "bf16_params": (2, lambda r, w: _plain(w, r, dtype=torch.bfloat16),
                    "bf16 model (fp32 masters, bf16 reduce)"),
    "grad_one_rank": (2, lambda r, w: _plain(w, r, model_kw=dict(root_proj=True), train_kw=dict(
        skip=lambda s: [frozenset({1}), frozenset(), frozenset({0, 1})][s])),
        "root-group matrix with a gradient on rank 0 only (step 0), on both (1), on none (2)"),
    "lr_scheduler": (2, lambda r, w: _plain(w, r, train_kw=dict(sched=True)),
                     "LambdaLR changing both groups' lr every step"),
    "clip": (2, lambda r, w: _plain(w, r, train_kw=dict(clip=0.5)), "dmuon.clip_grad_norm_(0.5)"),
    "sub_boundary_ckpt_root": (2, lambda r, w: _plain(
        w, r, model_kw=dict(root_proj=True, ckpt=True), hook_boundary_predicate=_sub_boundary),
        "hook boundary on attention/MLP modules, a root-group matrix, activation checkpointing"),
    "policy_mults": (2, lambda r, w: _plain(w, r, policy=_policy()),
                     "ParamPolicy rules with lr / weight-decay multipliers"),
    "meta_init": (2, sc_meta_init, "meta-device build, to_empty, reset_parameters"),
    "resume_full": (2, lambda r, w: sc_resume(r, w, "full"),
                    "2 steps, dmuon.get/set_model_state_dict + get/set_optimizer_state_dict into "
                    "a fresh model, 1 more step"),
    "resume_torch_normuon": (2, lambda r, w: sc_resume(r, w, "torch", transform=_variant(
        "normuon")), "NorMuon: 2 steps, Muon.state_dict() / load_state_dict into a fresh "
                     "optimizer, 1 more step"),
    "ddp_normuon": (2, lambda r, w: sc_ddp(r, w, transform=_variant("normuon")),
                    "DDP mode with NorMuon"),
    "hsdp": (4, lambda r, w: _plain(w, r, hsdp=True, train_kw=dict(accum=2, clip=0.5)),
             "HSDP 2 x 2, no_sync accumulation, clip"),
    "hsdp_fp8_offload_z2": (4, lambda r, w: _plain(w, r, hsdp=True, z3=False, muon_kw=dict(
        momentum_dtype=FP8, offload_state=True)), "HSDP 2 x 2, Z2, fp8 momentum offloaded"),
    "hsdp_normuon_hyperball": (4, lambda r, w: _plain(w, r, hsdp=True, muon_kw=dict(
        transform=_variant("normuon_hyperball"), weight_decay=0.0)),
        "HSDP 2 x 2 with NorMuon-Hyperball"),
    "hsdp_per_bucket_sync_publish": (4, lambda r, w: _plain(
        w, r, hsdp=True, collectives="per_bucket", muon_kw=dict(replicate_async=False)),
        "HSDP 2 x 2, per_bucket collectives, replicate_async=False"),
    "tp": (4, sc_tp, "TP: dp 2 x tp 2 (TP, then dedicate_params, then fully_shard), clip"),
    "tp_fp8": (4, lambda r, w: sc_tp(r, w, momentum_dtype=FP8),
               "TP dp 2 x tp 2 with fp8 momentum (one scale per whole matrix)"),
    "tp_normuon": (4, lambda r, w: sc_tp(r, w, transform=_variant("normuon")),
                   "TP dp 2 x tp 2 with NorMuon"),
    "split_ns": (4, lambda r, w: _plain(w, r, split_ns=dict(SPLIT)),
                 "split Newton-Schulz forced on three matrices (k = 3, 2, 4), 4 ranks"),
    "split_ns_bf16_offload": (4, lambda r, w: _plain(w, r, split_ns=dict(SPLIT), muon_kw=dict(
        momentum_dtype=torch.bfloat16, offload_state=True)),
        "split NS forced, bf16 momentum offloaded (the chunked momentum stage)"),
}


# ------------------------------------------------------------------------------ digests
def tensor_entry(t: torch.Tensor) -> dict:
    """SHA-256 of the raw bytes, dtype and shape (a DTensor: its local part, plus its placements
    and global shape), and the norm as a debugging aid (not compared)."""
    extra = {}
    if type(t).__name__ == "DTensor":
        extra = {"placements": str(tuple(t.placements)), "global_shape": list(t.shape)}
        t = t.to_local()
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    entry = {"sha256": h.hexdigest(), "dtype": str(t.dtype), "shape": list(t.shape), **extra}
    if t.is_floating_point() and t.numel():
        entry["norm"] = float(t.double().norm())
    return entry


def leaf_entry(v: Any) -> dict:
    """A non-tensor leaf, as exact text."""
    if isinstance(v, float):
        return {"value": float.hex(v)}
    if isinstance(v, (bool, int, str, type(None), torch.dtype)):
        return {"value": repr(v)}
    return {"value": f"{type(v).__name__}:{v!r}"}


def flatten(obj: Any, prefix: str = "", out: dict | None = None) -> dict:
    """``{path: entry}`` of every leaf of a nested dict / list / tuple (``path``: keys joined
    with ``/``)."""
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[prefix] = tensor_entry(obj)
    elif isinstance(obj, dict):
        if not obj:
            out[prefix] = {"value": "{}"}
        for k, v in obj.items():
            flatten(v, f"{prefix}/{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)) and not (obj and all(
            isinstance(x, (int, float, str, bool)) for x in obj)):
        if not obj:
            out[prefix] = {"value": "[]"}
        for i, v in enumerate(obj):
            flatten(v, f"{prefix}/{i}" if prefix else str(i), out)
    elif isinstance(obj, (list, tuple)):  # a tuple of scalars (betas, ...): one leaf
        out[prefix] = {"value": repr(tuple(float.hex(x) if isinstance(x, float) else x
                                           for x in obj))}
    else:
        out[prefix] = leaf_entry(obj)
    return out


def _guarded(fn: Callable[[], Any]) -> dict:
    try:
        return flatten(fn())
    except Exception as e:  # noqa: BLE001 - a path that raises is recorded, not fatal
        return {"__raised__": {"value": f"{type(e).__name__}: {e}"}}


def _traffic(opt: Any) -> dict:
    st = opt.last_step_stats()
    # a lane with no traffic is the same as no lane
    out: dict = {lane: dict(c) for lane, c in sorted(st.lanes.items()) if any(c.values())}
    for k in ("owned_matrices", "owned_elements", "dedicated_matrices", "adamw_params"):
        out[k] = getattr(st, k)
    return out


def record(run: Run) -> dict:
    """Every category of one finished run on this rank (the state dict getters are collective:
    every rank calls them in the same order)."""
    import dmuon
    out = {"traffic": _guarded(lambda: _traffic(run.opt))}
    out["trace"] = flatten({k: v for k, v in run.trace.items() if v})
    out["model"] = _guarded(lambda: dmuon.get_model_state_dict(run.model, cpu_offload=True))
    out["optim_full"] = _guarded(lambda: dmuon.get_optimizer_state_dict(run.model, run.opt,
                                                                        cpu_offload=True))
    out["optim_torch"] = _guarded(lambda: run.opt.state_dict())
    return out


# ------------------------------------------------------------------------------ running
def run_scenario(rank: int, world: int, name: str) -> dict:
    """One scenario on this rank: its records, or the exception it raised; its warnings."""
    import torch.distributed as dist
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float32)
    t0 = time.perf_counter()
    res: dict = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res["records"] = record(SCENARIOS[name][1](rank, world))
        except Exception as e:  # noqa: BLE001 - a scenario that raises is a result
            res["error"] = f"{type(e).__name__}: {e}"
    res["warnings"] = sorted({f"{w.category.__name__}: {w.message}"[:300] for w in caught})
    res["seconds"] = round(time.perf_counter() - t0, 3)
    try:
        dist.barrier()
    except Exception as e:  # the peers are elsewhere: say what this rank saw first
        raise RuntimeError(f"{name}: on this rank {res['error'] or 'no error'}; then the barrier "
                           f"after it failed: {str(e).splitlines()[0][:200]}") from None
    return res


def _worker(rank: int, world: int, names: list) -> dict:
    logging.basicConfig(level=logging.WARNING)
    warnings.simplefilter("default")  # even under -W error: a warning never fails a scenario
    import dmuon  # noqa: F401 - installs the fully_shard patch before any scenario
    return {name: run_scenario(rank, world, name) for name in names}


def _spawn(names: list, world: int, timeout_s: float) -> tuple[dict, str | None]:
    from dmuon.launch import run_local_ranks
    results, errors = run_local_ranks(_worker, world, (names,), {}, backend="gloo",
                                      timeout_s=timeout_s, grace_s=5.0,
                                      deadline_s=timeout_s + 30.0 * len(names))
    if errors:  # each failed rank's last line, and what the others recorded (the first cause)
        why = [f"rank {r}: {(errors[r].strip().splitlines() or ['?'])[-1]}" for r in sorted(errors)]
        why += [f"rank {r}: {n}: {res['error']}" for r in sorted(results)
                for n, res in results[r].items() if res["error"]]
        return {}, "; ".join(why)
    got = {n: {"world": world, "ranks": [results[r][n] for r in range(world)]} for n in names}
    return got, None


def run_group(names: list, world: int, timeout_s: float) -> dict:
    """``names`` in one spawned group of ``world`` ranks. The scenarios after one that raised on
    some rank run again in a fresh group (the raise may have misaligned the collectives); if the
    group died (a rank hung or exited), each scenario runs alone."""
    got, failed = _spawn(names, world, timeout_s)
    if failed:
        if len(names) == 1:
            return {names[0]: {"world": world, "ranks": [], "group_error": failed}}
        log.warning("group of %d ranks failed (%s): running each scenario alone", world, failed)
        out: dict = {}
        for n in names:
            out.update(run_group([n], world, timeout_s))
        return out
    first = next((i for i, n in enumerate(names) if any(r["error"] for r in got[n]["ranks"])),
                 len(names))
    out = {n: got[n] for n in names[:first + 1]}
    if first + 1 < len(names):
        out.update(run_group(names[first + 1:], world, timeout_s))
    return out


# ------------------------------------------------------------------------------ files
SAME = "__same_as_rank_0__"


def write(path: str, out: dict) -> None:
    """The results as JSON: the header indented, one line per scenario; a category of a rank
    > 0 equal to rank 0's is stored as ``{SAME: true}`` (the file stays small)."""
    for sc in out["scenarios"].values():
        for r in sc["ranks"][1:]:
            for cat, v in r.get("records", {}).items():
                if v == sc["ranks"][0]["records"][cat]:
                    r["records"][cat] = {SAME: True}
    head = json.dumps({k: v for k, v in out.items() if k != "scenarios"}, indent=1)
    lines = [f"  {json.dumps(n)}: {json.dumps(v, separators=(',', ':'))}"
             for n, v in out["scenarios"].items()]
    text = head[:-2] + ',\n "scenarios": {\n' + ",\n".join(lines) + "\n }\n}\n"
    json.loads(text)  # well formed
    with open(path, "w") as f:
        f.write(text)


def load(path: str) -> dict:
    """A results file, with every rank's categories in full."""
    with open(path) as f:
        out = json.load(f)
    for sc in out["scenarios"].values():
        for r in sc["ranks"][1:]:
            for cat, v in r.get("records", {}).items():
                if v == {SAME: True}:
                    r["records"][cat] = sc["ranks"][0]["records"][cat]
    return out


# ------------------------------------------------------------------------------ comparing
COMPARED = ("sha256", "dtype", "shape", "placements", "global_shape", "value")


def _same(a: dict, b: dict) -> bool:
    """Exactly equal digests (the norms are debugging aids, not compared)."""
    return all(a.get(k) == b.get(k) for k in COMPARED)


def compare_rank(ra: dict, rb: dict, keep: Callable[[str], bool]) -> list[str]:
    """Differences between two ranks' results of one scenario, as ``kind: category/key`` lines."""
    if ra.get("error") or rb.get("error"):
        if ra.get("error") == rb.get("error"):
            return []
        return [f"raised: A {ra.get('error')!r} / B {rb.get('error')!r}"]
    diffs = []
    ca, cb = ra["records"], rb["records"]
    for cat in sorted(set(ca) | set(cb)):
        a, b = ca.get(cat, {}), cb.get(cat, {})
        a = {k: v for k, v in a.items() if keep(f"{cat}/{k}")}
        b = {k: v for k, v in b.items() if keep(f"{cat}/{k}")}
        for k in sorted(set(a) & set(b)):
            if not _same(a[k], b[k]):
                what = "tensor differs" if "sha256" in a[k] or "sha256" in b[k] else "value differs"
                extra = ""
                if "norm" in a[k] and "norm" in b[k]:
                    extra = f" (norm {a[k]['norm']:.17g} vs {b[k]['norm']:.17g})"
                elif "value" in a[k] and "value" in b[k]:
                    extra = f" ({a[k]['value']} vs {b[k]['value']})"
                diffs.append(f"{what}: {cat}/{k}{extra}")
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        by_digest_b: dict = {}  # tensors only: many scalars share a value
        for k in only_b:
            if "sha256" in b[k]:
                by_digest_b.setdefault(b[k]["sha256"], []).append(k)
        for k in only_a:
            same = by_digest_b.get(a[k].get("sha256"))
            note = f" (same digest as B's {same[0]}: renamed?)" if same else ""
            diffs.append(f"only in A: {cat}/{k}{note}")
        for k in only_b:
            diffs.append(f"only in B: {cat}/{k}")
    return diffs


def compare(path_a: str, path_b: str, ignore: list[str], common: bool = False,
            show: int = 12) -> int:
    """Print per scenario ``equal`` / ``DIFFERENT`` (what differs); 1 if anything differs."""
    A, B = load(path_a), load(path_b)
    pats = [re.compile(p) for p in ignore]
    sa, sb = A["scenarios"], B["scenarios"]
    names = list(sa) + [n for n in sb if n not in sa]
    if common:
        names = [n for n in names if n in sa and n in sb]
    n_diff = 0
    log.info("A: %s (%s, %s)\nB: %s (%s, %s)", path_a, A.get("commit"), A.get("date"), path_b,
             B.get("commit"), B.get("date"))
    if ignore:
        log.info("ignoring paths matching: %s", ", ".join(ignore))
    for name in names:
        def keep(path: str, name: str = name) -> bool:
            return not any(p.search(f"{name}/{path}") for p in pats)

        if name not in sa or name not in sb:
            n_diff += 1
            log.info("%-30s DIFFERENT: only in %s", name, "B" if name not in sa else "A")
            continue
        a, b = sa[name], sb[name]
        if a.get("group_error") or b.get("group_error") or len(a["ranks"]) != len(b["ranks"]):
            same = a.get("group_error") == b.get("group_error") and not a["ranks"] and \
                not b["ranks"]
            n_diff += not same
            log.info("%-30s %s: no result: A %r / B %r", name, "equal" if same else "DIFFERENT",
                     a.get("group_error"), b.get("group_error"))
            continue
        per: dict[str, list[int]] = {}
        for rank, (ra, rb) in enumerate(zip(a["ranks"], b["ranks"])):
            for d in compare_rank(ra, rb, keep):
                per.setdefault(d, []).append(rank)
        new_warn = sorted({w for r in b["ranks"] for w in r.get("warnings", [])}
                          - {w for r in a["ranks"] for w in r.get("warnings", [])})
        raised = a["ranks"][0].get("error")
        status = "equal" + (f" (both raised {raised!r})" if raised and not per else "")
        if per:
            n_diff += 1
            status = f"DIFFERENT ({len(per)} differences)"
        log.info("%-30s %s", name, status)
        for d, ranks in list(per.items())[:show]:
            log.info("    ranks %s: %s", ",".join(map(str, ranks)), d)
        if len(per) > show:
            log.info("    ... and %d more", len(per) - show)
        for w in new_warn[:3]:
            log.info("    note: B warns (not compared): %s", w)
    log.info("%d of %d scenarios differ", n_diff, len(names))
    return 1 if n_diff else 0


# ------------------------------------------------------------------------------ main
def _commit() -> dict:
    import dmuon
    root = os.path.dirname(os.path.dirname(os.path.abspath(dmuon.__file__)))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "dmuon")
    return {"commit": git("rev-parse", "HEAD") or None, "dmuon_dirty": bool(dirty),
            "dmuon_file": dmuon.__file__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="run the zoo and write its digests here (JSON)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these scenarios")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two digest files")
    ap.add_argument("--ignore", action="append", default=[], metavar="REGEX",
                    help="with --compare: skip scenario/category/key paths matching REGEX")
    ap.add_argument("--common", action="store_true",
                    help="with --compare: only the scenarios both files have (e.g. after --only)")
    ap.add_argument("--list", action="store_true", help="list the scenarios")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="collective timeout per spawned group (s)")
    args = ap.parse_args()
    warnings.simplefilter("default")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.list:
        for name, (world, _, what) in SCENARIOS.items():
            log.info("%-30s %d ranks  %s", name, world, what)
        return 0
    if args.compare:
        return compare(*args.compare, args.ignore, args.common)
    if not args.out:
        ap.error("give --out FILE (run), --compare A B or --list")
    names = args.only or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; --list shows them")
    t0 = time.perf_counter()
    scenarios: dict = {}
    for world in sorted({SCENARIOS[n][0] for n in names}):
        group = [n for n in names if SCENARIOS[n][0] == world]
        t = time.perf_counter()
        scenarios.update(run_group(group, world, args.timeout))
        log.info("%d scenarios on %d ranks: %.1f s", len(group), world, time.perf_counter() - t)
    wall = time.perf_counter() - t0
    for name in names:
        s = scenarios[name]
        errs = {r["error"] for r in s["ranks"] if r["error"]} or (
            {s["group_error"]} if s.get("group_error") else set())
        log.info("%-30s %s", name, "; ".join(sorted(errs)) if errs else "ok")
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine_run_on": {"platform": platform.platform(),
                              "processor": platform.processor() or platform.machine(),
                              "cpus": os.cpu_count()},
           "python": sys.version.split()[0], "torch": torch.__version__, **_commit(),
           "wall_s": round(wall, 1), "steps": STEPS, "batch": BATCH,
           "note": "gloo CPU ranks, one thread each; digests are exact (SHA-256 of raw bytes); "
                   "compare runs of two commits with --compare on the same torch",
           "scenario_docs": {n: SCENARIOS[n][2] for n in names},
           "scenarios": {n: scenarios[n] for n in names}}
    write(args.out, out)
    log.info("wrote %s (%.1f s)", args.out, wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
