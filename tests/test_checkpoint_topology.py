"""Checkpoints resume exactly, at the same and at other topologies, in new processes.

fp64 model and Newton–Schulz. A run of 10 steps saves at step 5 (full dicts: rank-0 ``torch.save``
of ``get_model_state_dict`` + ``get_optimizer_state_dict``; sharded: ``save_sharded``) and goes on to
step 10 (the reference). Later process groups (new processes) load at step 5 at another
``(shard, replicate)`` shape and train steps 5..9: the result must equal the reference bitwise at
the same topology and to <= 1e-12 relative elsewhere (the gradient average is summed in another
order). Stages (module fixtures, each one ``run_ranks`` call):

* ``stage_a`` (4 ranks): save at G=4 (1-D) and at 2x2 (HSDP).
* ``stage_b`` (2 ranks): 4 -> 2, 2x2 -> 2 (full and sharded); save at G=2; bad dicts raise.
* ``stage_c`` (4 ranks): 4 -> 4 and 2x2 -> 2x2 bitwise, 2x2 -> 4, 2 -> 4, 4 -> 2x2.
* ``stage_d`` (1 process): 4 -> 1 and 2x2 -> 1 with dmuon on a world of one; the full files load
  into a plain model; DCP -> ``torch.save`` conversion; a plain functional resume with no dmuon
  model at all (:func:`functional_states_from_full`).

Sharded loads and saves run with ``DTensor.full_tensor`` disabled, and report the bytes each rank
asked for: exactly the bytes it stores (its shards, its owner column's matrices, its momentum).
"""
from __future__ import annotations

import os

import pytest

from dist_utils import run_ranks

TOPOS = {"g4": (4, 1), "hsdp": (2, 2), "g2": (2, 1), "g1": (1, 1)}  # name -> (G, R)
STEPS, HALF, BATCH = 10, 5, 4
HP = dict(lr=0.02, momentum=0.95, weight_decay=0.01, adamw_lr=3e-3, adamw_betas=(0.9, 0.99),
          adamw_weight_decay=0.02)
NEW_LR = (0.015, 2e-3)  # set after step 3: a resume must restore hparams from the checkpoint


def _build(topo, rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.stateful.optimizer.muon import Muon
    from models import make_model, muon_predicate

    G, R = TOPOS[topo]
    assert G * R == world, (topo, world)
    if R > 1:
        mesh = init_device_mesh("cpu", (R, G), mesh_dim_names=("replicate", "shard"))
        shard_mesh, rep_mesh = mesh["shard"], mesh["replicate"]
    else:
        mesh = shard_mesh = init_device_mesh("cpu", (G,))
        rep_mesh = None
    model = make_model(seed=3)
    dedicate_params(model, shard_mesh, muon_predicate, replicate_mesh=rep_mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, Muon(model, ns_dtype=torch.float64, **HP)


def _train(model, opt, rank, world, start, stop):
    from models import make_batches

    for step, ids in enumerate(make_batches(STEPS, BATCH)[start:stop], start):
        if step == 3:
            opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = NEW_LR
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()


class _NoGather:
    """Makes ``DTensor.full_tensor`` raise: proof that a code path never gathers a param."""

    def __enter__(self):
        from torch.distributed.tensor import DTensor
        self.orig = DTensor.full_tensor

        def refuse(*a, **k):
            raise AssertionError("a sharded checkpoint gathered a full tensor")
        DTensor.full_tensor = refuse

    def __exit__(self, *exc):
        from torch.distributed.tensor import DTensor
        DTensor.full_tensor = self.orig


def _own_bytes(model, opt):
    """Bytes this rank stores of params + optimizer state (counted independently of dmuon's IO)."""
    rt = opt.dedicated_state
    b = sum(3 * p.to_local().numel() * p.element_size() for _, p in opt.adamw_named_params)
    b += sum(rt.masters[n].numel() * rt.orig_dtype[n].itemsize for n in rt.masters)
    b += sum(rt.masters[n].numel() * rt.master_dtype[n].itemsize for n in rt.owned_names)
    return b


def _total_bytes(model, opt):
    import math

    rt = opt.dedicated_state
    return (sum(3 * p.numel() * p.element_size() for _, p in opt.adamw_named_params)
            + sum(math.prod(rt.shape[n]) * (rt.orig_dtype[n].itemsize + rt.master_dtype[n].itemsize)
                  for n in rt.names))


def _save(rank, world, root, topo, out):
    import torch
    import torch.distributed as dist

    from dmuon.checkpoint.sharded import save_sharded
    from dmuon.stateful.checkpoint.optimizer_state_dict import get_optimizer_state_dict
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict

    model, opt = _build(topo, rank, world)
    _train(model, opt, rank, world, 0, HALF)
    rank0_only = topo == "hsdp"  # the memory-saving variant for one of the saves
    sd = get_model_state_dict(model, cpu_offload=True, rank0_only=rank0_only)
    osd = get_optimizer_state_dict(model, opt, cpu_offload=True, rank0_only=rank0_only)
    if rank == 0:
        torch.save({"model": sd, "optim": osd, "step": HALF}, os.path.join(root, f"{topo}.pt"))
    elif rank0_only:
        out[f"{topo}:rank0_only_empty"] = not sd and not osd["fsdp2"] and not osd["dedicated"]
    with _NoGather():
        res = save_sharded(os.path.join(root, f"{topo}_dcp"), model, opt, extra={"step": HALF})
    out[f"{topo}:save"] = (res.bytes_written, res.bytes_local, _own_bytes(model, opt),
                           _total_bytes(model, opt))
    dist.barrier()
    _train(model, opt, rank, world, HALF, STEPS)
    ref = get_model_state_dict(model, cpu_offload=True)
    if rank == 0:
        torch.save(ref, os.path.join(root, f"{topo}_ref.pt"))


def _resume(rank, world, root, src, dst, mode, out, built):
    import torch

    from dmuon.checkpoint.sharded import load_sharded
    from dmuon.stateful.checkpoint.optimizer_state_dict import set_optimizer_state_dict
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from stateful_harness import max_rel_err

    if dst not in built:  # later loads overwrite a trained model: loading must replace everything
        built[dst] = _build(dst, rank, world)
    model, opt = built[dst]
    key = f"{src}->{dst}:{mode}"
    if mode == "full":
        ckpt = torch.load(os.path.join(root, f"{src}.pt"), map_location="cpu", weights_only=False)
        set_model_state_dict(model, ckpt["model"])
        set_optimizer_state_dict(model, opt, ckpt["optim"])
        step = ckpt["step"]
    elif mode == "full_rank0":
        ckpt = (torch.load(os.path.join(root, f"{src}.pt"), map_location="cpu", weights_only=False)
                if rank == 0 else {"model": None, "optim": None, "step": HALF})
        set_model_state_dict(model, ckpt["model"], rank0_only=True)
        set_optimizer_state_dict(model, opt, ckpt["optim"], rank0_only=True)
        step = ckpt["step"]
    else:
        with _NoGather():
            res = load_sharded(os.path.join(root, f"{src}_dcp"), model, opt)
        step = res.extra["step"]
        out[key + ":bytes"] = (res.bytes_requested, res.bytes_read, _own_bytes(model, opt),
                               _total_bytes(model, opt))
    lrs = (opt.param_groups[0]["lr"], opt.param_groups[1]["lr"])
    _train(model, opt, rank, world, step, STEPS)
    final = get_model_state_dict(model, cpu_offload=True)
    ref = torch.load(os.path.join(root, f"{src}_ref.pt"), weights_only=True)
    out[key] = {"bitwise": list(final) == list(ref) and all(torch.equal(final[k], ref[k]) for k in ref),
                "rel": max_rel_err(final, ref)[0], "step": step, "lrs": lrs}


def _stage(rank, world, root, loads=(), saves=(), extra=None):
    out: dict = {}
    built: dict = {}
    for src, dst, mode in loads:
        _resume(rank, world, root, src, dst, mode, out, built)
    for topo in saves:
        _save(rank, world, root, topo, out)
    if extra is not None:
        extra(rank, world, root, out)
    return out


def _bad_dicts(rank, world, root, out):
    """Mismatched dicts raise on every rank, before any collective, and name the entries."""
    import torch

    from dmuon.stateful.checkpoint.optimizer_state_dict import set_optimizer_state_dict
    from dmuon.stateful.checkpoint.state_dict import set_model_state_dict

    model, opt = _build("g2", rank, world)
    ckpt = torch.load(os.path.join(root, "g4.pt"), map_location="cpu", weights_only=False)
    bad = dict(ckpt["model"])
    if rank == 1:  # one rank's dict alone is wrong: every rank must raise, nobody hangs
        del bad["layers.0.mlp.up_proj.weight"]
        bad["layers.9.extra.weight"] = torch.zeros(2)
        bad["norm.weight"] = torch.zeros(5)
        bad["layers.1.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    for kw in ({}, {"strict": False}):
        try:
            set_model_state_dict(model, bad, **kw)
            out[f"bad_model{kw}"] = None
        except ValueError as e:
            out[f"bad_model{kw}"] = str(e)
    partial = {k: v for k, v in ckpt["model"].items() if k != "norm.weight"}
    partial["unused.bias"] = torch.zeros(1)
    res = set_model_state_dict(model, partial, strict=False)
    out["partial"] = (res.missing_keys, res.unexpected_keys)
    bad_o = dict(ckpt["optim"], dedicated=dict(ckpt["optim"]["dedicated"]))
    if rank == 0:
        bad_o["dedicated"]["layers.1.mlp.down_proj.weight"] = {"momentum_buffer": torch.zeros(3)}
    try:
        set_optimizer_state_dict(model, opt, bad_o)
        out["bad_optim"] = None
    except ValueError as e:
        out["bad_optim"] = str(e)


def _bf16_masters(rank, world, root, out):
    """bf16 params with fp32 masters: the optimizer dicts carry the masters, so both formats
    restore them (and the momentum) bitwise."""
    import torch

    from dmuon.checkpoint.sharded import load_sharded, save_sharded
    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.stateful.optimizer.muon import Muon
    from dmuon.stateful.checkpoint.optimizer_state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from models import make_model, muon_predicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build():
        mesh = init_device_mesh("cpu", (world,))
        model = make_model(seed=5, dtype=torch.bfloat16)
        dedicate_params(model, mesh, muon_predicate)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, Muon(model)

    model, opt = build()
    _train(model, opt, rank, world, 0, 2)
    sd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    save_sharded(os.path.join(root, "bf16_dcp"), model, opt)
    ok = []
    for mode in ("full", "dcp"):
        m2, o2 = build()
        if mode == "full":
            set_model_state_dict(m2, sd)
            set_optimizer_state_dict(m2, o2, osd)
        else:
            load_sharded(os.path.join(root, "bf16_dcp"), m2, o2)
        back = get_optimizer_state_dict(m2, o2)
        ok.append(all(torch.equal(back["dedicated"][n][k], v) for n, e in osd["dedicated"].items()
                      for k, v in e.items()))
    out["bf16_masters"] = (ok, sorted({str(e["master"].dtype) for e in osd["dedicated"].values()}))


def _single(rank, world, root, out):
    """N -> 1 without dmuon: plain model + functional Muon / AdamW from the full files."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from dmuon.functional import adamw as fadamw
    from dmuon.functional import muon as fmuon
    from dmuon.functional.optimizer_format import functional_states_from_full
    from models import make_batches, make_model, muon_predicate
    from stateful_harness import max_rel_err

    ckpt = torch.load(os.path.join(root, "g4.pt"), weights_only=False)
    dcp_to_torch_save(os.path.join(root, "g4_dcp"), os.path.join(root, "g4_conv.pt"))
    conv = torch.load(os.path.join(root, "g4_conv.pt"), weights_only=False)
    out["dcp_to_torch_save"] = (
        set(conv["model"]) == set(ckpt["model"])
        and all(torch.equal(conv["model"][k], ckpt["model"][k]) for k in ckpt["model"])
        and all(torch.equal(conv["optim"][s][n][k], v) for s in ("fsdp2", "dedicated")
                for n, e in ckpt["optim"][s].items() for k, v in e.items())
        and conv["optim"]["adamw_step"] == ckpt["optim"]["adamw_step"] == HALF)

    model = make_model(seed=0)
    model.load_state_dict(ckpt["model"], strict=True)  # a plain model takes the full dict
    mats = {n: p for n, p in model.named_parameters() if muon_predicate(n, p)}
    rest = {n: p for n, p in model.named_parameters() if n not in mats}
    ms, st = functional_states_from_full(ckpt["optim"])
    groups = {g["name"]: g for g in ckpt["optim"]["param_groups"]}
    mh = fmuon.MuonHParams(**{k: groups["muon"][k] for k in fmuon.MuonHParams._fields})
    ah = fadamw.AdamWHParams(lr=groups["adamw"]["lr"], betas=tuple(groups["adamw"]["betas"]),
                             eps=groups["adamw"]["eps"], weight_decay=groups["adamw"]["weight_decay"])
    for ids in make_batches(STEPS, BATCH)[HALF:]:
        model.zero_grad(set_to_none=True)
        model(ids).backward()
        with torch.no_grad():
            _, ms = fmuon.update({n: p.grad for n, p in mats.items()}, ms,
                                 {n: p.data for n, p in mats.items()}, mh, donate=True)
            _, st = fadamw.update({n: p.grad for n, p in rest.items()}, st,
                                  {n: p.data for n, p in rest.items()}, ah, donate=True)
    ref = torch.load(os.path.join(root, "g4_ref.pt"), weights_only=True)
    out["functional_resume_rel"] = max_rel_err(model.state_dict(), ref)[0]


HF_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_model(seed):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def _hf(rank, world, root, out):
    """A tiny LlamaForCausalLM saved by ``save_pretrained`` (tied lm_head dropped) loads through
    ``set_model_state_dict`` and gives the same logits; the dmuon dict loads into a plain model."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.checkpoint.state_dict_files import read_state_dict
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    st_dir, bin_dir = os.path.join(root, "hf_st"), os.path.join(root, "hf_bin")
    if rank == 0:
        plain = _hf_model(seed=0)
        plain.save_pretrained(st_dir)
        os.makedirs(bin_dir)  # the pytorch_model.bin layout of transformers 4 (5 writes safetensors)
        torch.save({k: v for k, v in plain.state_dict().items() if k != "lm_head.weight"},
                   os.path.join(bin_dir, "pytorch_model.bin"))
        with torch.no_grad():
            torch.save(plain(input_ids=ids).logits, os.path.join(root, "hf_logits.pt"))
    dist.barrier()
    ref = torch.load(os.path.join(root, "hf_logits.pt"))
    model = _hf_model(seed=1)
    plain_keys = [(k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()]
    mesh = init_device_mesh("cpu", (world,))
    dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and any(k in n for k in HF_KEYS))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name, path, kw in (("st", st_dir, {}), ("bin", bin_dir, {}), ("st_rank0", st_dir,
                                                                      {"rank0_only": True})):
        sd = read_state_dict(path) if rank == 0 or not kw else None
        out[f"hf_{name}_has_lm_head"] = sd is not None and "lm_head.weight" in sd
        res = set_model_state_dict(model, sd, **kw)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        out[f"hf_{name}"] = (torch.equal(logits, ref), float((logits - ref).abs().max()),
                             res.missing_keys)
    full = get_model_state_dict(model, cpu_offload=True)
    out["hf_keys"] = [(k, tuple(v.shape), v.dtype) for k, v in full.items()] == plain_keys
    fresh = _hf_model(seed=2)
    fresh.load_state_dict(full, strict=True)
    with torch.no_grad():
        out["hf_plain"] = torch.equal(fresh(input_ids=ids).logits, ref)


def _stage_b_extra(rank, world, root, out):
    _bad_dicts(rank, world, root, out)
    _bf16_masters(rank, world, root, out)
    _hf(rank, world, root, out)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def stage_a(root):
    return run_ranks(_stage, 4, root, saves=("g4", "hsdp"), timeout=120)


@pytest.fixture(scope="module")
def stage_b(root, stage_a):
    loads = [("g4", "g2", "full"), ("g4", "g2", "dcp"), ("hsdp", "g2", "full_rank0"),
             ("hsdp", "g2", "dcp")]
    return run_ranks(_stage, 2, root, loads=loads, saves=("g2",), extra=_stage_b_extra, timeout=120)


@pytest.fixture(scope="module")
def stage_c(root, stage_b):
    loads = [("g4", "g4", "full"), ("hsdp", "g4", "full"), ("hsdp", "g4", "dcp"),
             ("g2", "g4", "dcp"), ("hsdp", "hsdp", "dcp"), ("g4", "hsdp", "full")]
    return run_ranks(_stage, 4, root, loads=loads, timeout=120)


@pytest.fixture(scope="module")
def stage_d(root, stage_a):
    loads = [("g4", "g1", "full"), ("g4", "g1", "dcp"), ("hsdp", "g1", "dcp")]
    return run_ranks(_stage, 1, root, loads=loads, extra=_single, timeout=120)


def _results(stage, prefix=""):
    return {k: v for k, v in stage[0].items() if isinstance(v, dict) and k.startswith(prefix)}


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_same_topology_resume_is_bitwise(stage_c):
    res = _results(stage_c)
    for key in ("g4->g4:full", "hsdp->hsdp:dcp"):
        assert res[key]["bitwise"], (key, res[key])
        assert res[key]["step"] == HALF and res[key]["lrs"] == NEW_LR


@pytest.mark.slow  # the default tier's 600 s budget (issue 46's tests); the slow tier runs it
@pytest.mark.parametrize("key", ["g4->g2:full", "g4->g2:dcp", "hsdp->g2:full_rank0",
                                 "hsdp->g2:dcp"])
def test_resume_on_fewer_ranks(stage_b, key):
    r = _results(stage_b)[key]
    assert r["rel"] <= 1e-12 and r["lrs"] == NEW_LR, r


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
@pytest.mark.parametrize("key", ["hsdp->g4:full", "hsdp->g4:dcp", "g2->g4:dcp", "g4->hsdp:full"])
def test_resume_on_more_ranks_and_hsdp(stage_c, key):
    r = _results(stage_c)[key]
    assert r["rel"] <= 1e-12 and r["lrs"] == NEW_LR, r


def test_resume_in_one_process(stage_d):
    res = _results(stage_d)
    for key in ("g4->g1:full", "g4->g1:dcp", "hsdp->g1:dcp"):
        assert res[key]["rel"] <= 1e-12, (key, res[key])
    out = stage_d[0]
    assert out["dcp_to_torch_save"]
    assert out["functional_resume_rel"] <= 1e-12


def test_rank0_only_keeps_the_dict_on_rank0(stage_a):
    assert all(out["hsdp:rank0_only_empty"] for out in stage_a[1:])


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_sharded_checkpoint_never_gathers(stage_a, stage_b, stage_c):
    for stage, world in ((stage_a, 4), (stage_b, 2)):
        for topo in {k.split(":")[0] for k in stage[0] if k.endswith(":save")}:
            per_rank = [out[f"{topo}:save"] for out in stage]
            total = per_rank[0][3]
            assert sum(w for w, *_ in per_rank) == total, (topo, per_rank)  # each byte once
            for written, local, own, _ in per_rank:
                assert written <= local <= own < total, (topo, per_rank)
    for stage in (stage_b, stage_c):
        for key in {k for k in stage[0] if k.endswith(":bytes")}:
            for out in stage:
                requested, read, own, total = out[key]
                assert requested == own < total, (key, out[key])
                assert read <= 2 * own, (key, out[key])  # saved shards overlapping its own


@pytest.mark.slow  # the default tier's 600 s budget (issue 46's tests); the slow tier runs it
def test_mismatched_dicts_raise_and_name_entries(stage_b):
    for out in stage_b:
        msg = out["bad_model{}"]
        assert msg is not None and "rank(s) [1]" in msg
        for name in ("layers.0.mlp.up_proj.weight", "layers.9.extra.weight", "norm.weight",
                     "layers.1.self_attn.q_proj.weight"):
            assert name in msg, msg
        loose = out["bad_model{'strict': False}"]  # wrong shapes stay errors without strict
        assert loose is not None and "norm.weight" in loose and "extra.weight" not in loose
        assert out["partial"] == (["norm.weight"], ["unused.bias"])
        assert out["bad_optim"] is not None and "layers.1.mlp.down_proj.weight" in out["bad_optim"]


@pytest.mark.slow  # the default tier's 600 s budget (issue 46's tests); the slow tier runs it
def test_hf_save_pretrained_loads_with_identical_logits(stage_b):
    pytest.importorskip("transformers")
    for out in stage_b:
        assert not out["hf_st_has_lm_head"]  # save_pretrained dropped the tied head
        for name in ("st", "bin", "st_rank0"):
            exact, diff, missing = out[f"hf_{name}"]
            assert exact and missing == [], (name, diff, missing)
        assert out["hf_keys"] and out["hf_plain"]


@pytest.mark.slow  # the default tier's 600 s budget (issue 46's tests); the slow tier runs it
def test_wide_masters_round_trip_in_both_formats(stage_b):
    for out in stage_b:
        assert out["bf16_masters"] == ([True, True], ["torch.float32"]), out["bf16_masters"]
