"""Torch's own tools on a dmuon model, step discipline and bounded timeouts: right, or a clear error
on every rank.

Before (measured on the earlier code): ``torch.nn.utils.clip_grad_norm_(model.parameters())``
returned a smaller norm and left the matrices unclipped; ``torch.optim.AdamW(model.parameters())``
never updated them; ``parameters_to_vector`` left them out; ``model.zero_grad()`` between a backward
and the step kept dmuon's gradient; a second ``step()`` without a backward re-applied AdamW on a 1-D
mesh (on HSDP it raised another error); an extra ``step()`` on one rank updated its shards twice
(with ``check_finite`` on it surfaced only at the default group's timeout); ``check_finite`` named
the rank holding the reduced gradient, not the one whose backward produced the NaN; and
``dedicate_params`` called twice on one rank only aborted the process (gloo, SIGABRT).
"""
from __future__ import annotations

import pytest
import torch
from dist_utils import catch, run_ranks
from models import make_batches, make_model
from stateful_harness import build_dmuon, max_rel_err, reference_train

TOL = 1e-10
STEPS, BATCH = 4, 4


def _fresh(rank, world, cfg=None):
    model = make_model()
    return build_dmuon(rank, world, model, model.layers, cfg or {})


def _grads_snapshot(model):
    from dmuon.stateful.runtime.state import local_tensor
    return {n: local_tensor(p.grad).clone() for n, p in model.named_parameters()
            if p.grad is not None and p.grad.numel() > 0}


def _foreign_tools(rank, world):
    """Each foreign tool raises, naming the dmuon call, and changes nothing."""
    import dmuon
    from dmuon.stateful.runtime.state import get_state

    out = {}
    model, opt = _fresh(rank, world)
    ids = make_batches(1, BATCH)[0].chunk(world)[rank]
    model(ids).backward()
    before = _grads_snapshot(model)
    reduced_before = {n: g.clone() for n, g in get_state(model).reduced_grads().items()
                      if g is not None}
    params_before = {n: t.clone() for n, t in dmuon.get_model_state_dict(model).items()}
    # these compute before they write: nothing changes
    out["clip_norm"] = catch(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
    adam = torch.optim.AdamW(model.parameters(), lr=1.0)
    out["adamw"] = catch(adam.step)
    out["to_vector"] = catch(lambda: torch.nn.utils.parameters_to_vector(model.parameters()))
    out["same_device"] = catch(lambda: model.to("cpu"))  # a no-op move is fine
    out["cast"] = catch(lambda: model.to(torch.float32))  # a real cast after dedicate_params is not
    after = _grads_snapshot(model)
    out["grads_unchanged"] = set(before) == set(after) and all(
        torch.equal(before[n], after[n]) for n in before)
    red = get_state(model).reduced_grads()
    out["reduced_unchanged"] = all(torch.equal(reduced_before[n], red[n]) for n in reduced_before)
    params_after = dmuon.get_model_state_dict(model)
    out["params_unchanged"] = all(torch.equal(params_before[k], params_after[k])
                                  for k in params_before)
    out["step_after"] = catch(opt.step)  # dmuon's own step still works
    # these go param by param: torch may have changed FSDP2 params before the first dedicated one
    # (the error says so); they raise all the same
    opt.zero_grad()
    model(ids).backward()
    out["clip_value"] = catch(lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3))
    out["sgd"] = catch(torch.optim.SGD(model.parameters(), lr=1.0).step)
    # .data idioms (issue 46): they read a dedicated param's or marker's local tensor, the empty
    # placeholder (a scaled gradient stayed unscaled, a norm read 0): each raises, naming the param
    def scale():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.data.mul_(0.5)
    out["grad_data_scale"] = catch(scale)
    out["data_clamp"] = catch(lambda: [p.data.clamp_(-0.1, 0.1) for p in model.parameters()])
    out["data_norm"] = catch(lambda: [float(p.data.norm()) for p in model.parameters()])
    # dedicate_params twice on one rank only: raises there before any collective (no abort)
    if rank == 1:
        out["twice"] = catch(lambda: dmuon.dedicate_params(model, None, lambda n, p: True))
    return out


def _train(rank, world, cfg):
    """Train ``STEPS`` steps; ``cfg``: ``zero`` (a throwaway backward on another batch, then
    ``model.zero_grad(set_to_none=...)``, before each real one), ``clip_value``, ``extra_step``
    (rank 1 calls step() once more after each step: it must raise there and change nothing)."""
    import dmuon

    model, opt = _fresh(rank, world, cfg)
    errors = []
    for step, ids in enumerate(make_batches(STEPS, BATCH)):
        opt.zero_grad()
        if "zero" in cfg:
            other = make_batches(1, BATCH, seed=50 + step)[0]
            model(other.chunk(world)[rank]).backward()
            model.zero_grad(set_to_none=cfg["zero"])
        model(ids.chunk(world)[rank]).backward()
        if cfg.get("clip_value"):
            dmuon.clip_grad_value_(model, cfg["clip_value"])
        opt.step()
        if cfg.get("extra_step") and rank == 1:
            errors.append(catch(opt.step))
    return {"sd": dmuon.get_model_state_dict(model, cpu_offload=True), "errors": errors,
            "steps": opt.num_steps}


def _double_step(rank, world, cfg):
    model, opt = _fresh(rank, world, cfg)
    ids = make_batches(1, BATCH)[0].chunk(world)[rank]
    model(ids).backward()
    opt.step()
    import dmuon
    before = dmuon.get_model_state_dict(model)
    err = catch(opt.step)
    after = dmuon.get_model_state_dict(model)
    return {"err": err, "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "steps": opt.num_steps}


def _nan_on_rank1(rank, world):
    """A NaN in rank 1's local gradient of one matrix: both ranks raise, naming rank 1."""
    model, opt = _fresh(rank, world)
    w = model.layers[0].mlp.down_proj.weight
    if rank == 1:
        w.register_hook(lambda g: g * float("nan"))
    model(make_batches(1, BATCH)[0].chunk(world)[rank]).backward()
    return catch(opt.step)


SKIP_AT = 2  # the step whose gradients overflow on rank 1


def _flat_state(sd, prefix=""):
    """``{dotted key: tensor or number}`` of a (nested) state dict, each copied."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat_state(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + str(k)] = v.detach().clone()
        elif isinstance(v, (int, float)):
            out[prefix + str(k)] = v
    return out


def _same(a, b):
    return set(a) == set(b) and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _skip_overflow_step(rank, world):
    """Peer class (DeepSpeed #8435): an fp16-style overflow -- rank 1's loss scaled to inf on step
    ``SKIP_AT`` -- is skipped the documented way (``check_finite`` raises FloatingPointError on
    every rank before anything changes; the loop zeroes the gradients and goes on). The skipped
    step must move nothing: params, momentum, AdamW moments, step counters."""
    import dmuon

    model, opt = _fresh(rank, world)
    out = {"skipped": []}
    for step, ids in enumerate(make_batches(STEPS, BATCH)):
        opt.zero_grad()
        loss = model(ids.chunk(world)[rank])
        if step == SKIP_AT and rank == 1:
            loss = loss * float("inf")  # the overflow of an fp16 loss scale
        loss.backward()
        if step == SKIP_AT:
            before = (_flat_state(dmuon.get_model_state_dict(model)),
                      _flat_state(dmuon.get_optimizer_state_dict(model, opt)), opt.num_steps)
        try:
            opt.step()
        except FloatingPointError as e:
            out["skipped"].append((step, str(e)))
            opt.zero_grad()
        if step == SKIP_AT:
            after = (_flat_state(dmuon.get_model_state_dict(model)),
                     _flat_state(dmuon.get_optimizer_state_dict(model, opt)), opt.num_steps)
            out["params_unchanged"] = _same(before[0], after[0])
            out["optim_unchanged"] = _same(before[1], after[1])
            out["optim_keys"] = sorted(before[1])
            out["steps_unchanged"] = before[2] == after[2]
    out["sd"] = dmuon.get_model_state_dict(model, cpu_offload=True)
    out["steps"] = opt.num_steps
    return out


CFGS = [dict(id="zero_none", zero=True), dict(id="zero_false", zero=False),
        dict(id="clip_value", clip_value=2e-3), dict(id="extra_step", extra_step=True)]


def _worker2(rank, world):
    torch.set_num_threads(1)
    out = {"foreign": _foreign_tools(rank, world), "nan": _nan_on_rank1(rank, world),
           "double": _double_step(rank, world, {}), "skip": _skip_overflow_step(rank, world)}
    out.update({c["id"]: _train(rank, world, c) for c in CFGS})
    return out


def _worker4(rank, world):
    torch.set_num_threads(1)
    return {"double_hsdp": _double_step(rank, world, {"hsdp": True})}


@pytest.fixture(scope="module")
def res2():
    return run_ranks(_worker2, 2, timeout=120)


def test_foreign_tools_raise_naming_the_dmuon_call(res2):
    for rank, r in enumerate(res2):
        f = r["foreign"]
        for key, needle in (("clip_norm", "dmuon.clip_grad_norm_"),
                            ("clip_value", "dmuon.clip_grad_value_"), ("adamw", "dmuon.Muon"),
                            ("sgd", "dmuon.Muon"), ("to_vector", "dmuon.get_model_state_dict"),
                            ("cast", "before dmuon.dedicate_params")):
            kind, msg = f[key]
            assert kind == "DedicatedParamError", (rank, key, kind, msg)
            assert needle in msg and "proj" in msg, (rank, key, msg)
        assert f["same_device"] == (None, None)
        assert f["grads_unchanged"] and f["reduced_unchanged"] and f["params_unchanged"]
        assert f["step_after"] == (None, None)
    kind, msg = res2[1]["foreign"]["twice"]
    assert kind == "RuntimeError" and "already called" in msg


def test_data_idioms_raise_naming_the_param(res2):
    """``p.grad.data.mul_(0.5)`` over ``model.parameters()`` (gradient scaling), ``p.data.clamp_``
    (weight clipping) and ``p.data.norm()``: before, the first two changed nothing on the dedicated
    matrices and the norm read 0. Now each raises, naming the param, ``.data`` and what to use."""
    for rank, r in enumerate(res2):
        f = r["foreign"]
        for key in ("grad_data_scale", "data_clamp", "data_norm"):
            kind, msg = f[key]
            assert kind == "DedicatedParamError", (rank, key, kind, msg)
            assert "'.data'" in msg and "proj" in msg, (rank, key, msg)


@pytest.mark.parametrize("cid", ["zero_none", "zero_false", "clip_value", "extra_step"])
def test_zero_grad_clip_value_and_extra_step_equal_the_reference(res2, cid):
    cfg = next(c for c in CFGS if c["id"] == cid)
    ref = reference_train(make_model(), make_batches(STEPS, BATCH),
                          {"clip_value": cfg.get("clip_value")})["sd"]
    for rank, r in enumerate(res2):
        err, where = max_rel_err(r[cid]["sd"], ref)
        assert err <= TOL, f"{cid} rank {rank}: rel err {err:.3g} at {where}"
        assert r[cid]["steps"] == STEPS
    if cid == "extra_step":
        assert len(res2[1][cid]["errors"]) == STEPS
        for kind, msg in res2[1][cid]["errors"]:
            assert kind == "RuntimeError" and "no backward pass reached" in msg, msg


def test_a_step_skipped_for_overflow_moves_nothing_and_the_run_equals_one_without_it(res2):
    """DeepSpeed #8435's class: momentum moved on a step skipped for non-finite fp16 gradients."""
    batches = make_batches(STEPS, BATCH)
    ref = reference_train(make_model(), batches[:SKIP_AT] + batches[SKIP_AT + 1:], {})["sd"]
    for rank, r in enumerate(res2):
        sk = r["skip"]
        assert [s for s, _ in sk["skipped"]] == [SKIP_AT], (rank, sk["skipped"])
        assert "ranks [1]" in sk["skipped"][0][1], sk["skipped"][0][1]
        assert sk["params_unchanged"] and sk["steps_unchanged"], rank
        assert sk["optim_unchanged"], rank
        keys = " ".join(sk["optim_keys"])  # the snapshot covered the state that must not move
        assert "momentum_buffer" in keys and "exp_avg" in keys and "exp_avg_sq" in keys, keys
        assert "step" in keys, keys
        assert sk["steps"] == STEPS - 1
        err, where = max_rel_err(sk["sd"], ref)
        assert err <= TOL, f"rank {rank}: rel err {err:.3g} at {where} vs a run without step 2"


def test_nan_names_the_rank_that_computed_it(res2):
    for r in res2:
        kind, msg = r["nan"]
        assert kind == "FloatingPointError", msg
        assert "computed by the backward of ranks [1]" in msg, msg


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_step_twice_raises_the_same_error_on_1d_and_hsdp(res2):
    res4 = run_ranks(_worker4, 4, timeout=120)
    msgs = set()
    for r in [x["double"] for x in res2] + [x["double_hsdp"] for x in res4]:
        kind, msg = r["err"]
        assert kind == "RuntimeError" and "no backward pass reached" in msg, msg
        assert r["unchanged"] and r["steps"] == 1
        msgs.add(msg)
    assert len(msgs) == 1


def _hung_rank(rank, world, hsdp, sleep_s):
    """The last rank sleeps before its forward (hung, not dead); the others must raise within
    dmuon's bound (5 s), on every collective they can be waiting in."""
    import datetime
    import logging
    import time

    import dmuon
    log = []
    handler = logging.Handler()
    handler.emit = lambda rec: log.append(rec.getMessage())
    logging.getLogger("dmuon.stateful.setup.dedicate").addHandler(handler)
    model = make_model()
    model, opt = build_dmuon(rank, world, model, model.layers, {"hsdp": hsdp},
                             timeout=datetime.timedelta(seconds=5))
    ids = make_batches(1, BATCH)[0].chunk(world)[rank]
    model(ids).backward()
    opt.step()
    if rank == world - 1:
        time.sleep(sleep_s)
    t0 = time.monotonic()
    err = catch(lambda: (model(ids).backward(), opt.step()))
    return {"err": err, "seconds": time.monotonic() - t0, "log": log,
            "hung": rank == world - 1, "dmuon": dmuon.__name__}


@pytest.mark.slow
def test_hung_rank_hsdp_raises_within_the_bound():
    """HSDP: FSDP2 runs on init_device_mesh's sub-groups (torch's 30-minute default); dmuon lowers
    them to its own bound, so survivors raise within it (before: they hung > 60 s)."""
    res = run_ranks(_hung_rank, 4, True, 25.0, timeout=90)
    for r in res:
        if r["hung"]:
            continue
        kind, msg = r["err"]
        assert kind is not None, r
        assert r["seconds"] < 15.0, (r["seconds"], msg)


@pytest.mark.slow
def test_hung_rank_1d_warns_about_the_default_group():
    """1-D: FSDP2 runs on the default group, which is the user's (60 s here): dedicate_params
    warns with the fix; survivors raise within the default group's bound."""
    res = run_ranks(_hung_rank, 2, False, 10.0, timeout=90)
    survivor = res[0]
    assert any("default process group" in m and "init_process_group" in m
               for m in survivor["log"]), survivor["log"]
    assert survivor["err"][0] is None or survivor["seconds"] < 70.0
