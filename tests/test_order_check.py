"""The simulator's two checks of a plan before any process starts: per-rank collective orders that
would deadlock are found (a planted order: one rank reducing in its gradient-arrival order), the
step program's fixed orders pass in every mode (Z2 / Z3, HSDP, DDP, a root group, TP's lane); and
the per-rank memory model catches a planted over-budget plan."""
from __future__ import annotations

import random

import pytest

from dmuon.functional.buckets import hook_groups
from dmuon.functional.memory_model import MemoryBudgetError, check_memory, rank_memory
from dmuon.functional.order_check import DeadlockError, check_orders, rank_orders
from dmuon.functional.program import ROOT_GROUP, step_program
from dmuon.functional.schedule import Schedule, op_members
from dmuon.functional.tp_plan import tp_step_schedule


def _program(G, R, *, z3=True, seed=0, root=True):
    rng = random.Random(seed)
    owners, shapes = {}, {}
    for layer in range(4):
        for proj in ("q", "k", "up", "down"):
            n = f"layers.{layer}.{proj}_proj.weight"
            owners[n] = (rng.randrange(G), rng.randrange(R))
            shapes[n] = (8 + layer, 16)
    if root:
        owners["in_proj.weight"], shapes["in_proj.weight"] = (0, 0), (16, 16)
    groups = hook_groups(list(owners), lambda n: ROOT_GROUP if n == "in_proj.weight" else None,
                         order=[ROOT_GROUP] + [f"layers.{i}" for i in range(4)])
    return step_program(owners, shapes, {n: "torch.float32" for n in owners}, shard_size=G,
                        replicate_size=R, groups=groups, reshard_after_forward=z3)


@pytest.mark.parametrize("G,R,z3", [(4, 1, True), (4, 1, False), (2, 2, True), (1, 4, False),
                                    (3, 2, True)])
def test_program_orders_never_deadlock(G, R, z3):
    prog = _program(G, R, z3=z3)
    sched = prog.step_schedule()
    n = check_orders(rank_orders(sched), G, R)
    assert n == sum(len(op_members(op, G, R)) for op in sched)  # every group's collectives ran
    # one blocking sequence per rank works too (the program's order is the same on every rank)
    assert check_orders(rank_orders(sched), G, R, lanes_async=False) == n


def test_a_rank_reducing_in_its_own_arrival_order_deadlocks():
    G, R = 4, 1
    prog = _program(G, R, root=False)
    reduces = [op for k in prog.reduce_order for op in prog.groups[k].reduce]
    orders = rank_orders(Schedule(tuple(reduces), G, R))
    orders[2] = list(reversed(orders[2]))  # rank 2's gradients arrived in another order
    with pytest.raises(DeadlockError, match=r"rank 2 waits in 'reduce/") as e:
        check_orders(orders, G, R)
    assert 2 in e.value.stuck and len(e.value.stuck) == G


def test_lanes_progress_independently_but_a_blocking_rank_deadlocks():
    """Rank 1 issues a backward re-gather before a reduce, rank 0 after: separate lanes (the
    executor's) complete; one blocking sequence per rank would deadlock."""
    prog = _program(2, 1, root=False)
    k0, k1 = prog.reduce_order[:2]
    a, b = prog.groups[k0].reduce.ops[0], prog.groups[k1].unshard.ops[0]
    orders = {0: [a, b], 1: [b, a]}
    assert check_orders(orders, 2, 1) == 2
    with pytest.raises(DeadlockError):
        check_orders(orders, 2, 1, lanes_async=False)


def test_tp_lane_orders():
    sched = tp_step_schedule([[0, 2], [1, 3]], [{"a": (8, 8), "b": (4, 8)}, {"c": (8, 4)}],
                             {"a": "torch.float32", "b": "torch.float32", "c": "torch.float32"},
                             world_size=4)
    orders = rank_orders(sched)
    assert check_orders(orders, 4, 1) == len(sched)
    orders[2] = orders[2][2:] + orders[2][:2]  # rank 2 gathers "b" before "a"
    with pytest.raises(DeadlockError, match="rank 0 waits in"):
        check_orders(orders, 4, 1)


def test_memory_model_phases_and_a_planted_over_budget_plan():
    z3, z2 = _program(4, 1, z3=True), _program(4, 1, z3=False)
    for s in range(4):
        m3, m2 = rank_memory(z3, (s, 0)), rank_memory(z2, (s, 0))
        assert m3.masters == m2.masters and m3.state == m2.state
        assert m3.phases["between_steps"] == m3.masters + m3.state
        # Z2 keeps every group gathered through the forward: never less than Z3
        assert m2.phases["forward"] >= m3.phases["forward"] > m3.phases["between_steps"]
    # more ranks, less per rank
    wide = _program(8, 1, z3=True)
    assert max(rank_memory(wide, (s, 0)).peak for s in range(8)) < \
        max(rank_memory(z3, (s, 0)).peak for s in range(4))
    peak = max(m.peak for m in check_memory(z3, 10 ** 9).values())
    with pytest.raises(MemoryBudgetError, match=r"rank \(\d, 0\) in (forward|backward|step)"):
        check_memory(z2, peak)  # the Z2 plan does not fit what Z3 needs
