"""HSDP with a 2-D replicate mesh, and HSDP with TP: exact, and every collective issued in the same
order on every rank of its group (issue 46's peer class, MindSpore hyper-parallel #189: publish
broadcasts ordered per rank on one axis and not another).

* Default tier, pure: the step program of a (replicate 2 x 2 = R 4, shard 2) grid and TP's
  schedule over (dp 8, tp 2): per process group, every member's sequence of ops is the same
  (:func:`group_sequence_mismatches`) and :func:`~dmuon.functional.order_check.check_orders` plays
  them to the end; one rank publishing in another order is caught by both.
* Slow (8 gloo ranks, one spawn): ``dedicate_params(..., replicate_mesh=mesh["ra", "rb"])`` (a
  2-D replicate mesh; FSDP2 gets the flattened ``("replicate", "shard")`` mesh) on (2, 2, 2), and
  (replicate 2, shard 2, tp 2) HSDP + TP: 3 fp64 steps equal one process (<= 1e-10), and the
  collectives each rank's executor issued (recorded at issue) have one order per group; the same
  log with one rank's publishes swapped fails the check.
"""
from __future__ import annotations

import random
from typing import Mapping, Sequence

import pytest
import torch

from dist_utils import run_ranks
from models import make_batches, make_model, muon_predicate
from stateful_harness import HP, max_rel_err, reference_train

STEPS, BATCH = 3, 8  # BATCH: one row per rank of the 8


def group_sequence_mismatches(log: Mapping[int, Sequence[tuple]]) -> list[str]:
    """``log``: ``{rank: [(group ranks, op id), ...] in issue order}``. Per process group (its
    ranks), every member must have issued the same op ids in the same order; returns what differs
    (empty: ordered)."""
    per: dict[tuple, dict[int, list]] = {}
    for rank, entries in log.items():
        for group, op_id in entries:
            per.setdefault(tuple(group), {}).setdefault(rank, []).append(op_id)
    bad = []
    for group, seqs in per.items():
        members = [m for m in group if m in log]
        ref = seqs.get(members[0], [])
        for m in members[1:]:
            if seqs.get(m, []) != ref:
                first = next((i for i, (a, b) in enumerate(zip(ref, seqs.get(m, []))) if a != b),
                             min(len(ref), len(seqs.get(m, []))))
                bad.append(f"group {list(group)}: rank {m} differs from rank {members[0]} at "
                           f"position {first}")
    return bad


# ------------------------------------------------------------------ pure (default tier)
def _program(G: int, R: int, seed: int = 0):
    from dmuon.functional.program import step_program
    rng = random.Random(seed)
    owners, shapes = {}, {}
    for layer in range(3):
        for proj in ("q", "k", "up", "down"):
            n = f"layers.{layer}.{proj}_proj.weight"
            owners[n], shapes[n] = (rng.randrange(G), rng.randrange(R)), (8, 16)
    return step_program(owners, shapes, {n: "torch.float64" for n in owners}, shard_size=G,
                        replicate_size=R)


def _log_of(orders, G: int, R: int) -> dict:
    from dmuon.functional.order_check import op_group
    return {r: [(op_group(op, G, R, r), op.id) for op in ops] for r, ops in orders.items()}


def test_two_d_replicate_and_tp_orders_are_the_same_on_every_rank_of_every_group():
    from dmuon.functional.order_check import DeadlockError, check_orders, rank_orders
    from dmuon.functional.tp_plan import tp_step_schedule

    G, R = 2, 4  # replicate 2 x 2, flattened row-major: one column of 4 ranks per shard index
    prog = _program(G, R)
    sched = prog.step_schedule()
    publishes = [op.id for op in prog.publish_all()]
    assert len(publishes) >= 2 and {op.axis for op in prog.publish_all()} == {"replicate"}
    orders = rank_orders(sched)
    assert group_sequence_mismatches(_log_of(orders, G, R)) == []
    assert check_orders(orders, G, R) > 0
    # TP over (dp 8, tp 2): each TP pair gathers / scatters its matrices in one order
    groups = [[2 * k, 2 * k + 1] for k in range(8)]
    tp = tp_step_schedule(groups, [{f"m{k}.{j}": (8, 8) for j in range(3)} for k in range(8)],
                          {f"m{k}.{j}": "torch.float64" for k in range(8) for j in range(3)}, 16)
    tp_orders = rank_orders(tp)
    assert group_sequence_mismatches(_log_of(tp_orders, tp.shard_size, 1)) == []
    check_orders(tp_orders, tp.shard_size, 1)
    # a rank that publishes in its own order (here: rank 5 reverses its publishes) is caught
    bad = {r: list(ops) for r, ops in orders.items()}
    pub = [op for op in bad[5] if op.id.startswith("publish/")]
    assert len(pub) >= 2, "rank 5 must take part in two publishes for the perturbation to bite"
    rest = [op for op in bad[5] if not op.id.startswith("publish/")]
    bad[5] = rest + list(reversed(pub))
    assert group_sequence_mismatches(_log_of(bad, G, R))
    with pytest.raises(DeadlockError, match="rank 5"):
        check_orders(bad, G, R)
    # the same on TP's lane: rank 3 scatters before it gathers another matrix
    bad_tp = {r: list(ops) for r, ops in tp_orders.items()}
    bad_tp[3] = list(reversed(bad_tp[3]))
    assert group_sequence_mismatches(_log_of(bad_tp, tp.shard_size, 1))
    with pytest.raises(DeadlockError):
        check_orders(bad_tp, tp.shard_size, 1)


# ------------------------------------------------------------------ 8 gloo ranks (slow)
def _record_issues(log: list):
    """Record, at issue time, every collective this rank's executors start."""
    from dmuon.stateful.runtime.executor import Executor
    orig = Executor._issue_cpu

    def issue(self, rec):
        if rec.view is not None:
            log.append((tuple(self.groups.op_ranks(rec.op)), rec.op.id))
        return orig(self, rec)
    Executor._issue_cpu = issue
    return orig


def _train_mesh(rank: int, world: int, kind: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from test_tensor_parallel import apply_tp

    torch.manual_seed(0)
    model = make_model()
    if kind == "rep2d":  # replicate 2 x 2 (a 2-D replicate mesh) x shard 2
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("ra", "rb", "shard"))
        mesh["ra", "rb"]._flatten("replicate")
        dp = mesh["replicate", "shard"]
        dmuon.dedicate_params(model, mesh["shard"], muon_predicate,
                              replicate_mesh=mesh["ra", "rb"])
    else:  # replicate 2 x shard 2 x tp 2
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dp = mesh["replicate", "shard"]
        apply_tp(model, mesh["tp"])
        dmuon.dedicate_params(model, dp, muon_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                     weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                     ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"], adamw_betas=HP["adamw_betas"],
                     adamw_eps=HP["adamw_eps"], adamw_weight_decay=HP["adamw_weight_decay"],
                     replicate_async=False)
    r, s = dp.get_coordinate()
    log: list = []
    orig = _record_issues(log)
    try:
        for ids in make_batches(STEPS, BATCH):
            opt.zero_grad()
            model(ids.chunk(dp.size())[r * dp.size(1) + s]).backward()
            opt.step()
    finally:
        from dmuon.stateful.runtime.executor import Executor
        Executor._issue_cpu = orig
    return {"sd": dmuon.get_model_state_dict(model, cpu_offload=True), "log": log,
            "R": opt.dedicated_state.R}


def _both(rank: int, world: int) -> dict:
    return {kind: _train_mesh(rank, world, kind) for kind in ("rep2d", "tp")}


@pytest.mark.slow  # 8 ranks, two meshes: ~1-2 minutes on the 2-core machine
def test_hsdp_2d_replicate_and_tp_equal_one_process_with_one_order_per_group():
    ref = reference_train(make_model(), make_batches(STEPS, BATCH), {})
    results = run_ranks(_both, 8, timeout=300)
    for kind in ("rep2d", "tp"):
        for rank, res in enumerate(results):
            err, where = max_rel_err(res[kind]["sd"], ref["sd"])
            assert err <= 1e-10, (kind, rank, err, where)
        log = {rank: res[kind]["log"] for rank, res in enumerate(results)}
        assert group_sequence_mismatches(log) == [], kind
        pubs = [e for e in log[0] if e[1].startswith("publish/")]
        assert len(pubs) >= 2 * STEPS, (kind, len(pubs))
        # the check bites: rank 0 issuing two publishes of its column the other way round
        i, j = [k for k, e in enumerate(log[0]) if e[1].startswith("publish/")][:2]
        bad = dict(log)
        bad[0] = list(log[0])
        bad[0][i], bad[0][j] = bad[0][j], bad[0][i]
        assert group_sequence_mismatches(bad), kind
    assert results[0]["rep2d"]["R"] == 4  # the 2-D replicate mesh: one column of 4 replicas
    # every axis was recorded: rank 0's shard group (0, 2), replicate column (0, 4), TP pair (0, 1)
    groups = {g for g, _ in results[0]["tp"]["log"]}
    assert {(0, 2), (0, 4), (0, 1)} <= groups, groups
