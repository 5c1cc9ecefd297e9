"""Newton–Schulz of one matrix split over k ranks: exact against single-device NS (fp64), its flop
and byte accounting, the explicit-group ops in schedules and the simulator, and a multi-process
gloo run driven from the split schedule."""
import dataclasses

import pytest
import torch

from dmuon.functional.buckets import BucketKey
from dmuon.newton_schulz.coefficients import ns_coefficient_table
from dmuon.newton_schulz.iteration import newton_schulz
from dmuon.newton_schulz.cost import ns_cost
from dmuon.functional.schedule import AllGather, AllReduce, Broadcast, Schedule, schedule_traffic
from dmuon.functional.simulate import simulate
from dmuon.functional.split_ns import (simulate_split_ns, split_layout, split_ns_program,
                                       split_ns_rank, split_ns_schedule, split_piece_flops,
                                       split_piece_segments)
from dist_utils import run_ranks

TABLE = ns_coefficient_table("polar_express", 5)
CASES = [(24, 80, 3), (16, 40, 4), (30, 30, 2), (7, 50, 5), (8, 9, 1), (33, 70, 8)]
VARIANTS = [("direct", None), ("gram", 1), ("gram", 2), ("gram", 3), ("gram", None)]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("m,n,k", CASES)
def test_split_equals_single_device_fp64(m, n, k):
    torch.manual_seed(m * 100 + n + k)
    x = torch.randn(m, n, dtype=torch.float64)
    layout = split_layout(m, n, k)
    direct = newton_schulz(x, variant="direct", dtype=torch.float64)
    for variant, restart in VARIANTS:
        y = simulate_split_ns(x, layout, TABLE, variant=variant, gram_restart=restart)
        same = newton_schulz(x, variant=variant, dtype=torch.float64, gram_restart=restart)
        assert _rel(y, same) <= 1e-12 and _rel(y, direct) <= 1e-12, (variant, restart)


def test_tall_param_is_split_along_its_rows():
    torch.manual_seed(1)
    w = torch.randn(90, 20, dtype=torch.float64)              # tall: wide orientation is w^T
    layout = split_layout(*w.shape, 3)
    assert (layout.m, layout.n) == (20, 90)
    y = simulate_split_ns(w.mT, layout, TABLE, variant="gram", gram_restart=2).mT
    assert _rel(y, newton_schulz(w, dtype=torch.float64)) <= 1e-12


@pytest.mark.parametrize("variant,restart", VARIANTS)
def test_flops_and_segments_sum_to_single_device(variant, restart):
    for m, n, k in CASES + [(8192, 28672, 8), (4096, 4096, 3)]:
        layout = split_layout(m, n, k)
        pieces = split_piece_flops(layout, 5, variant, restart)
        assert sum(pieces) == ns_cost(m, n, 5, variant=variant, gram_restart=restart).flops
        program = split_ns_program(layout.m, 5, variant, restart)
        for i in range(k):
            segs = split_piece_segments(layout, i, 5, variant, restart)
            assert len(segs) == len(program) + 1 and sum(segs) == pieces[i]
    # two gathers per Gram iteration (one in a one-iteration segment), one Gram sum per segment
    prog = split_ns_program(64, 5, "gram", 3)
    assert [c.kind for c in prog].count("all_reduce") == 1 + 2
    assert [c.kind for c in prog].count("all_gather") == 10


def test_schedule_bytes_and_group_ops():
    G, R = 4, 2
    layout = split_layout(24, 80, 3)
    members = (1, 6, 2)
    sched = split_ns_schedule("w", layout, members, G, R, steps=5, variant="gram", gram_restart=2,
                              dtype=torch.float32, acc_dtype=torch.float64)
    program = split_ns_program(24, 5, "gram", 2)
    assert len(sched) == len(program)
    assert all(op.lane == "split" and op.members == members for op in sched)
    tr = schedule_traffic(sched)
    k = 3
    for op, c in zip(sched, program):
        if isinstance(op, AllReduce):
            assert op.dtype == "torch.float64" and op.numel == c.numel
        else:
            assert isinstance(op, AllGather) and sum(p[1] for p in op.parts) == 24 * 24
    ar = sum(op.nbytes for op in sched if isinstance(op, AllReduce))
    ag = sum(op.nbytes for op in sched if isinstance(op, AllGather))
    assert tr.total_sent(["split"]) == tr.total_received(["split"]) == 2 * (k - 1) * ar + (k - 1) * ag
    assert all(tr.sent["split"][r] == 0 for r in range(G * R) if r not in members)
    # star accounting of an all-reduce: the first member reduces and re-broadcasts
    one = Schedule((dataclasses.replace(sched.ops[1], waits=()),), G, R)
    t1 = schedule_traffic(one)
    p = sched.ops[1].nbytes
    assert t1.sent["split"][1] == 2 * p and [t1.sent["split"][r] for r in (6, 2)] == [p, p]
    assert t1.for_rank(1)["split"]["collectives"] == 1 and "split" in t1.lanes
    assert "all_reduce[sum]" in sched.dump() and "ranks [1, 6, 2]" in sched.dump()


def test_simulator_group_ops_touch_members_only():
    key = BucketKey("b", 0, "torch.float64")
    ops = (AllReduce(id="ar", axis="group", at=None, bucket=key, offset=1, numel=2, dtype=key.dtype,
                     lane="split", members=(0, 2), op="avg"),
           AllGather(id="ag", axis="group", at=None, bucket=key, offset=0, numel=4, dtype=key.dtype,
                     lane="split", members=(2, 3), parts=((0, 1), (1, 3))),
           Broadcast(id="bc", axis="group", at=None, bucket=key, offset=3, numel=1, dtype=key.dtype,
                     lane="split", members=(1, 3), src=1))
    bufs = [{key: torch.arange(4, dtype=torch.float64) + 10 * r} for r in range(4)]
    out = simulate(Schedule(ops, 2, 2), bufs)
    assert out[0][key].tolist() == [0, 11, 12, 3]                  # mean of ranks 0 and 2 on [1, 3)
    assert out[2][key].tolist() == [20, 31, 32, 33]                # element 0 own, 1..3 from rank 3
    assert out[3][key].tolist() == [20, 31, 32, 33]
    assert out[1][key].tolist() == [10, 11, 12, 33]                # rank 3's element 3
    assert bufs[0][key].tolist() == [0, 1, 2, 3]                   # inputs untouched


def test_errors():
    key = BucketKey("b", 0, "torch.float32")
    base = dict(id="x", axis="group", at=None, bucket=key, offset=0, numel=4, dtype=key.dtype,
                lane="split")
    with pytest.raises(ValueError, match="split factor"):
        split_layout(4, 10, 5)
    with pytest.raises(ValueError, match="distinct"):
        AllReduce(members=(0, 0), **base)
    with pytest.raises(ValueError, match="lane"):
        AllReduce(members=(0, 1), **{**base, "lane": "reduce"})
    with pytest.raises(ValueError, match="overlap"):
        AllGather(members=(0, 1), parts=((0, 3), (2, 2)), **base)
    with pytest.raises(ValueError, match="outside"):
        Schedule((AllReduce(members=(0, 9), **base),), 2, 2)
    with pytest.raises(ValueError, match="wide orientation"):
        next(split_ns_rank(torch.zeros(5, 5), split_layout(4, 10, 2), 0, TABLE, variant="gram"))
    with pytest.raises(ValueError, match="members"):
        split_ns_schedule("w", split_layout(4, 10, 2), (0,), 2, 1)


def _gloo_worker(rank, world, cases):
    """Each case: (m, n, members, variant, restart). Run the split NS on its members, each
    collective of the schedule executed with torch.distributed on the members' group."""
    import torch.distributed as dist
    out = []
    for m, n, members, variant, restart in cases:
        group = dist.new_group(list(members))                   # every rank creates every group
        torch.manual_seed(m * 7 + n)
        x = torch.randn(m, n, dtype=torch.float64)
        if rank not in members:
            out.append(None)
            continue
        i = members.index(rank)
        layout = split_layout(m, n, len(members))
        sched = split_ns_schedule("w", layout, members, world, 1, steps=len(TABLE), variant=variant,
                                  gram_restart=restart, dtype=torch.float64,
                                  acc_dtype=torch.float64)
        c0, c1 = layout.col_ranges[i]
        gen = split_ns_rank(x[:, c0:c1], layout, i, TABLE, variant=variant, gram_restart=restart)
        buf, sent = next(gen), 0
        for op in sched.ops:
            assert buf.numel() == op.numel
            if isinstance(op, AllReduce):
                dist.all_reduce(buf, group=group)
            else:
                for j, (off, cnt) in enumerate(op.parts):
                    dist.broadcast(buf[off:off + cnt], src=op.members[j], group=group)
                    sent += cnt * buf.element_size() * (len(members) - 1) if j == i else 0
            try:
                buf = gen.send(None)
            except StopIteration as stop:
                block = stop.value
        want = newton_schulz(x, dtype=torch.float64, variant=variant, gram_restart=restart)
        ag = schedule_traffic(Schedule(tuple(dataclasses.replace(o, waits=()) for o in sched.ops
                                             if isinstance(o, AllGather)), world, 1))
        out.append({"err": _rel(block, want[:, c0:c1]), "sent": sent, "want_sent": ag.sent["split"][rank]})
    return out


def test_split_ns_on_gloo_ranks_driven_by_schedule():
    cases = [(24, 80, (0, 1, 2), "gram", 2), (20, 31, (2, 0), "gram", 3), (16, 40, (1, 2), "direct", None)]
    results = run_ranks(_gloo_worker, 3, cases)
    for c, (_, _, members, _, _) in enumerate(cases):
        for rank in range(3):
            r = results[rank][c]
            if rank not in members:
                assert r is None
                continue
            assert r["err"] <= 1e-12, (c, rank, r)
            assert r["sent"] == r["want_sent"]
