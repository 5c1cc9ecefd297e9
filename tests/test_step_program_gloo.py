"""The runtime interprets the step program, on real gloo meshes (fp64):

* its executor's counters equal the program's traffic, per rank and lane, step after step (Z3 with
  a root-group matrix, which is never re-gathered; HSDP 2 x 2 in Z2);
* one runtime step equals the pure ``world_step`` (the simulator) fed with every rank's local
  gradients, and ``rank_step`` through the runtime's executor equals ``world_step`` too.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from models import make_batches, make_model, muon_predicate
from stateful_harness import build_dmuon, model_kwargs

STEPS, BATCH = 2, 8


def _worker(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed as dist

    import dmuon
    from dmuon.functional.step import rank_step, world_step

    model = make_model(**model_kwargs(cfg))
    model, opt = build_dmuon(rank, world, model, list(model.layers), cfg)
    rt = opt.dedicated_state
    out: dict = {"err": 0.0, "rank_step_err": 0.0}
    for step, ids in enumerate(make_batches(STEPS, BATCH)):
        local = ids.chunk(world)[rank]
        before = dmuon.get_model_state_dict(model)
        # this rank's local gradients of the dedicated matrices, from a plain replica
        plain = make_model(**model_kwargs(cfg))
        plain.load_state_dict(before)
        plain(local).backward()
        mine = {n: p.grad for n, p in plain.named_parameters() if muon_predicate(n, p)}
        grads: list = [None] * world
        dist.all_gather_object(grads, mine)
        opt.zero_grad()
        model(local).backward()
        opt.step()
        after = dmuon.get_model_state_dict(model)
        prog = rt.program
        G = prog.shard_size
        col = lambda i: {n: before[n].clone() for n in rt.names if rt.owners[n][0] == i % G}  # noqa: E731
        if step == 0:  # fresh states: the pure step from the same point
            sim, _, sched = world_step([col(i) for i in range(world)], grads, prog, None,
                                       opt.muon_hparams())
            for i in range(world):
                for n, v in sim[i].items():
                    out["err"] = max(out["err"], float((v - after[n]).abs().max()))
            # the same step, this rank through the runtime's executor
            s, r = rt.coord
            mine_p, _, ran = rank_step(rt.coord, col(r * G + s), grads[rank], None, prog,
                                       opt.muon_hparams(), rt.executor.run)
            for n, v in mine_p.items():
                out["rank_step_err"] = max(out["rank_step_err"], float((v - after[n]).abs().max()))
            out["ran_ops"] = len(ran) == len(sched)
    out["counters"] = rt.executor.counters()
    out["expected"] = {lane: {k: STEPS * v for k, v in c.items()}
                       for lane, c in rt.program.rank_counters(rt.coord).items()}
    # rank_step above ran one reduce + publish through the same executor
    for lane, c in rank_step_traffic(rt).items():
        for k, v in c.items():
            out["expected"][lane][k] += v
    out["root_regather"] = rt.program.groups.get("", None) is not None and \
        not rt.program.groups[""].reshard_after_forward
    return out


def rank_step_traffic(rt) -> dict:
    """What one ``rank_step`` moves on ``rt``'s rank: the reduces and the publish."""
    from dmuon.functional.schedule import Schedule
    prog = rt.program
    ops = tuple(op for k in prog.reduce_order for op in prog.groups[k].reduce)
    tr = (Schedule(ops, prog.shard_size, prog.replicate_size) + prog.publish_all()).traffic()
    s, r = rt.coord
    return tr.for_rank(r * prog.shard_size + s)


@pytest.mark.parametrize("cfg", [pytest.param({"z3": True, "root_proj": True}, id="z3-root-group"),
                                 pytest.param({"hsdp": True, "z3": False}, id="hsdp-z2",
                                              marks=pytest.mark.slow)])
def test_runtime_runs_the_program(cfg):
    results = run_ranks(_worker, 4, cfg, timeout=300)
    for r, out in enumerate(results):
        assert out["err"] <= 1e-12, (r, out["err"])
        assert out["rank_step_err"] <= 1e-12, (r, out["rank_step_err"])
        assert out["ran_ops"]
        for lane in ("unshard", "reduce", "replicate"):
            assert out["counters"][lane] == out["expected"][lane], (r, lane)
    if cfg.get("root_proj"):
        assert results[0]["root_regather"]
