"""Meta-device init (issue 21): a model built under ``torch.device("meta")`` -> dedicate_params ->
fully_shard -> ``model.to_empty(device="cpu")`` -> the model's own init (each module's
``reset_parameters``, or a torchtitan-style ``init_weights``) -> dmuon.Muon.

Checked per spawned group: no rank allocates a dedicated matrix it does not hold (before and after
``to_empty``; the holders' params are their masters, so ``to_empty`` allocates nothing new for
them either); the init runs on every rank (``nn.Linear(bias=True).reset_parameters`` included);
the owner's matrix has the init's distribution; in HSDP every rank of the owner's column ends with
the owner's values (the replicas draw different random numbers); 5 fp64 steps equal a
single-process reference started from the init values read with ``get_model_state_dict``; a
model left on meta raises at ``dmuon.Muon`` on every rank, naming ``to_empty``.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import assert_all_ranks, catch, run_ranks
from models import make_batches, muon_predicate
from stateful_harness import HP, max_rel_err, reference_train

STEPS = 5


class _Attn(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=True)  # reset_parameters reads the weight's fan-in

    def forward(self, x):
        b, t, d = x.shape

        def split(y):
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return self.o_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.self_attn = _Attn(dim, heads)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-6)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        x = x + self.self_attn(self.attn_norm(x))
        return x + self.down_proj(F.silu(self.up_proj(self.mlp_norm(x))))


class MetaLM(nn.Module):
    """A Llama-shaped LM whose init is its modules' ``reset_parameters`` or :meth:`init_weights`
    (torchtitan's style: ``trunc_normal_`` per matrix). ``forward(ids)`` returns the loss."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, hidden: int = 24,
                 n_layers: int = 2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Block(dim, heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def init_weights(self) -> None:
        for n, p in self.named_parameters():
            if p.ndim == 2:
                std = 0.02 if "proj" in n else 1.0
                nn.init.trunc_normal_(p, mean=0.0, std=std, a=-2 * std, b=2 * std)
            elif n.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def forward(self, ids):
        x = self.embed_tokens(ids[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _init(model: nn.Module, how: str) -> None:
    if how == "titan":
        model.init_weights()
    else:
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        with torch.no_grad():  # non-trivial norms so their gradients matter
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.add_(0.1)


def _storage_bytes(p: torch.Tensor) -> int:
    return p.untyped_storage().size()


def _meshes(world: int, hsdp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        return mesh, mesh["shard"], mesh["replicate"]
    mesh = init_device_mesh("cpu", (world,))
    return mesh, mesh, None


def _layout(st) -> dict:
    """Whether only the holders of a master have a dedicated param's storage, and that storage
    is the master itself."""
    nonheld = sum(_storage_bytes(p) for n, p in st.params.items() if n not in st.masters)
    aliased = all(p.data_ptr() == st.masters[n].data_ptr()
                  for n, p in st.params.items() if n in st.masters)
    return {"nonheld_bytes": nonheld, "held_alias_master": aliased,
            "held": sorted(st.masters), "columns_ok": all(st.owners[n][0] == st.coord[0]
                                                          for n in st.masters)}


def _worker(rank: int, world: int, cfg: dict) -> dict:
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.stateful.runtime.state import get_state

    torch.set_default_dtype(torch.float64)
    out: dict = {}
    mesh, shard_mesh, rep_mesh = _meshes(world, cfg.get("hsdp", False))
    with torch.device("meta"):
        model = MetaLM()
    dmuon.dedicate_params(model, shard_mesh, muon_predicate, replicate_mesh=rep_mesh)
    st = get_state(model)
    out["after_dedicate"] = _layout(st)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # a forgotten to_empty: Muon raises on every rank, nothing changes (window stays open)
    out["muon_on_meta"] = catch(lambda: dmuon.Muon(model))
    model.to_empty(device="cpu")
    out["after_to_empty"] = _layout(st)
    torch.manual_seed(100)  # as torchtitan: one seed (FSDP2's HSDP replicas must draw alike)
    _init(model, cfg["init"])
    if cfg.get("hsdp"):  # the other replicas of a column drew differently: the owner's must win
        with torch.no_grad():
            for n, m in st.masters.items():
                if st.owners[n] != st.coord:
                    m.add_(1.0)
    sd0 = dmuon.get_model_state_dict(model)
    out["sd0"] = sd0
    out["masters_vs_sd0"] = max((float((m - sd0[n]).abs().max()) for n, m in st.masters.items()),
                                default=0.0)
    out["placeholders"] = all(st.storage.is_placeholder(n) for n in st.params)
    opt = dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                     weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                     ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"], adamw_betas=HP["adamw_betas"],
                     adamw_eps=HP["adamw_eps"], adamw_weight_decay=HP["adamw_weight_decay"])
    losses = []
    for ids in make_batches(STEPS, 4):
        opt.zero_grad()
        loss = model(ids.chunk(world)[rank])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    out["sd"] = dmuon.get_model_state_dict(model)
    out["losses"] = losses
    if cfg.get("bf16"):  # fp32 masters of bf16 params: the init goes through a bf16 temporary
        torch.set_default_dtype(torch.float32)
        with torch.device("meta"):
            m16 = MetaLM().to(torch.bfloat16)
        dmuon.dedicate_params(m16, shard_mesh, muon_predicate, replicate_mesh=rep_mesh)
        fully_shard(m16, mesh=mesh)
        m16.to_empty(device="cpu")
        m16.init_weights()
        sd16 = dmuon.get_model_state_dict(m16)
        st16 = get_state(m16)
        out["bf16"] = {n: (str(m.dtype), float((m - sd16[n].float()).abs().max()),
                           float(sd16[n].float().std())) for n, m in st16.masters.items()}
    return out


def _reference(sd0: dict) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        model = MetaLM()
    finally:
        torch.set_default_dtype(torch.float32)
    model.load_state_dict(sd0)
    return reference_train(model, make_batches(STEPS, 4), {})


def _check(results: list, init: str, hsdp: bool = False) -> None:
    world = len(results)
    for r, out in enumerate(results):
        for when in ("after_dedicate", "after_to_empty"):
            lay = out[when]
            assert lay["nonheld_bytes"] == 0, (r, when, lay)
            assert lay["held_alias_master"] and lay["columns_ok"], (r, when, lay)
        assert out["placeholders"], r
        assert out["masters_vs_sd0"] == 0.0, (r, out["masters_vs_sd0"])
    assert_all_ranks(results, "muon_on_meta", "RuntimeError", "meta device", "to_empty")
    held = [set(o["after_dedicate"]["held"]) for o in results]
    n_ded = len(set().union(*held))
    G = world // 2 if hsdp else world
    assert sum(len(h) for h in held) == n_ded * (world // G)  # each matrix on its column only
    sd0 = results[0]["sd0"]
    for out in results[1:]:
        assert all(torch.equal(out["sd0"][k], v) for k, v in sd0.items())
    for n, v in sd0.items():  # the init wrote every dedicated matrix (its distribution)
        if not muon_predicate(n, v):
            continue
        if init == "titan":
            assert abs(float(v.std()) - 0.02) < 0.008 and float(v.abs().max()) <= 0.04 + 1e-12, n
        else:
            bound = 1.0 / math.sqrt(v.shape[1])  # kaiming_uniform_(a=sqrt(5))
            assert float(v.abs().max()) <= bound and float(v.std()) > 0.3 * bound, n
    ref = _reference(sd0)
    for out in results:
        err, where = max_rel_err(out["sd"], ref["sd"])
        assert err <= 1e-10, (err, where)
        # each rank's loss is on its slice of the batch; their mean is the full batch's
    mean_losses = [sum(o["losses"][i] for o in results) / world for i in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(mean_losses, ref["losses"])) < 1e-10
    for out in results:
        for n, (dt, diff, std) in out.get("bf16", {}).items():
            assert dt == "torch.float32" and diff == 0.0 and abs(std - 0.02) < 0.008, (n, dt, diff, std)


def test_meta_init_two_ranks_reset_parameters():
    """2 ranks, each module's reset_parameters (nn.Linear with a bias among the matrices)."""
    _check(run_ranks(_worker, 2, {"init": "reset", "bf16": True}), "reset")


@pytest.mark.slow
def test_meta_init_four_ranks_init_weights():
    """4 ranks, a torchtitan-style init_weights (trunc_normal_)."""
    _check(run_ranks(_worker, 4, {"init": "titan"}, timeout=120), "titan")


@pytest.mark.slow
def test_meta_init_hsdp_2x2():
    """HSDP 2 x 2: the replicas of the owner's column end with the owner's values."""
    _check(run_ranks(_worker, 4, {"init": "reset", "hsdp": True}, timeout=120), "reset",
           hsdp=True)


def test_meta_selection_mixed_raises():
    from dmuon.functional.selection import check_meta_selection
    a = nn.Parameter(torch.empty(2, 2, device="meta"))
    b = nn.Parameter(torch.empty(2, 2))
    assert check_meta_selection({"a": a}) is True
    assert check_meta_selection({"b": b}) is False
    with pytest.raises(ValueError, match="meta device"):
        check_meta_selection({"a": a, "b": b})


def _uninit(shape, holds: bool):
    from dmuon.stateful.modes.meta_init import DedicatedUninit, _Info
    p = nn.Parameter(torch.empty(shape if holds else (0,)))
    p._dmuon_uninit = _Info("w", tuple(shape), holds, torch.device("cpu"), owner=1)
    p.__class__ = DedicatedUninit
    return p


def test_uninit_param_on_a_rank_without_the_matrix():
    """No storage, full-shape metadata, init and in-place writes are no-ops, reads raise,
    to_empty keeps it (and refuses another device)."""
    from dmuon.stateful.runtime.guards import DedicatedParamError
    lin = nn.Linear(3, 4, bias=True)
    lin.weight = _uninit((4, 3), holds=False)
    w = lin.weight
    assert w.shape == (4, 3) and w.dim() == 2 and w.size(1) == 3 and w.numel() == 12 and w.is_meta
    bias_before = lin.bias.detach().clone()
    torch.manual_seed(0)
    lin.reset_parameters()  # kaiming_uniform_ on the weight, the bias bound from its fan-in
    assert not torch.equal(lin.bias.detach(), bias_before)
    assert float(lin.bias.detach().abs().max()) <= 1 / math.sqrt(3)
    nn.init.trunc_normal_(w, std=0.02)
    with torch.no_grad():
        w.normal_()
        w.data.zero_()
        w.copy_(torch.ones(4, 3))
    assert w.untyped_storage().size() == 0
    with pytest.raises(DedicatedParamError, match="does not hold it"):
        w.sum()
    assert w.new_empty(2, 3).is_meta and torch.zeros_like(w).is_meta  # scratch: no storage
    with pytest.raises(DedicatedParamError, match="to_empty"):
        lin.to_empty(device="meta")  # another device than the master's
    lin.to_empty(device="cpu")
    assert lin.weight is w and w.untyped_storage().size() == 0 and w._dmuon_uninit.materialized


def test_uninit_param_on_the_holder_is_the_master():
    master = torch.zeros(4, 3)
    w = _uninit((4, 3), holds=True)
    w.data = master
    lin = nn.Linear(3, 4, bias=False)
    lin.weight = w
    lin.to_empty(device="cpu")  # keeps the master: no new storage
    assert w.data_ptr() == master.data_ptr()
    torch.manual_seed(0)
    lin.reset_parameters()
    assert float(master.abs().max()) > 0 and float(master.abs().max()) <= 1 / math.sqrt(3)
