"""Workers for tests/test_variants_distributed.py: ``dmuon.Muon(..., transform=variant)`` on gloo
ranks (FSDP2 1-D, HSDP 2x2, TP dp2 x tp2, DDP) against one process running the same chain on the
full matrices (``transforms.update_params``) and ``torch.optim.AdamW`` for the rest, fp64."""
from __future__ import annotations

from typing import Any

import torch

from models import make_batches, make_model, muon_predicate
from stateful_harness import HP, max_rel_err

BATCH = 4


def hparams(kind: str):
    from dmuon.functional import muon as fmuon
    wd = 0.0 if "hyperball" in kind else HP["weight_decay"]
    return fmuon.MuonHParams(lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                             weight_decay=wd, ns_steps=HP["ns_steps"], ns_dtype=torch.float64)


def variant(kind: str):
    """The ``transform=`` of ``kind``: a built-in variant, or a chain of tests/optax_stages.py
    (a function ``hparams -> Transform`` with stages written in the optax form only)."""
    from optax_stages import CHAINS

    from dmuon.functional import variants
    return CHAINS[kind] if kind in CHAINS else getattr(variants, kind)()


def reference(kind: str, steps: int, momentum_dtype: Any = None) -> dict[str, Any]:
    """One process, full batch: the chain on the matrices (a chain of tests/optax_stages.py in
    the optax form, ``chain.update`` + ``apply_updates``, as a research loop runs it), torch AdamW
    on the rest; ``momentum_dtype``: the momentum stage's buffers rounded to it after each update
    (:func:`~dmuon.functional.state_dtype.round_trip`), as ``dmuon.Muon(momentum_dtype=...)``
    stores them."""
    from optax_stages import CHAINS

    from dmuon.functional import transforms as T
    from dmuon.functional.state_dtype import round_trip
    from dmuon.functional.tree import get_path
    from dmuon.functional.state_fields import state_fields
    model = make_model()
    mats = {n: p for n, p in model.named_parameters() if muon_predicate(n, p)}
    rest = [p for n, p in model.named_parameters() if n not in mats]
    adam = torch.optim.AdamW(rest, lr=HP["adamw_lr"], betas=HP["adamw_betas"], eps=HP["adamw_eps"],
                             weight_decay=HP["adamw_weight_decay"], foreach=False)
    chain = variant(kind)(hparams(kind))
    state = chain.init({n: p.detach() for n, p in mats.items()})
    for ids in make_batches(steps, BATCH):
        model.zero_grad(set_to_none=True)
        model(ids).backward()
        with torch.no_grad():
            if kind in CHAINS:
                updates, state = chain.update({n: p.grad for n, p in mats.items()}, state,
                                              {n: p.data for n, p in mats.items()})
                for n, p in mats.items():
                    p.data.copy_(T.apply_updates({n: p.data}, {n: updates[n]})[n])
            else:
                _, state = T.update_params(chain, {n: p.grad for n, p in mats.items()}, state,
                                           {n: p.data for n, p in mats.items()}, donate=True)
            if momentum_dtype is not None:  # stored rounded, as dmuon stores it
                f = next(f for f in state_fields(state) if f.key == "momentum_buffer")
                for b in get_path(state, f.path).values():
                    b.copy_(round_trip(b, momentum_dtype))
        adam.step()
    return {"sd": {k: v.detach().clone() for k, v in model.state_dict().items()}, "state": state}


def build(kind: str, mode: str, world: int, seed: int = 0, **muon_kw: Any):
    """``(model, optimizer, data-parallel index, data-parallel size)``; ``muon_kw``: more (or
    other) ``dmuon.Muon`` options (``momentum_dtype``, ``offload_state``, ``transform``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = make_model(seed=seed)
    hp = hparams(kind)
    kw = dict(lr=hp.lr, momentum=hp.momentum, nesterov=hp.nesterov, weight_decay=hp.weight_decay,
              ns_steps=hp.ns_steps, ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"],
              adamw_betas=HP["adamw_betas"], adamw_eps=HP["adamw_eps"],
              adamw_weight_decay=HP["adamw_weight_decay"], transform=variant(kind))
    kw.update(muon_kw)
    rank = torch.distributed.get_rank()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, muon_predicate, data_parallel="ddp")
        model = DDP(model)
        return model, dmuon.Muon(model, **kw), rank, world
    if mode == "tp":
        from test_tensor_parallel import apply_tp
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
        apply_tp(model, mesh["tp"])
        dmuon.dedicate_params(model, dp, muon_predicate)
        for layer in model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
        return model, dmuon.Muon(model, **kw), dp.get_local_rank(), dp.size()
    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(model, mesh["shard"], muon_predicate,
                              replicate_mesh=mesh["replicate"])
    else:
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, muon_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, **kw), rank, world


def train(model, opt, batches, dp_index: int, dp_size: int) -> None:
    for ids in batches:
        opt.zero_grad()
        model(ids.chunk(dp_size)[dp_index]).backward()
        opt.step()


def run_variant(rank: int, world: int, kind: str, mode: str, steps: int,
                checkpoint: bool = False, keep_model: bool = False,
                **muon_kw: Any) -> dict[str, Any]:
    """Train ``steps`` steps; return the full model state dict and the variant's full state
    (``dmuon.get_optimizer_state_dict``); ``checkpoint``: also round-trip the state through
    ``Muon.state_dict()`` / ``load_state_dict`` and the full format into fresh optimizers
    (other initial weights) and train 2 more steps on each. ``muon_kw``: more ``dmuon.Muon``
    options (``momentum_dtype``, ``offload_state``)."""
    import dmuon

    model, opt, i, n = build(kind, mode, world, **muon_kw)
    batches = make_batches(steps + 2, BATCH)
    train(model, opt, batches[:steps], i, n)
    out: dict[str, Any] = {"sd": dmuon.get_model_state_dict(model, cpu_offload=True)}
    full = dmuon.get_optimizer_state_dict(model, opt, cpu_offload=True)
    out["opt"] = {"dedicated": full["dedicated"], "scalars": full.get("variant_scalars")}
    if checkpoint:
        msd = dmuon.get_model_state_dict(model)
        import copy
        # torch's protocol (not with TP yet): a copy, as it holds AdamW's live moments
        torch_sd = copy.deepcopy(opt.state_dict()) if mode != "tp" else None
        train(model, opt, batches[steps:], i, n)
        out["after"] = dmuon.get_model_state_dict(model, cpu_offload=True)
        m2, o2, _, _ = build(kind, mode, world, seed=5, **muon_kw)  # other weights: all comes from the dicts
        for how in ("torch", "full") if torch_sd is not None else ("full",):
            dmuon.set_model_state_dict(m2, msd)
            if how == "torch":
                o2.load_state_dict(torch_sd)
            else:
                dmuon.set_optimizer_state_dict(m2, o2, full)
            train(m2, o2, batches[steps:], i, n)
            out[f"resumed_{how}"] = dmuon.get_model_state_dict(m2, cpu_offload=True)
    torch.distributed.barrier()
    if keep_model:
        out["model"] = model
        out["routing"] = opt.routing_table()
    return out


def check(results: list, kind: str, steps: int, tol: float = 1e-10,
          momentum_dtype: Any = None) -> None:
    ref = reference(kind, steps, momentum_dtype)
    for r, out in enumerate(results):
        err, where = max_rel_err(out["sd"], ref["sd"])
        assert err <= tol, (kind, r, err, where)
    # the variant's per-param state, gathered by name: the reference's
    from dmuon.functional.tree import get_path
    from dmuon.functional.state_fields import state_fields
    fields = state_fields(ref["state"])
    ded = results[0]["opt"]["dedicated"]
    for f in fields:
        for name, t in get_path(ref["state"], f.path).items():
            got = ded[name][f.key].to(t.dtype)
            err = float((got - t).abs().max() / t.abs().max().clamp_min(1e-30))
            assert err <= tol, (kind, f.key, name, err)
    assert results[0]["opt"]["scalars"] is not None


def two_rank_suite(rank: int, world: int) -> dict[str, Any]:
    """The default tier's one spawn: every variant on FSDP2 (NorMuon also through both state
    dicts); a fixed Transform under a scheduler."""
    import dmuon
    from dist_utils import catch
    from dmuon.functional import variants

    out: dict[str, Any] = {}
    for kind in ("normuon", "muon_hyperball", "normuon_hyperball"):
        out[kind] = run_variant(rank, world, kind, "fsdp", 3, checkpoint=kind == "normuon",
                                keep_model=True)
        out["model"] = out[kind].pop("model")
    # a fixed Transform: its own hyper-parameters; a scheduler changing param_groups raises
    model = out.pop("model")
    opt = dmuon.Muon(model, HP["lr"], ns_dtype=torch.float64,
                     transform=variants.normuon()(hparams("normuon")))
    opt.zero_grad()  # the last optimizer's gradients (torch would add this backward to them)
    model(make_batches(1, BATCH)[0].chunk(world)[rank]).backward()
    opt.param_groups[0]["lr"] *= 0.5
    out["fixed_changed"] = catch(opt.step)
    torch.distributed.barrier()
    return out


def muon_chain_bitwise(rank: int, world: int) -> bool:
    """``transform=variants.muon()`` (the chain path) == no transform (Muon's fused path)."""
    import dmuon
    from dmuon.functional import variants

    sds = []
    for transform in (None, variants.muon()):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        model = make_model()
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, muon_predicate)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = dmuon.Muon(model, HP["lr"], weight_decay=0.1, ns_dtype=torch.float64,
                         transform=transform)
        train(model, opt, make_batches(3, BATCH), rank, world)
        sds.append(dmuon.get_model_state_dict(model, cpu_offload=True))
    return all(torch.equal(sds[0][k], sds[1][k]) for k in sds[0])


def save_full(rank: int, world: int, kind: str, path: str, steps: int) -> None:
    """Train ``steps`` steps on FSDP2 and save dmuon's full model and optimizer state (rank 0)."""
    import dmuon
    model, opt, i, n = build(kind, "fsdp", world)
    train(model, opt, make_batches(steps, BATCH), i, n)
    msd = dmuon.get_model_state_dict(model, cpu_offload=True)
    osd = dmuon.get_optimizer_state_dict(model, opt, cpu_offload=True)
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, path)
    torch.distributed.barrier()


def resume_full(rank: int, world: int, kind: str, mode: str, path: str, done: int,
                more: int) -> dict:
    """Load :func:`save_full`'s file at another topology and train ``more`` steps."""
    import dmuon
    model, opt, i, n = build(kind, mode, world, seed=5)
    ck = torch.load(path, weights_only=True)
    dmuon.set_model_state_dict(model, ck["model"])
    dmuon.set_optimizer_state_dict(model, opt, ck["optim"])
    train(model, opt, make_batches(done + more, BATCH)[done:], i, n)
    out = dmuon.get_model_state_dict(model, cpu_offload=True)
    torch.distributed.barrier()
    return out
