"""``dmuon.verify.verify_step`` on 2 gloo ranks (fp64): passes on correct setups (Z3, Z2)
with errors at rounding level, and fails loudly, on every rank, when the distributed step is
deliberately broken (one owner's master perturbed inside the step, one rank's AdamW shard skipped,
rank-dependent hyper-parameters)."""
from __future__ import annotations

import pytest

from dist_utils import catch, run_ranks


def _setup(rank, world, z3):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.stateful.optimizer.muon import Muon
    from models import make_model, muon_predicate

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(dtype=torch.float64)
    dedicate_params(model, mesh, muon_predicate, reshard_after_forward=z3)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=mesh, reshard_after_forward=z3)
    opt = Muon(model, lr=0.02, weight_decay=0.01, ns_dtype=torch.float64, adamw_lr=3e-3,
               adamw_weight_decay=0.02)
    return model, opt


def _backward(model, opt, ids, rank, world):
    opt.zero_grad()
    model(ids.chunk(world)[rank]).backward()


def _worker(rank, world):
    from dmuon.verify import VerificationError, verify_step
    from models import make_batches

    out = {}
    batches = make_batches(8, 4)
    for z3 in (True, False):
        model, opt = _setup(rank, world, z3)
        reps = []
        for ids in batches[:3]:
            _backward(model, opt, ids, rank, world)
            reps.append(verify_step(model, opt))
        out[f"ok_z3={z3}"] = [(r.errors, r.state_errors, r.tolerances, r.fp64_errors, r.max_error,
                               r.worst) for r in reps]
        out[f"steps_z3={z3}"] = opt.num_steps
    # closure form
    ids = batches[3]

    def closure():
        _backward(model, opt, ids, rank, world)
        return float(model(ids.chunk(world)[rank]).detach())
    rep = verify_step(model, opt, closure)
    out["closure_loss"] = rep.loss

    # break 1: rank 1 perturbs one master it owns right after its Muon update
    rt = opt.dedicated_state
    target = rt.owned_names[0] if rank == 1 else None
    orig_muon = opt._muon_step

    def broken_muon(rt_, grads, *rest):
        stepped = orig_muon(rt_, grads, *rest)
        if target is not None:
            rt_.masters[target].add_(1e-3)
        return stepped
    opt._muon_step = broken_muon
    _backward(model, opt, batches[4], rank, world)
    out["perturbed_target"] = target
    out["perturbed"] = catch(lambda: verify_step(model, opt))
    del opt._muon_step
    # the next (unbroken) step verifies again
    _backward(model, opt, batches[5], rank, world)
    out["recovered"] = verify_step(model, opt).max_error

    # break 3: a rank-dependent learning rate (detected before the step: nothing updated)
    before = opt.num_steps
    opt.param_groups[0]["lr"] = 0.02 * (1 + rank)
    _backward(model, opt, batches[7], rank, world)
    out["hparams"] = catch(lambda: verify_step(model, opt))
    out["hparams_steps"] = opt.num_steps - before
    opt.param_groups[0]["lr"] = 0.02
    out["after_hparams"] = verify_step(model, opt).max_error
    # break 2: rank 0 skips its AdamW update (its FSDP2 shards stay stale)
    if rank == 0:
        opt._adamw_update = lambda: None
    _backward(model, opt, batches[6], rank, world)
    try:
        verify_step(model, opt)
        out["adamw_skipped"] = (None, None)
    except VerificationError as e:  # also an AssertionError
        out["adamw_skipped"] = (isinstance(e, AssertionError), str(e))

    # a generous rtol turns a failure into a report (rank 0 still skips AdamW)
    _backward(model, opt, batches[0], rank, world)
    out["loose"] = verify_step(model, opt, rtol=10.0).max_error
    return out


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_verify_step_world2():
    res = run_ranks(_worker, 2, timeout=60)
    for z3 in (True, False):
        # identical reports on both ranks
        assert res[0][f"ok_z3={z3}"] == res[1][f"ok_z3={z3}"]
        assert res[0][f"steps_z3={z3}"] == 3
        for errors, state_errors, tols, fp64, mx, worst in res[0][f"ok_z3={z3}"]:
            assert mx <= 1e-10 and worst is not None
            assert any(k.endswith("proj.weight") for k in errors)       # dedicated matrices
            assert any("norm" in k for k in errors)                      # AdamW params
            assert any(k.endswith("/momentum_buffer") for k in state_errors)
            assert any(k.endswith("/exp_avg_sq") for k in state_errors)
            assert set(tols) == set(errors) | set(state_errors)
            assert all(t == 1e-10 for t in tols.values())                # fp64 defaults
            assert fp64 and all(e <= 1e-10 for e in fp64.values())
    assert res[0]["closure_loss"] is not None
    target = res[1]["perturbed_target"]
    for r in range(2):
        name, msg = res[r]["perturbed"]
        assert name == "VerificationError", msg
        assert target in msg and "owner rank 1" in msg, msg
        assert res[r]["recovered"] <= 1e-10
        is_assert, msg = res[r]["adamw_skipped"]
        assert is_assert is True and "FSDP2/AdamW" in msg, msg
        name, msg = res[r]["hparams"]
        assert name == "VerificationError" and "hyper-parameters differ" in msg, msg
        assert res[r]["hparams_steps"] == 0
        assert res[r]["after_hparams"] <= 1e-10
        assert 1e-6 < res[r]["loose"] <= 10.0
    assert res[0]["perturbed"] == res[1]["perturbed"]
    assert res[0]["adamw_skipped"] == res[1]["adamw_skipped"]
