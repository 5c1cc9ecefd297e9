"""FSDP2's ``set_gradient_divide_factor`` (torchtitan 0.3.0 sets it to 1.0 on every FSDP module
and divides the loss by the global token count itself): dmuon's dedicated gradients must follow
the same factor as FSDP2's, or the two halves of the model get gradients of different scales and
``clip_grad_norm_`` (torchtitan clips by default) clips by a wrong norm, silently.

2 gloo ranks, factor 1.0 (gradients summed over the ranks), each rank's loss the mean over its half
batch: equal to single-device training on ``2 x`` the full-batch mean loss, with clipping active.
"""
from __future__ import annotations

import torch

from dist_utils import run_ranks
from models import make_batches, make_model, muon_predicate
from stateful_harness import HP, max_rel_err, reference_train

STEPS, CLIP = 3, 0.05


def _train(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import dmuon
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    dmuon.dedicate_params(model, mesh, muon_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    opt = dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                     weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                     ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"], adamw_betas=HP["adamw_betas"],
                     adamw_eps=HP["adamw_eps"], adamw_weight_decay=HP["adamw_weight_decay"])
    norms = []
    for ids in make_batches(STEPS, 4):
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        norms.append(float(dmuon.clip_grad_norm_(model, CLIP)))
        opt.step()
    return {"sd": dmuon.get_model_state_dict(model, cpu_offload=True), "norms": norms}


def test_gradient_divide_factor_is_followed():
    ref = reference_train(make_model(), make_batches(STEPS, 4), {"clip": CLIP},
                          loss_of=lambda out: 2 * out)
    for out in run_ranks(_train, 2, timeout=120):
        assert max(abs(a - b) / b for a, b in zip(out["norms"], ref["norms"])) < 1e-10, \
            (out["norms"], ref["norms"])
        err, where = max_rel_err(out["sd"], ref["sd"])
        assert err <= 1e-10, (err, where)
