"""Users' paths, seventh round (2 gloo ranks, fp64, 3 steps, one spawn): each equal to the same
loop on one process with ``RefMuon`` to <= 1e-10, or a clear error on every rank, nothing changed.

Paths (two reviews of session 17: the optimizer's lifecycle, torch's own tools):

* ``dmuon.Muon(model)`` built after a forward (a ``torch.no_grad()`` "loss at init"), Z3 and Z2,
  and rebuilt mid-training after an evaluation forward. Before (measured): FSDP2 leaves the
  unsharded params in ``model.parameters()`` after a forward (the root's, and in Z2 every
  block's); the AdamW group took those, and the real shards never trained (1.19e-2 after 4
  steps; the same with plain FSDP2 + ``torch.optim.AdamW``). Now the constructor reshards them
  first (as ``step()`` already did before writing shards): exact.
* ``dmuon.Muon`` built before ``fully_shard(model)`` (or before any ``fully_shard``), or after a
  module was replaced (``model.lm_head = nn.Linear(...)`` after ``fully_shard``). Before: the
  AdamW group held params no FSDP2 group manages; they never trained (9.1e-3) or trained on
  each rank's own gradient (the ranks diverged, 0.0197 / 0.0199). Now the constructor raises on
  every rank, naming the params (a data-parallel world > 1); at world 1 (nothing to average) a
  later ``fully_shard`` raises at the first step.
* ``optimizer.state`` written as torch allows (``state.clear()``, a new ``defaultdict``,
  ``del state[p]``, ``state[p]["exp_avg"] = t``, ``state[p]["step"].zero_()``). Before: each was
  silently ignored (the views are rebuilt from dmuon's states; 1.5e-3 to 2.0e-2 from torch's
  result). Now each raises (the in-place write to a copy at the next ``step()``, on every rank,
  the batch dropped); writing back the same values (a device-move helper) and reading under
  ``inference_mode`` pass (a third review of the fix found both refused).
* The optimizer's state-dict hooks (``register_state_dict_pre_hook`` / ``_post_hook``,
  ``register_load_state_dict_pre_hook`` / ``_post_hook``). Before: registered, never run. Now
  run as torch runs them.
* Refusals that now name the fix: a submodule's ``state_dict()`` (torch detaches each param; the
  message named only ``detach``), and a dedicated matrix written under ``no_grad`` (it named how
  to read weights, not how to write them), ``dedicate_params`` again after ``dmuon.release``
  (it said "already called").
* ``param_groups`` keys nothing reads: ``amsgrad`` / ``maximize`` set on the AdamW group,
  ``momentum_dtype`` / ``offload_state`` / ``adamw_state_dtype`` changed. Before: silently
  ignored. Now ``step()`` raises on every rank, the batch dropped.
"""
from __future__ import annotations

import collections
import datetime

import pytest
import torch
import torch.nn as nn
from dist_utils import catch, run_each, run_ranks
from models import make_batches, make_model
from stateful_harness import HP, build_dmuon
from user_paths_harness import TOL, RefMuon, max_abs_diff

STEPS, BATCH, WORLD = 3, 4, 2
OPTS = dict(lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
            weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"], ns_dtype=torch.float64,
            adamw_lr=HP["adamw_lr"], adamw_betas=HP["adamw_betas"], adamw_eps=HP["adamw_eps"],
            adamw_weight_decay=HP["adamw_weight_decay"])


def _ranks(env):
    return [env["rank"]] if env["dist"] else range(WORLD)


def _train(model, opt, ids, env):
    opt.zero_grad()
    for r in _ranks(env):
        (model(ids.chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)).backward()
    opt.step()


def _full_sd(model, env):
    import dmuon
    sd = dmuon.get_model_state_dict(model) if env["dist"] else model.state_dict()
    return {k: v.detach().clone() for k, v in sd.items()}


def _setup(env, z3=True, order="documented"):
    """The model and a builder of the optimizer: dmuon's documented order (``dedicate_params``,
    ``fully_shard`` of the blocks then the model) or, for ``order``, ``dmuon.Muon`` built
    earlier ("before_root", "before_any"); ``RefMuon`` in one process."""
    model = make_model()
    if not env["dist"]:
        return model, None, lambda: RefMuon(model)
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (env["world"],))
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and "embed" not in n
                          and "lm_head" not in n, reshard_after_forward=z3,
                          options=dmuon.DedicateOptions(timeout=datetime.timedelta(seconds=10)))
    early = {}
    make = lambda: dmuon.Muon(model, **OPTS)  # noqa: E731
    if order == "before_any":
        early["opt"] = catch(make)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=z3)
    if order == "before_root":
        early["opt"] = catch(make)
    fully_shard(model, mesh=mesh)
    return model, early, make


# ------------------------------------------------------------- built after a forward
def _after_eval(z3):
    def path(env):
        model, _, make = _setup(env, z3)
        b = make_batches(STEPS, BATCH)
        with torch.no_grad():
            model(b[0])  # "the loss at init"
        opt = make()
        for ids in b:
            _train(model, opt, ids, env)
        live = {id(p) for p in model.parameters()}
        return {"sd": _full_sd(model, env),
                "stale": sum(id(p) not in live for g in opt.param_groups for p in g["params"])}
    return path


def _rebuilt_after_eval(env):
    model, _, make = _setup(env)
    b = make_batches(4, BATCH)
    opt = make()
    for i, ids in enumerate(b):
        if i == 2:
            with torch.no_grad():
                model(b[0])
            opt = make()
        _train(model, opt, ids, env)
    return {"sd": _full_sd(model, env), "stale": 0}


# ------------------------------------------------------------- params no FSDP2 group manages
def _built_early(order):
    def path(env):
        model, early, make = _setup(env, order=order)
        return {"early": early["opt"]}
    return path


def _head_swapped(env):
    model, _, make = _setup(env)
    torch.manual_seed(11)
    model.lm_head = nn.Linear(16, 32, bias=False).double()
    return {"early": catch(make)}


# ------------------------------------------------------------- optimizer.state writes
def _state_writes(env):
    model, _, make = _setup(env)
    b = make_batches(2, BATCH)
    opt = make()
    _train(model, opt, b[0], env)
    p_adamw = opt.param_groups[1]["params"][0]
    out = {
        "clear": catch(lambda: opt.state.clear()),
        "assign": catch(lambda: setattr(opt, "state", collections.defaultdict(dict))),
        "del": catch(lambda: opt.state.__delitem__(p_adamw)),
        "set_field": catch(lambda: opt.state[p_adamw].__setitem__(
            "exp_avg", torch.zeros_like(opt.state[p_adamw]["exp_avg"]))),
        "pop": catch(lambda: opt.state[p_adamw].pop("exp_avg")),
    }
    with torch.inference_mode():  # a read there (Lightning's validation callbacks)
        out["inference_read"] = catch(lambda: len(opt.state))
    for p, v in list(opt.state.items()):  # "move optimizer state to the device": same values
        opt.state[p] = {k: t.clone() if k == "step" else t for k, t in v.items()}
        v["step"] = v["step"].clone()
    before = _full_sd(model, env)
    opt.state[p_adamw]["step"].zero_()  # a copy: the next step() refuses it
    opt.zero_grad()
    for r in _ranks(env):
        (model(b[1].chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)).backward()
    out["step_zero"] = catch(opt.step)
    out["unchanged"] = max_abs_diff(_full_sd(model, env), before)
    out["grads_dropped"] = all(p.grad is None for g in opt.param_groups for p in g["params"])
    _train(model, opt, b[1], env)  # the write was dropped: the next batch steps
    out["then_steps"] = max_abs_diff(_full_sd(model, env), before) > 0
    if env["rank"] == 0:  # on one rank only: the other ranks' error names it too
        opt.state[p_adamw]["step"].zero_()
    opt.zero_grad()
    model(b[1].chunk(WORLD)[env["rank"]]).backward()
    out["one_rank"] = catch(opt.step)
    return out


# ------------------------------------------------------------- state-dict hooks
def _sd_hooks(env):
    model, _, make = _setup(env)
    opt = make()
    _train(model, opt, make_batches(1, BATCH)[0], env)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))

    def post(o, sd):
        calls.append("post")
        sd["extra"] = 7
    opt.register_state_dict_post_hook(post)

    def load_pre(o, sd):
        calls.append("load_pre")
        sd = dict(sd)
        sd["param_groups"] = [dict(g) for g in sd["param_groups"]]
        sd["param_groups"][0]["lr"] = 0.123
        return sd
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    sd = opt.state_dict()
    extra = sd.pop("extra", None)
    opt.load_state_dict(sd)
    return {"calls": calls, "extra": extra, "lr": opt.param_groups[0]["lr"]}


# ------------------------------------------------------------- keys nothing reads
def _unread_keys(env):
    out = {}
    for key, gi, value in (("amsgrad", 1, True), ("maximize", 1, True), ("maximize", 0, True),
                           ("momentum_dtype", 0, "torch.bfloat16"), ("offload_state", 0, True),
                           ("adamw_state_dtype", 1, "torch.bfloat16")):
        model, _, make = _setup(env)
        b = make_batches(2, BATCH)
        opt = make()
        _train(model, opt, b[0], env)
        before = _full_sd(model, env)
        opt.param_groups[gi][key] = value
        opt.zero_grad()
        for r in _ranks(env):
            model(b[1].chunk(WORLD)[r]).backward()
        out[f"{key}[{gi}]"] = (catch(opt.step), max_abs_diff(_full_sd(model, env), before))
    return out


# ------------------------------------------------------------- messages that name the fix
def _messages(env):
    model, _, make = _setup(env)
    opt = make()
    _train(model, opt, make_batches(1, BATCH)[0], env)
    w = model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        write = catch(lambda: w.mul_(2.0))
    out = {"submodule_sd": catch(lambda: model.layers[0].state_dict()), "write": write}
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh
    dmuon.release(model)
    out["rededicate"] = catch(lambda: dmuon.dedicate_params(
        model, init_device_mesh("cpu", (env["world"],)), lambda n, p: p.ndim == 2))
    return out


EXACT = {"after_eval_z3": _after_eval(True), "after_eval_z2": _after_eval(False),
         "rebuilt_after_eval": _rebuilt_after_eval}
RAISES = {"before_root": _built_early("before_root"), "before_any": _built_early("before_any"),
          "head_swapped": _head_swapped}
OTHER = {"state_writes": _state_writes, "sd_hooks": _sd_hooks, "unread_keys": _unread_keys,
         "messages": _messages}


def _worker(rank, world):
    torch.set_num_threads(1)
    return run_each({**EXACT, **RAISES, **OTHER}, dict(rank=rank, world=world, dist=True))


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD, timeout=240)


# ------------------------------------------------------------- one rank
def _world1(env):
    """World 1: FSDP2 on the blocks only (the root's params plain: nothing to average) trains as
    one process; ``dmuon.Muon`` built before ``fully_shard(model)`` raises at its first step."""
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    out = {}
    for case in ("blocks_only", "before_root"):
        model = make_model()
        mesh = init_device_mesh("cpu", (1,))
        dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and "embed" not in n
                              and "lm_head" not in n)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        opt = dmuon.Muon(model, **OPTS)
        if case == "before_root":
            fully_shard(model, mesh=mesh)
        b = make_batches(STEPS, BATCH)
        try:
            for ids in b:
                opt.zero_grad()
                model(ids).backward()
                opt.step()
            out[case] = {"sd": _full_sd(model, env)}
        except RuntimeError as e:
            out[case] = {"error": str(e)}
    return out


def _world1_worker(rank, world):
    torch.set_num_threads(1)
    return _world1(dict(rank=rank, world=world, dist=True))


def test_world1_blocks_only_trains_and_a_later_fully_shard_raises():
    got = run_ranks(_world1_worker, 1, timeout=120)[0]
    model = make_model()
    opt = RefMuon(model)
    for ids in make_batches(STEPS, BATCH):
        opt.zero_grad()
        model(ids).backward()
        opt.step()
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert "error" not in got["blocks_only"], got["blocks_only"]
    assert max_abs_diff(got["blocks_only"]["sd"], ref) <= TOL
    msg = got["before_root"].get("error", "")
    assert "no longer the model's" in msg and "lm_head.weight" in msg, got["before_root"]


@pytest.mark.parametrize("key", sorted(EXACT))
def test_optimizer_built_after_a_forward_equals_one_process(results, key):
    ref = EXACT[key](dict(rank=0, world=1, dist=False))
    for rank, r in enumerate(results):
        got = r[key]
        assert "error" not in got, (key, rank, got.get("error"))
        assert got["stale"] == 0, (key, rank)
        worst = max_abs_diff(got["sd"], ref["sd"])
        assert worst <= TOL, f"{key} rank {rank}: max abs diff {worst:.3g}"


@pytest.mark.parametrize("key", sorted(RAISES))
def test_params_no_fsdp2_group_manages_raise_on_every_rank(results, key):
    for rank, r in enumerate(results):
        assert "error" not in r[key], (key, rank, r[key].get("error"))
        kind, msg = r[key]["early"]
        assert kind == "RuntimeError", (key, rank, kind, msg)
        assert "no FSDP2 group manages" in msg and "fully_shard" in msg, msg
        assert ("lm_head.weight" in msg) if key != "before_any" else ("norm.weight" in msg), msg


def test_optimizer_state_writes_raise_not_ignored(results):
    for rank, r in enumerate(results):
        got = r["state_writes"]
        assert "error" not in got, (rank, got.get("error"))
        for key in ("clear", "assign", "del", "set_field", "pop"):
            kind, msg = got[key]
            assert kind == "RuntimeError" and "optimizer.state" in msg and \
                "changes nothing" in msg, (key, rank, kind, msg)
        kind, msg = got["step_zero"]
        assert kind == "RuntimeError" and "written in place" in msg and "'step'" in msg, \
            (rank, kind, msg)
        assert got["unchanged"] == 0.0 and got["grads_dropped"] and got["then_steps"], got
        assert got["inference_read"] == (None, None), got["inference_read"]
        kind, msg = got["one_rank"]
        assert kind == "RuntimeError" and "optimizer.state" in msg and (
            ("another rank" in msg) == (rank != 0)) and "dcp" not in msg.lower(), (rank, msg)


def test_optimizer_state_dict_hooks_run_as_torchs(results):
    ref = _sd_hooks(dict(rank=0, world=1, dist=False))  # torch's own (RefMuon is a torch Optimizer)
    assert ref == {"calls": ["pre", "post", "load_pre", "load_post"], "extra": 7, "lr": 0.123}
    for rank, r in enumerate(results):
        assert r["sd_hooks"] == ref, (rank, r["sd_hooks"])


def test_param_group_keys_nothing_reads_raise_on_every_rank(results):
    for rank, r in enumerate(results):
        got = r["unread_keys"]
        assert "error" not in got, (rank, got.get("error"))
        for key, ((kind, msg), moved) in got.items():
            assert kind == "RuntimeError" and repr(key.split("[")[0]) in msg and \
                "nothing reads" in msg, \
                (key, rank, kind, msg)
            assert moved == 0.0, (key, rank, moved)


def test_refusals_name_the_fix(results):
    for rank, r in enumerate(results):
        got = r["messages"]
        assert "error" not in got, (rank, got.get("error"))
        kind, msg = got["submodule_sd"]
        assert kind == "DedicatedParamError" and "submodule's state_dict()" in msg and \
            "prefix" in msg, (rank, kind, msg)
        kind, msg = got["write"]
        assert kind == "DedicatedParamError" and "set_model_state_dict" in msg, (rank, kind, msg)
        kind, msg = got["rededicate"]
        assert kind == "RuntimeError" and "released by dmuon.release" in msg, (rank, kind, msg)
