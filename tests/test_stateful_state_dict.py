"""Same-topology checkpoints: model state dict round trip and exact resume through
``get_model_state_dict`` / ``set_model_state_dict`` + ``Muon.state_dict`` / ``load_state_dict``,
and through the seeds' recipe (``get_optimizer_state_dict``, rank 0 ``torch.save``, every rank
``torch.load`` + ``set_model_state_dict`` + ``set_optimizer_state_dict``)."""
from __future__ import annotations

import copy

from dist_utils import run_ranks


def _build(world, tie=False, wrap=False):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.stateful.optimizer.muon import Muon
    from models import make_model, muon_predicate

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed=3, tie=tie)
    dedicate_params(model, mesh, muon_predicate)
    if wrap:  # torch's activation-checkpoint wrapper, applied as torchtitan's parallelize does
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing)
        from models import Block
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, Muon(model, lr=0.02, ns_dtype=torch.float64, adamw_lr=2e-3)


def _train(model, opt, batches, rank, world):
    for ids in batches:
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()


def _worker(rank, world, path):
    import torch
    import torch.distributed as dist

    from dmuon.stateful.checkpoint.optimizer_state_dict import (
        get_optimizer_state_dict, set_optimizer_state_dict,
    )

    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from models import make_batches, make_model

    out = {}
    batches = make_batches(6, 4, seed=7)
    a, opt_a = _build(world)
    _train(a, opt_a, batches[:3], rank, world)
    sd = get_model_state_dict(a)
    osd = copy.deepcopy(opt_a.state_dict())
    full_osd = get_optimizer_state_dict(a, opt_a)
    if rank == 0:  # the seeds' checkpoint recipe: rank 0 saves, every rank loads
        torch.save({"model": sd, "optim": full_osd}, path)
    dist.barrier()
    out["full_osd_keys"] = sorted(full_osd)
    out["full_osd_plain"] = all(type(t) is torch.Tensor for s in full_osd["dedicated"].values()
                                for t in s.values())
    out["osd_groups"] = [(g["name"], g["lr"], len(g["params"])) for g in osd["param_groups"]]
    out["osd_keys"] = sorted({k for s in osd["state"].values() for k in s})
    _train(a, opt_a, batches[3:], rank, world)
    final_a = get_model_state_dict(a)

    b, opt_b = _build(world)
    set_model_state_dict(b, sd)
    opt_b.load_state_dict(osd)
    _train(b, opt_b, batches[3:], rank, world)
    final_b = get_model_state_dict(b)
    out["resume_exact"] = all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    out["resume_diff"] = max(float((final_a[k] - final_b[k]).abs().max()) for k in final_a)

    c, opt_c = _build(world)
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    set_model_state_dict(c, ckpt["model"])
    set_optimizer_state_dict(c, opt_c, ckpt["optim"])
    _train(c, opt_c, batches[3:], rank, world)
    final_c = get_model_state_dict(c)
    out["full_resume_exact"] = all(torch.equal(final_a[k], final_c[k]) for k in final_a)
    bad = copy.deepcopy(ckpt["optim"])
    if rank == 1:
        name = next(iter(bad["dedicated"]))
        bad["dedicated"][name]["momentum_buffer"] = torch.zeros(3)
    try:
        set_optimizer_state_dict(c, opt_c, bad)
        out["bad_osd"] = None
    except ValueError as e:
        out["bad_osd"] = str(e)

    # round trip from a single-device state dict of another init
    fresh = make_model(seed=11).state_dict()
    set_model_state_dict(b, fresh)
    back = get_model_state_dict(b, cpu_offload=True)
    out["roundtrip"] = (list(back) == list(fresh)
                        and all(torch.equal(back[k], fresh[k]) for k in fresh))

    # tied weights stay tied and appear under both names
    t, _ = _build(world, tie=True)
    tsd = get_model_state_dict(t)
    out["tied"] = (set(tsd) == set(make_model(tie=True).state_dict())
                   and torch.equal(tsd["lm_head.weight"], tsd["embed_tokens.weight"]))

    # blocks wrapped by checkpoint_wrapper after dedicate_params (its hooks rename every key)
    w, _ = _build(world, wrap=True)
    set_model_state_dict(w, fresh)
    back = get_model_state_dict(w)
    out["wrapped"] = (list(back) == list(fresh)
                      and all(torch.equal(back[k], fresh[k]) for k in fresh))
    return out


def test_state_dict_roundtrip_and_resume(tmp_path):
    for out in run_ranks(_worker, 2, str(tmp_path / "checkpoint.pt")):
        assert out["resume_exact"], out["resume_diff"]
        assert out["full_resume_exact"] and out["full_osd_plain"]
        assert {"fsdp2", "dedicated", "adamw_step"} <= set(out["full_osd_keys"])
        assert out["bad_osd"] is not None and "does not match" in out["bad_osd"]
        assert out["roundtrip"]
        assert out["tied"]
        assert out["wrapped"]  # (before: meta tensors back, and nothing of the blocks loaded)
        assert [g[0] for g in out["osd_groups"]] == ["muon", "adamw"]
        assert out["osd_groups"][0][1] == 0.02 and out["osd_groups"][1][1] == 2e-3
        assert {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"} <= set(out["osd_keys"])
