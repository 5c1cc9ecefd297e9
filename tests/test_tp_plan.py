"""Pure TP planning (:mod:`dmuon.functional.tp_plan`): NS roots balance the TP group, the bytes
per step follow the gather / scatter rule."""
from __future__ import annotations

import pytest

from dmuon.functional.tp_plan import ns_cost, tp_roots, tp_step_bytes


def test_roots_balance_and_are_deterministic():
    shapes = {"a": (64, 64), "b": (64, 64), "c": (32, 32), "d": (32, 32), "e": (16, 16)}
    roots = tp_roots(shapes, 2)
    assert roots == tp_roots(dict(shapes), 2)
    load = [sum(ns_cost(shapes[n]) for n in shapes if roots[n] == t) for t in range(2)]
    assert max(load) - min(load) <= ns_cost((16, 16))
    assert roots["a"] != roots["b"]
    assert tp_roots(shapes, 1) == {n: 0 for n in shapes}
    with pytest.raises(ValueError):
        tp_roots(shapes, 0)


def test_bytes_gather_to_root_scatter_back():
    shapes = {"w": (8, 6)}  # P = 48 elements, 4 bytes each
    f32 = {"w": "torch.float32"}
    got = tp_step_bytes(shapes, {"w": 1}, 2, f32)
    assert got == [24 * 4, 24 * 4]  # root gets the other half of x, the other its half of U
    got = tp_step_bytes(shapes, {"w": 0}, 4, f32)
    assert got == [3 * 12 * 4, 12 * 4, 12 * 4, 12 * 4]
    # the busiest index receives (T-1)/T P per matrix it roots
    assert max(got) == (4 - 1) * 48 * 4 // 4


def test_schedule_simulates_gather_ns_scatter():
    """The TP schedule on the simulator: the root holds the slices one after the other (the
    assembled NS input), and after the root's NS the scatter hands each member its slice."""
    import torch

    from dmuon.functional.simulate import simulate
    from dmuon.functional.tp_plan import tp_step_schedule
    shapes = {"a": (4, 6), "b": (8, 2)}
    groups = [[0, 2], [1, 3]]  # two TP groups of a (dp 2, tp 2) world
    sched = tp_step_schedule(groups, [shapes, shapes], {n: "torch.float64" for n in shapes}, 4)
    assert {op.lane for op in sched} == {"tp"}
    key = {(k, n): next(op.bucket for op in sched if op.bucket.group == f"tp:{n}"
                        and op.bucket.column == k) for k in range(2) for n in shapes}
    g = torch.Generator().manual_seed(0)
    full = {(k, n): torch.randn(24 if n == "a" else 16, generator=g, dtype=torch.float64)
            for k in range(2) for n in shapes}
    bufs = [dict() for _ in range(4)]
    for k, members in enumerate(groups):
        for n in shapes:
            half = full[k, n].numel() // 2
            for j, rank in enumerate(members):  # each member holds its slice in its range
                b = torch.full_like(full[k, n], float("nan"))
                b[j * half:(j + 1) * half] = full[k, n][j * half:(j + 1) * half]
                bufs[rank][key[k, n]] = b
    gather_only = type(sched)(ops=tuple(op for op in sched if "gather" in op.id),
                              shard_size=4, replicate_size=1)
    got = simulate(gather_only, bufs)
    for op in gather_only:
        k, n = int(op.bucket.column), op.bucket.group[3:]
        assert torch.equal(got[op.members[op.dst]][op.bucket], full[k, n])
    # the root's "NS": negate; the scatter gives each member its slice of it
    for op in gather_only:
        got[op.members[op.dst]][op.bucket].neg_()
    import dataclasses
    scatter_only = type(sched)(ops=tuple(dataclasses.replace(op, waits=()) for op in sched
                                         if "scatter" in op.id), shard_size=4, replicate_size=1)
    out = simulate(scatter_only, got)
    for op in scatter_only:
        k, n = int(op.bucket.column), op.bucket.group[3:]
        for j, rank in enumerate(op.members):
            o, m = op.parts[j]
            assert torch.equal(out[rank][op.bucket][o:o + m], -full[k, n][o:o + m])
    # bytes: per matrix, (T-1)/T P into the root and P/T into the other member
    tr = sched.traffic()
    assert sum(tr.rank_received(r) for r in range(4)) == 2 * 2 * (24 + 16) * 8 // 2


def test_grid_tp_schedule_one_tp_group_per_dp_coordinate():
    """Over one dp grid per TP index, each (s, r)'s TP group runs the NS of the matrices owned
    at (s, r): the same schedule as tp_step_schedule given those groups."""
    from dmuon.functional.tp_plan import grid_tp_schedule, tp_step_schedule
    grids = [((0, 2),), ((1, 3),)]  # T=2, R=1, G=2: TP groups [0, 1] at s=0 and [2, 3] at s=1
    shapes = {"a": (4, 6), "b": (8, 2), "c": (2, 2)}
    owners = {"a": (1, 0), "b": (0, 0), "c": (1, 0)}
    dtypes = {n: "torch.float32" for n in shapes}
    got = grid_tp_schedule(grids, owners, shapes, dtypes, 4)
    assert got == tp_step_schedule([[0, 1], [2, 3]], [{"b": (8, 2)}, {"a": (4, 6), "c": (2, 2)}],
                                   dtypes, world_size=4)


def test_grad_agreement_finds_missing_slices_and_diverging_replicated_gradients():
    import math

    import torch

    from dmuon.functional.tp_step import grad_agreement_vector, grad_agreement_verdict
    sliced, rep = ["s0", "s1"], ["r0", "r1", "r2"]
    one = torch.ones(2, 2, dtype=torch.float64)
    a = grad_agreement_vector({"s0": one, "r0": one, "r1": one, "r2": None}, sliced, rep)
    b = grad_agreement_vector({"r0": one, "r1": 2 * one, "r2": None}, sliced, rep)
    assert a[:2] == [1.0, 0.0] and a[2:5] == [4.0, 4.0, -1.0]
    got = [max(x, y) for x, y in zip(a, b)]   # the MAX all-reduce of two members
    assert grad_agreement_verdict(got, sliced, rep) == (["s0"], ["r1"])
    nan = grad_agreement_vector({"r0": one * math.nan, "r1": one, "r2": None}, sliced, rep)
    assert grad_agreement_verdict([max(x, y) for x, y in zip(a, nan)], sliced, rep)[1] == ["r0"]
    assert grad_agreement_verdict(a, sliced, rep) == (["s0"], [])


def test_tp_slicing_problem_names_what_dmuon_cannot_dedicate():
    from dmuon.functional.matrix_view import Sliced
    from dmuon.functional.tp_plan import TPLayout, tp_slicing_problem

    class Shard:  # the duck type of a DTensor placement
        def __init__(self, dim, shard=True):
            self.dim, self._shard = dim, shard

        def is_shard(self):
            return self._shard

    ok = dict(contiguous=True, tied=False)
    assert tp_slicing_problem((8, 6), (Shard(0),), 1, 2, **ok) is None
    assert tp_slicing_problem((8, 6), (Shard(-1),), 1, 3, **ok) is None   # dim -1: columns
    assert "1-D TP mesh" in tp_slicing_problem((8, 6), (Shard(0), Shard(1)), 2, 4, **ok)
    assert "2-D matrix" in tp_slicing_problem((8, 6, 2), (Shard(0),), 1, 2, **ok)
    assert "2-D matrix" in tp_slicing_problem((8, 6), (Shard(0, False),), 1, 2, **ok)
    assert "Shard interleaves" in tp_slicing_problem((8, 6), (Shard(0),), 1, 2, contiguous=False,
                                                     tied=False)
    assert "dim 1 (6) is not divisible by the TP degree 4" in tp_slicing_problem(
        (8, 6), (Shard(1),), 1, 4, **ok)
    assert "tied" in tp_slicing_problem((8, 6), (Shard(0),), 1, 2, contiguous=True, tied=True)
    assert TPLayout(None, (), (8, 6), (6, 1), 1, 2).view() == Sliced(1, 2)
