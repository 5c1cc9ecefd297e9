"""Every load path checks the VALUES it loads before it changes anything (issue 46).

Before (2 gloo ranks, fp64): a complex64 value whose real part is NaN passed the finiteness check
(only ``is_floating_point`` dtypes were tested) through ``set_model_state_dict``,
``model.load_state_dict`` and ``Muon.load_state_dict`` (both formats); ``load_sharded`` with a
crafted ``momentum_dtype`` raised after installing the AdamW moments and counters; ``adamw_step
= -1`` loaded (the next ``step()`` divided by zero after changing state); lr = NaN, a string lr,
momentum 7 and ``ns_steps = 2000`` loaded; after torch's ``dcp.load`` into the live
``model.state_dict()`` / ``opt.state_dict()`` the load raised "Nothing was changed", which was false
(``dcp.load`` had written the NaN into the live FSDP2 param / AdamW moment).

Peer classes: a resume's first forward and step start from the loaded weights on every rank
(Megatron #6920: a post-load sync that never ran), Z3 and Z2; a restored momentum keeps the
saved values exactly or is converted with a logged note (DeepSpeed #8433), bf16 <-> fp32.

One spawn (``reliability_spawn``, part ``"loads"``) runs every multi-rank case.
"""
from __future__ import annotations

import datetime
import logging
import math

import pytest
import torch
from dist_utils import catch
from reliability_spawn import results


# ---------------------------------------------------------------------------------- helpers
def _build(rank, world, cfg=None, seed=0, steps=1):
    from models import make_model
    from stateful_harness import build_dmuon
    model = make_model(seed=seed)
    model, opt = build_dmuon(rank, world, model, model.layers, cfg or {},
                             timeout=datetime.timedelta(seconds=60))
    losses = _train(model, opt, rank, world, steps)
    return model, opt, losses


def _train(model, opt, rank, world, steps, seed=7, skip=0):
    from models import make_batches
    losses = []
    for ids in make_batches(skip + steps, 4, seed=seed)[skip:]:
        opt.zero_grad()
        loss = model(ids.chunk(world)[rank])
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
    return losses


def _snapshot(model, opt):
    import dmuon
    from dmuon.functional.optimizer_format import hparams
    return (dmuon.get_model_state_dict(model), dmuon.get_optimizer_state_dict(model, opt),
            [hparams(g) for g in opt.param_groups], opt.num_steps)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a)
                      and math.isnan(b))


def _outcome(model, opt, fn) -> tuple:
    """``(error type, message, state changed?)`` of ``fn()``; the state restored after. A
    ``dcp.load`` whose dict was then refused leaves the model half-loaded: dmuon's exports then
    refuse (session 16), which counts as changed (this harness snapshotted the mix before)."""
    import dmuon
    before = _snapshot(model, opt)
    kind, msg = catch(fn)
    after = catch(lambda: _snapshot(model, opt))
    changed = after[0] is not None or not _same(before, _snapshot(model, opt))
    if changed:  # put the good state back for the next case
        dmuon.set_model_state_dict(model, before[0])
        for g, h in zip(opt.param_groups, before[2]):
            g.update(h)
        dmuon.set_optimizer_state_dict(model, opt, before[1])
    return kind, msg, changed


def _complex_nan(t: torch.Tensor) -> torch.Tensor:
    """A full complex64 copy of ``t`` whose first real part is NaN (imaginary parts 0)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    c = full.detach().to(torch.complex64).clone()
    c.view(-1)[0] = complex(float("nan"), 0.0)
    return c


def _torch_protocol(opt, change):
    """``opt.state_dict()`` with ``change(sd, muon_index, adamw_index)`` applied (values replaced,
    never written: its AdamW moments are live views)."""
    sd = opt.state_dict()
    sd = {"state": {i: dict(e) for i, e in sd["state"].items()},
          "param_groups": [dict(g) for g in sd["param_groups"]]}
    change(sd, sd["param_groups"][0]["params"][0], sd["param_groups"][1]["params"][0])
    return sd


#: crafted changes of a loaded optimizer dict: name -> (torch protocol change, full format change)
def _cases():
    nan = float("nan")

    def grp(key, value):
        return (lambda sd, m, a: sd["param_groups"][0].__setitem__(key, value),
                lambda sd: sd["param_groups"][0].__setitem__(key, value))

    def step(value):
        return (lambda sd, m, a: [e.__setitem__("step", torch.tensor(float(value)))
                                  for i, e in sd["state"].items() if i != m],
                lambda sd: sd.__setitem__("adamw_step", value))

    return {
        "complex_momentum": (
            lambda sd, m, a: sd["state"][m].__setitem__(
                "momentum_buffer", _complex_nan(sd["state"][m]["momentum_buffer"])),
            lambda sd: (lambda e: e.__setitem__("momentum_buffer", _complex_nan(
                e["momentum_buffer"])))(next(iter(sd["dedicated"].values())))),
        "complex_moment": (
            lambda sd, m, a: sd["state"][a].__setitem__("exp_avg",
                                                        _complex_nan(sd["state"][a]["exp_avg"])),
            lambda sd: (lambda e: e.__setitem__("exp_avg", _complex_nan(e["exp_avg"])))(
                next(iter(sd["fsdp2"].values())))),
        "int_momentum": (
            lambda sd, m, a: sd["state"][m].__setitem__(
                "momentum_buffer", sd["state"][m]["momentum_buffer"].to(torch.int32)),
            lambda sd: (lambda e: e.__setitem__("momentum_buffer", e["momentum_buffer"].to(
                torch.int32)))(next(iter(sd["dedicated"].values())))),
        "adamw_step_-1": step(-1),
        "lr_nan": grp("lr", nan),
        "lr_str": grp("lr", "0.02"),
        "momentum_7": grp("momentum", 7.0),
        "ns_steps_2000": grp("ns_steps", 2000),
        "momentum_dtype": grp("momentum_dtype", "torch.int8"),
        "adamw_lr_nan": (lambda sd, m, a: sd["param_groups"][1].__setitem__("lr", nan),
                         lambda sd: sd["param_groups"][1].__setitem__("lr", nan)),
        "steps_disagree": (
            lambda sd, m, a: sd["state"][a].__setitem__("step", torch.tensor(5.0)),
            lambda sd: sd.__setitem__("muon_step", int(sd["num_steps"]) + 3)),
        # a checkpoint of a transform= chain with a count (an in-chain schedule) into plain Muon.
        # Before (a user-path review, session 16): a bare ValueError after the momentum, AdamW's
        # state and the counters were installed; the next step() trained on, silently
        "variant_scalars": (lambda sd, m, a: sd["param_groups"][0].__setitem__(
            "variant_scalars", [3.0]), lambda sd: sd.__setitem__("variant_scalars", [3.0])),
        # no param groups (torch's load_state_dict refuses a group count that differs). Before (a
        # review, session 16): loaded, matching no param: every state zeroed, silently
        "no_groups": (lambda sd, m, a: sd.__setitem__("param_groups", []),
                      lambda sd: sd.__setitem__("param_groups", [])),
    }


def _log_lines():
    msgs: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            msgs.append(record.getMessage())
    handler = Keep(level=logging.INFO)
    logging.getLogger("dmuon").addHandler(handler)
    logging.getLogger("dmuon").setLevel(logging.INFO)
    return msgs, handler


# ---------------------------------------------------------------------------------- the worker
#: the default tier's subset (the slow tier runs every case through every route)
_FAST_CASES = ("complex_momentum", "int_momentum", "adamw_step_-1", "lr_nan", "momentum_dtype",
               "variant_scalars", "no_groups")
_FAST_ROUTES = ("torch", "muon_full", "set_rank0")


def _loads(rank: int, world: int, tmp: str, every: bool = False) -> dict:
    """The load cases on one model (``every``: every case, route and dtype; else a subset)."""
    import time
    t0 = time.perf_counter()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, set_optimizer_state_dict as torch_set_osd)

    import dmuon
    model, opt, _ = _build(rank, world, steps=2)
    out: dict = {"t_build": time.perf_counter() - t0}
    # 1. complex NaN into the model: an FSDP2 param and a dedicated matrix, both model routes
    full = dmuon.get_model_state_dict(model)
    fsdp_key = next(k for k in full if full[k].ndim == 1)
    ded_key = next(k for k in full if "proj" in k)
    for key in (fsdp_key, ded_key):
        bad = {**full, key: _complex_nan(full[key])}
        if every or key == ded_key:
            out[f"model_set_{key}"] = _outcome(model, opt,
                                               lambda: dmuon.set_model_state_dict(model, bad))
        if every or key == fsdp_key:
            out[f"model_torch_{key}"] = _outcome(model, opt, lambda: model.load_state_dict(bad))
    # fp8 / fp16 values with NaN / Inf (fp8 has no isfinite of its own in older torch)
    for dt in (torch.float16, torch.bfloat16, torch.float8_e5m2) if every else (torch.float8_e5m2,):
        bad = {**full, fsdp_key: full[fsdp_key].to(dt)}
        bad[fsdp_key].view(-1)[0] = float("inf")
        out[f"model_set_{dt}"] = _outcome(model, opt,
                                          lambda: dmuon.set_model_state_dict(model, bad))
    out["t_model"] = time.perf_counter() - t0
    # 2. optimizer loads: every case through each route
    for name, (torch_change, full_change) in _cases().items():
        if not every and name not in _FAST_CASES:
            continue
        out[f"torch_{name}"] = _outcome(model, opt, lambda: opt.load_state_dict(
            _torch_protocol(opt, torch_change)))
        for route in ("muon_full", "set_full", "set_rank0") if every else ("muon_full",
                                                                           "set_rank0"):
            sd = dmuon.get_optimizer_state_dict(model, opt)
            full_change(sd)
            fn = {"muon_full": lambda: opt.load_state_dict(sd),
                  "set_full": lambda: dmuon.set_optimizer_state_dict(model, opt, sd),
                  "set_rank0": lambda: dmuon.set_optimizer_state_dict(
                      model, opt, sd if rank == 0 else None, rank0_only=True)}[route]
            out[f"{route}_{name}"] = _outcome(model, opt, fn)
        if every:
            out[f"torch_set_{name}"] = _outcome(model, opt, lambda: torch_set_osd(
                model, opt, _torch_protocol(opt, torch_change),
                options=StateDictOptions(full_state_dict=False)))
    # a good load still loads (the round trip through each route)
    out["good_torch"] = _outcome(model, opt, lambda: opt.load_state_dict(opt.state_dict()))
    out["good_full"] = _outcome(model, opt, lambda: opt.load_state_dict(
        dmuon.get_optimizer_state_dict(model, opt)))
    out["t_opt"] = time.perf_counter() - t0
    # 2b. load_sharded of checkpoints crafted through the optimizer it saves
    path = f"{tmp}/ckpt"
    g0, g1 = opt.param_groups
    crafted = {"momentum_dtype": (g0, "momentum_dtype", "torch.int8"),
               "lr_nan": (g0, "lr", float("nan")), "momentum_7": (g0, "momentum", 7.0),
               "ns_steps_2000": (g0, "ns_steps", 2000), "adamw_lr_nan": (g1, "lr", float("nan"))}
    for name, (g, key, value) in crafted.items():
        if not every and name != "momentum_dtype":
            continue
        old = g[key]
        g[key] = value
        dmuon.save_sharded(f"{path}-{name}", model, opt)
        g[key] = old
        out[f"sharded_{name}"] = _outcome(model, opt,
                                          lambda: dmuon.load_sharded(f"{path}-{name}", model, opt))
    if every:
        st = opt.adamw_state
        opt.adamw_state = st._replace(step=torch.tensor(-1.0, dtype=torch.float64))
        dmuon.save_sharded(f"{path}-step", model, opt)
        opt.adamw_state = st
        out["sharded_adamw_step_-1"] = _outcome(
            model, opt, lambda: dmuon.load_sharded(f"{path}-step", model, opt))
    out["t_sharded"] = time.perf_counter() - t0
    # 3. torch's own DCP route: dcp.load writes into the live FSDP2 params / AdamW moments
    from torch.distributed.tensor import DTensor
    msd, osd = model.state_dict(), opt.state_dict()
    p = msd[fsdp_key]
    msd = {**msd, fsdp_key: DTensor.from_local(torch.full_like(p.to_local(), float("nan")),
                                               p.device_mesh, p.placements)}
    a = osd["param_groups"][1]["params"][0]
    m = osd["state"][a]["exp_avg"]
    osd = {"state": {**osd["state"], a: {**osd["state"][a], "exp_avg": DTensor.from_local(
        torch.full_like(m.to_local(), float("nan")), m.device_mesh, m.placements)}},
        "param_groups": osd["param_groups"]}
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/dcp")
    for what in ("model", "optim"):
        def load():
            live = {"model": model.state_dict(), "optim": opt.state_dict()}
            dcp.load(live, checkpoint_id=f"{tmp}/dcp")
            (model if what == "model" else opt).load_state_dict(live[what])
        out[f"dcp_{what}"] = _outcome(model, opt, load)
    # refused for another reason (a bad counter): dcp.load has written the live moments all the same
    osd = opt.state_dict()
    osd = {"state": {i: {**e, "step": torch.tensor(-1.0)} if i == a else e
                     for i, e in osd["state"].items()}, "param_groups": osd["param_groups"]}
    dcp.save({"optim": osd}, checkpoint_id=f"{tmp}/dcp_counter")

    def load_counter():
        live = {"optim": opt.state_dict()}
        dcp.load(live, checkpoint_id=f"{tmp}/dcp_counter")
        opt.load_state_dict(live["optim"])
    out["dcp_counter"] = _outcome(model, opt, load_counter)
    out.update(_signed_zeros(model, opt, rank, ded_key))
    out["seconds"] = time.perf_counter() - t0
    return out


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values with equal signs (``torch.equal`` holds for -0.0 == +0.0)."""
    return a.dtype == b.dtype and bool(torch.equal(a, b)) and \
        bool(torch.equal(torch.signbit(a), torch.signbit(b)))


def _signed_zeros(model, opt, rank: int, ded_key: str) -> dict:
    """A dedicated matrix and its momentum holding -0.0 entries, loaded through each route and
    read back: ``{route: bitwise equal to what was saved}`` (the state restored after)."""
    import dmuon
    full, osd = dmuon.get_model_state_dict(model), dmuon.get_optimizer_state_dict(model, opt)
    out: dict = {}
    signed = {**full, ded_key: full[ded_key].clone()}
    signed[ded_key].view(-1)[::2] = -0.0
    assert int(torch.signbit(signed[ded_key]).logical_and(signed[ded_key] == 0).sum()) > 0
    for route, load in (
            ("model_set", lambda: dmuon.set_model_state_dict(model, signed)),
            ("model_torch", lambda: model.load_state_dict(signed)),
            ("model_set_rank0", lambda: dmuon.set_model_state_dict(
                model, signed if rank == 0 else None, rank0_only=True))):
        dmuon.set_model_state_dict(model, full)
        load()
        out[f"signed_zero_{route}"] = _bitwise(dmuon.get_model_state_dict(model)[ded_key],
                                               signed[ded_key])
    dmuon.set_model_state_dict(model, full)
    name = next(iter(osd["dedicated"]))
    mom = osd["dedicated"][name]["momentum_buffer"].clone()
    mom.view(-1)[::2] = -0.0
    sd = {**osd, "dedicated": {**osd["dedicated"],
                               name: {**osd["dedicated"][name], "momentum_buffer": mom}}}
    for route, load in (
            ("optimizer_set", lambda: dmuon.set_optimizer_state_dict(model, opt, sd)),
            ("optimizer_set_rank0", lambda: dmuon.set_optimizer_state_dict(
                model, opt, sd if rank == 0 else None, rank0_only=True))):
        dmuon.set_optimizer_state_dict(model, opt, osd)
        load()
        got = dmuon.get_optimizer_state_dict(model, opt)["dedicated"][name]["momentum_buffer"]
        out[f"signed_zero_{route}"] = _bitwise(got, mom)
    dmuon.set_optimizer_state_dict(model, opt, osd)
    return out


def _peers(rank: int, world: int, tmp: str) -> dict:
    """The peer classes (slow tier: one spawn of its own)."""
    import time
    t0 = time.perf_counter()
    model, _, _ = _build(rank, world, steps=0)
    # peer (b): a restored momentum keeps its saved values, or is converted with a note
    out = {"loads": _loads(rank, world, f"{tmp}/every", every=True),
           "momentum_dtype": _momentum_dtypes(rank, world, tmp, model)}
    # peer (a): a resume starts from the loaded weights on every rank, Z3 and Z2
    for z3 in (True, False):
        out[f"resume_z3={z3}"] = _resume(rank, world, tmp, z3)
    out["seconds"] = time.perf_counter() - t0
    return out


def _resume(rank, world, tmp, z3) -> dict:
    """Megatron #6920's class: run A trains 2 steps, is saved (each route), trains a 3rd; run B
    (other weights, one step and an eval forward behind it: Z2 keeps its gathered copies) loads
    the save and trains the 3rd step: its loss and its weights after equal A's, on every rank."""
    import dmuon
    a, oa, _ = _build(rank, world, {"z3": z3}, steps=2)
    msd, osd = dmuon.get_model_state_dict(a), dmuon.get_optimizer_state_dict(a, oa)
    tsd = {"state": {i: {k: v.clone() for k, v in e.items()} for i, e in
                     oa.state_dict()["state"].items()},
           "param_groups": oa.state_dict()["param_groups"]}
    dmuon.save_sharded(f"{tmp}/resume-{z3}", a, oa)
    want_loss = _train(a, oa, rank, world, 1, skip=2)
    want = dmuon.get_model_state_dict(a)
    out = {}
    for route in ("sharded", "set", "torch"):
        b, ob, _ = _build(rank, world, {"z3": z3}, seed=5, steps=1)
        with torch.no_grad():  # an eval forward before the load
            from models import make_batches
            b(make_batches(1, 4, seed=11)[0].chunk(world)[rank])
        from torch.distributed.fsdp import FSDPModule
        for m in b.modules():  # FSDP2's params sharded again (dmuon's gathered copies stay, Z2)
            if isinstance(m, FSDPModule):
                m.reshard()
        if route == "sharded":
            dmuon.load_sharded(f"{tmp}/resume-{z3}", b, ob)
        elif route == "set":
            dmuon.set_model_state_dict(b, msd)
            dmuon.set_optimizer_state_dict(b, ob, osd)
        else:
            b.load_state_dict(msd)
            ob.load_state_dict(tsd)
        loss = _train(b, ob, rank, world, 1, skip=2)
        got = dmuon.get_model_state_dict(b)
        out[route] = (loss == want_loss, all(torch.equal(got[k], want[k]) for k in want))
    return out


def _momentum_dtypes(rank, world, tmp, model) -> dict:
    """DeepSpeed #8433's class: bf16 momentum saved, loaded into an fp32-momentum optimizer, and
    fp32 into bf16, through each route: the loaded momentum equals the saved one (converted
    exactly where the target holds it) and a note names the conversion."""
    import dmuon
    from dmuon.functional import variants
    from dmuon.functional.state_dtype import round_trip
    from stateful_harness import HP

    def muon(dtype):
        kw = {k: v for k, v in HP.items()}
        return dmuon.Muon(model, ns_dtype=torch.float64,
                          transform=variants.muon(momentum_dtype=dtype) if dtype else None, **kw)

    out = {}
    for src, dst in ((torch.bfloat16, None), (None, torch.bfloat16)):
        for route in ("set_full", "muon_torch", "sharded"):
            o = muon(src)
            _train(model, o, rank, world, 1, seed=3)
            saved = {n: e["momentum_buffer"].clone() for n, e in
                     dmuon.get_optimizer_state_dict(model, o)["dedicated"].items()}
            sd = dmuon.get_optimizer_state_dict(model, o) if route == "set_full" else \
                o.state_dict() if route == "muon_torch" else None
            if route == "sharded":
                dmuon.save_sharded(f"{tmp}/mom-{src}-{dst}", model, o)
            new = muon(dst)
            msgs, handler = _log_lines()
            try:
                if route == "set_full":
                    dmuon.set_optimizer_state_dict(model, new, sd)
                elif route == "muon_torch":
                    new.load_state_dict(sd)
                else:
                    dmuon.load_sharded(f"{tmp}/mom-{src}-{dst}", model, new)
            finally:
                logging.getLogger("dmuon").removeHandler(handler)
            got = {n: e["momentum_buffer"] for n, e in
                   dmuon.get_optimizer_state_dict(model, new)["dedicated"].items()}
            want = {n: round_trip(v.to(torch.float64), dst) if dst is not None else
                    v.to(torch.float64) for n, v in saved.items()}
            exact = all(torch.equal(got[n].to(torch.float64), want[n]) for n in want)
            differs = any(not torch.equal(got[n].to(torch.float64), saved[n].to(torch.float64))
                          for n in saved)
            noted = [m for m in msgs if "momentum" in m and "converted" in m]
            out[f"{src}->{dst} {route}"] = (exact, differs, noted)
    return out


# ---------------------------------------------------------------------------------- tests
def _every_rank(res, key):
    return [r[key] for r in res]


def test_value_problems_checks_complex_and_every_float_dtype():
    from dmuon.functional.state_dict_check import value_problems
    for dt in (torch.complex64, torch.complex128, torch.float16, torch.bfloat16, torch.float32,
               torch.float8_e4m3fn, torch.float8_e5m2):
        v = torch.zeros(3, 2, dtype=dt)
        v.view(-1)[1] = complex(float("nan"), 0) if dt.is_complex else float("nan")
        assert value_problems("w", v, (3, 2), torch.float32) == \
            ["w: non-finite values (NaN/Inf)"], dt
        assert value_problems("w", torch.zeros(3, 2, dtype=dt), (3, 2), torch.float32) == [], dt
    inf = torch.zeros(2, dtype=torch.complex64)
    inf[0] = complex(0, float("inf"))  # an infinite imaginary part too
    assert value_problems("b", inf, (2,), torch.float64) == ["b: non-finite values (NaN/Inf)"]


def _groups():
    from stateful_harness import HP
    from dmuon.functional.muon import MuonHParams
    muon = dict(name="muon", lr=HP["lr"], momentum=HP["momentum"], nesterov=True,
                weight_decay=HP["weight_decay"], ns_steps=5, momentum_dtype="torch.float32")
    muon = {k: muon.get(k, MuonHParams._field_defaults.get(k)) for k in
            ("name", "momentum_dtype", *MuonHParams._fields)}
    adamw = dict(name="adamw", lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0,
                 adamw_state_dtype="torch.float32")
    return [muon, adamw]


def test_load_problems_names_every_bad_counter_dtype_and_hparam():
    """The pure check every load path calls (fast; the multi-rank tests above run it through
    each route): the constructor's own checks of the saved groups, counters, storage dtypes."""
    from dmuon.functional.load_scalars import counters, load_problems
    mine = _groups()
    ok = {"adamw_step": 3, "muon_step": 3, "num_steps": 3, "param_groups": _groups()}
    assert load_problems(ok, mine) == []
    assert counters({"adamw_step": torch.tensor(3.0), "muon_step": 2}) == \
        {"adamw_step": 3, "muon_step": 2, "num_steps": 3}  # num_steps missing: the larger
    import numpy as np  # counters a loop kept as numpy scalars load as the same counts
    numpy_counts = {"adamw_step": np.int64(3), "muon_step": np.float32(3.0), "num_steps": 3}
    assert load_problems({**ok, **numpy_counts}, mine) == [] and counters(numpy_counts) == \
        {"adamw_step": 3, "muon_step": 3, "num_steps": 3}
    assert "muon_step" in load_problems({**ok, "muon_step": np.bool_(True)}, mine)[0]
    bad = {"adamw_step": -1, "muon_step": 2.5, "num_steps": "3"}
    got = load_problems({**ok, **bad}, mine)
    assert [p.split(":")[0] for p in got] == ["adamw_step", "muon_step", "num_steps"], got
    assert load_problems({**ok, "muon_step": 4}, mine) == \
        ["muon_step = 4 exceeds num_steps = 3 (a step count above the optimizer's steps)"]
    assert "disagree" in load_problems({**ok, "adamw_step": (3.0, 5.0)}, mine)[0]
    for i, key, value, needle in ((0, "lr", float("nan"), "lr"), (0, "lr", "0.02", "lr"),
                                  (0, "momentum", 7.0, "momentum"),
                                  (0, "ns_steps", 2000, "ns_steps"),
                                  (0, "momentum_dtype", "torch.int8", "momentum_dtype"),
                                  (1, "lr", float("inf"), "lr"), (1, "betas", (0.9, 2.0), "betas"),
                                  (1, "eps", "x", "eps"),
                                  (1, "adamw_state_dtype", "torch.float8_e4m3fn", "adamw_state")):
        groups = _groups()
        groups[i][key] = value
        got = load_problems({**ok, "param_groups": groups}, mine)
        assert len(got) == 1 and needle in got[0] and got[0].startswith("param_groups["), \
            (key, value, got)
    assert "variant_scalars" in load_problems({**ok, "variant_scalars": [1.0]}, mine,
                                              scalars=2)[0]


def test_the_constructor_bounds_ns_steps_as_loads_do():
    from dmuon.functional import muon_options
    from dmuon.functional.muon import MAX_NS_STEPS
    group = _groups()[0]
    muon_options.check_muon_group({**group, "ns_steps": MAX_NS_STEPS})
    with pytest.raises(ValueError, match="ns_steps must be an int in"):
        muon_options.check_muon_group({**group, "ns_steps": MAX_NS_STEPS + 1})


def test_live_nonfinite_finds_values_written_into_live_tensors():
    # live_nonfinite was folded into live_views + view_problems (one walk of the live storages);
    # the same cases, through them
    from dmuon.functional.state_dict_check import (ALREADY_WRITTEN, live_views, view_problems,
                                                   what_changed, written_problems)
    live = torch.zeros(4, dtype=torch.float64)
    live[1] = float("nan")
    copy = live.clone()
    values = {"view": live[1:], "copy": copy, "same": live}
    views = live_views(values, [live])
    assert views == ["view", "same"]
    nan = [f"{k}: non-finite values (NaN/Inf)" for k in values]
    assert "['view', 'same']" in view_problems(nan, views)[0]
    assert live_views({"ok": torch.zeros(2)}, [torch.zeros(2)]) == []
    assert written_problems([]) == []
    line = written_problems(["w"])[0]
    assert ALREADY_WRITTEN in line and "Nothing was changed" not in what_changed(line)
    assert what_changed("w: non-finite values (NaN/Inf)") == "Nothing was changed on any rank."


def test_live_views_find_live_tensors_whatever_they_hold():
    from dmuon.functional.state_dict_check import (ALREADY_WRITTEN, LIVE_VIEWS, live_views,
                                                   view_problems, what_changed)
    live = torch.zeros(4, dtype=torch.float64)
    assert live_views({"view": live[1:], "copy": live.clone(), "same": live}, [live]) == \
        ["view", "same"]
    assert view_problems([], ["same"]) == [] and view_problems(["lr: bad"], []) == ["lr: bad"]
    refused = view_problems(["adamw_step: bad"], ["same"])
    assert LIVE_VIEWS in refused[0] and refused[1:] == ["adamw_step: bad"]
    msg = what_changed(" ".join(refused))
    assert "Nothing was changed on any rank" not in msg and "dcp.load" in msg and "already" in msg
    nan = view_problems(["same: non-finite values (NaN/Inf)"], ["same", "view"])
    assert ALREADY_WRITTEN in nan[0] and "['same']" in nan[0]


def _check_model(res):
    keys = [k for k in res[0] if k.startswith("model_")]
    assert len(keys) >= 3, keys
    for key in keys:
        for rank, (kind, msg, changed) in enumerate(_every_rank(res, key)):
            assert kind == "StateDictError" and "non-finite" in msg, (key, rank, kind, msg)
            assert "Nothing was changed" in msg and not changed, (key, rank)


_ROUTES = ("torch", "muon_full", "set_full", "set_rank0", "torch_set")


def _routes(res, name):
    """The routes ``res`` tried for case ``name`` (the default tier's subset, or every one)."""
    got = [r for r in _ROUTES if f"{r}_{name}" in res[0]]
    assert len(got) >= 3, (name, got)
    return got


def _check_complex_optimizer(res):
    for name in ("complex_momentum", "complex_moment"):
        for route in _routes(res, name) if f"torch_{name}" in res[0] else ():
            for rank, (kind, msg, changed) in enumerate(_every_rank(res, f"{route}_{name}")):
                assert kind == "StateDictError" and "non-finite" in msg, (route, name, rank, msg)
                assert "Nothing was changed" in msg and not changed, (route, name, rank)


def _check_scalars(res):
    want = {"adamw_step_-1": "adamw_step", "lr_nan": "lr", "lr_str": "lr",
            "momentum_7": "momentum", "ns_steps_2000": "ns_steps",
            "momentum_dtype": "momentum_dtype", "adamw_lr_nan": "lr",
            "steps_disagree": "step", "variant_scalars": "variant_scalars",
            "no_groups": "param_groups: 0 groups"}
    assert "sharded_momentum_dtype" in res[0]
    for name, needle in want.items():
        for route in _routes(res, name) if f"torch_{name}" in res[0] else ():
            for rank, (kind, msg, changed) in enumerate(_every_rank(res, f"{route}_{name}")):
                assert kind == "StateDictError" and needle in msg, (route, name, rank, kind, msg)
                assert "Nothing was changed" in msg and not changed, (route, name, rank, msg)
        if f"sharded_{name}" in res[0]:
            for rank, (kind, msg, changed) in enumerate(_every_rank(res, f"sharded_{name}")):
                assert kind == "CheckpointError" and needle in msg, (name, rank, kind, msg)
                assert "Nothing was changed" in msg and not changed, (name, rank, msg)
    for key in ("good_torch", "good_full"):
        assert _every_rank(res, key) == [(None, None, False)] * 2


def _check_dcp(res):
    for what in ("model", "optim"):
        outs = _every_rank(res, f"dcp_{what}")
        assert all(kind == "StateDictError" for kind, _, _ in outs), outs
        assert any(changed for _, _, changed in outs), outs  # dcp.load itself wrote the NaN
        for kind, msg, changed in outs:
            assert "Nothing was changed" not in msg, msg
            assert "dcp.load" in msg and "already" in msg, msg


def _check_dcp_refused_for_another_reason(res):
    for kind, msg, _ in _every_rank(res, "dcp_counter"):
        assert kind == "StateDictError" and "step" in msg, msg
        assert "Nothing was changed on any rank" not in msg, msg
        assert "dcp.load" in msg and "already" in msg, msg


def test_a_dcp_load_refused_for_another_reason_says_what_dcp_load_wrote(tmp_path_factory):
    _check_dcp_refused_for_another_reason(results(2, "loads", tmp_path_factory))


def test_complex_and_narrow_nonfinite_model_values_are_refused_unchanged(tmp_path_factory):
    _check_model(results(2, "loads", tmp_path_factory))


def test_complex_nonfinite_optimizer_values_are_refused_unchanged(tmp_path_factory):
    _check_complex_optimizer(results(2, "loads", tmp_path_factory))


def test_counters_dtypes_and_hparams_are_checked_before_anything_changes(tmp_path_factory):
    _check_scalars(results(2, "loads", tmp_path_factory))


def test_dcp_load_into_live_state_dicts_is_reported_truthfully(tmp_path_factory):
    _check_dcp(results(2, "loads", tmp_path_factory))


def _check_wrong_dtype_momentum(res):
    """An integer momentum entry: every route refuses it with the plain route's problem, the same
    message on every rank, nothing changed."""
    import re
    want = re.search(r"\['momentum_buffer'\]: dtype torch\.int32 cannot load [^(]*\([^)]*\)",
                     _every_rank(res, "muon_full_int_momentum")[0][1])
    assert want, _every_rank(res, "muon_full_int_momentum")
    for route in _routes(res, "int_momentum"):
        outs = _every_rank(res, f"{route}_int_momentum")
        assert len({msg for _, msg, _ in outs}) == 1, (route, outs)
        for rank, (kind, msg, changed) in enumerate(outs):
            assert kind == "StateDictError" and want.group(0) in str(msg), (route, rank, msg)
            assert "Nothing was changed" in msg and not changed, (route, rank, msg)


def test_a_wrong_dtype_momentum_is_refused_alike_on_every_route(tmp_path_factory):
    _check_wrong_dtype_momentum(results(2, "loads", tmp_path_factory))


def test_signed_zeros_load_bitwise_through_every_route(tmp_path_factory):
    """A dedicated matrix's and its momentum's -0.0 entries keep their sign through
    ``set_model_state_dict``, ``model.load_state_dict``, the ``rank0_only`` loads and
    ``set_optimizer_state_dict`` (read back bitwise: values and sign bits)."""
    res = results(2, "loads", tmp_path_factory)
    routes = [k for k in res[0] if k.startswith("signed_zero_")]
    assert len(routes) == 5, routes
    for rank, r in enumerate(res):
        assert {k: r[k] for k in routes} == dict.fromkeys(routes, True), rank


def test_readme_says_what_dcp_load_into_live_state_dicts_does():
    from pathlib import Path
    text = Path(__file__).resolve().parents[1].joinpath("docs", "checkpoints.md").read_text()
    assert "writes FSDP2's params and AdamW's moments in place before dmuon sees" in \
        " ".join(text.split())


_PEERS: dict = {}


def _peer_results(tmp_path_factory) -> list:
    if not _PEERS:
        from dist_utils import run_ranks
        _PEERS["res"] = run_ranks(_peers, 2, str(tmp_path_factory.mktemp("peers")), timeout=300)
    return _PEERS["res"]


@pytest.mark.slow  # ~60 s on 2 ranks: every case through every route (the default tier: a subset)
def test_every_load_case_through_every_route(tmp_path_factory):
    res = [r["loads"] for r in _peer_results(tmp_path_factory)]
    for check in (_check_model, _check_complex_optimizer, _check_scalars, _check_dcp,
                  _check_wrong_dtype_momentum):
        check(res)


@pytest.mark.slow  # shares the spawn above (8 optimizers and 8 models built on 2 ranks)
def test_restored_momentum_keeps_its_dtype_or_is_converted_with_a_note(tmp_path_factory):
    """DeepSpeed #8433's class: fails when a load converts the momentum without its logged note
    (``state_storage.note_conversion``) or converts it inexactly."""
    res = _peer_results(tmp_path_factory)
    for rank, r in enumerate(_every_rank(res, "momentum_dtype")):
        assert len(r) == 6, r
        for case, (exact, differs, noted) in r.items():
            assert exact, (rank, case)
            assert noted, (rank, case, "a conversion without a logged note")


@pytest.mark.slow  # shares the spawn above
def test_a_resume_starts_from_the_loaded_weights_on_every_rank(tmp_path_factory):
    """Megatron #6920's class (a post-load sync that never runs): fails when a load path does not
    mark the masters changed (the gathered copies of the weights before the load are used)."""
    res = _peer_results(tmp_path_factory)
    for z3 in (True, False):
        for rank, r in enumerate(_every_rank(res, f"resume_z3={z3}")):
            assert r == {"sharded": (True, True), "set": (True, True), "torch": (True, True)}, \
                (z3, rank, r)
