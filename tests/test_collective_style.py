"""One collective per bucket, or the per-owner ones as one group call, without processes: the ops'
bytes (padding counted), the simulator (a per-bucket or grouped step equals the per-owner step
bitwise, Z3 re-gathers and HSDP included), the per-rank orders and memory, and ``"auto"``'s choice
(per bucket where latency dominates, grouped where padding does, per owner for one bucket)."""
from __future__ import annotations

import pytest
import torch

from dmuon.functional import muon as fmuon
from dmuon.functional.buckets import BucketKey, bucket_layout, hook_groups
from dmuon.functional.collectives import (LinkCost, check_choice, choose_style, coalesced_units,
                                          mode_collectives, unit_seconds, wire_bytes)
from dmuon.functional.memory_model import rank_memory
from dmuon.functional.order_check import check_orders, rank_orders
from dmuon.functional.program import step_program
from dmuon.functional.schedule import (Broadcast, Reduce, Schedule, ShardAllGather,
                                       ShardReduceScatter, op_bytes, reduce_schedule,
                                       unshard_schedule)
from dmuon.functional.simulate import simulate, zeros_like_layout
from dmuon.functional.step import world_step

F64 = "torch.float64"


def _owners(G: int, R: int, layers: int = 3) -> tuple[dict, dict]:
    """Uneven buckets: matrix ``i`` of a layer on column ``i % G``, some columns empty."""
    owners, shapes = {}, {}
    for layer in range(layers):
        for i, (m, n) in enumerate([(6, 4), (3, 5), (8, 8), (2, 7)][: G + layer % 2]):
            name = f"layers.{layer}.p{i}.weight"
            owners[name] = ((i + layer) % G, (i * 7 + layer) % R)
            shapes[name] = (m, n)
    return owners, shapes


def _program(G, R, style, z3=True):
    owners, shapes = _owners(G, R)
    return step_program(owners, shapes, {n: F64 for n in owners}, shard_size=G, replicate_size=R,
                        reshard_after_forward=z3, collectives=style)


def random_trees(program, seed: int, world: int) -> tuple[dict, dict, list]:
    """``(shapes, params, per-rank trees)`` of ``program``'s matrices, fp64 normal draws."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {e.name: e.shape for b in program.unshard_layout.buckets for e in b.entries}
    params = {n: torch.randn(*s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    return shapes, params, [{n: torch.randn(*s, generator=gen, dtype=torch.float64)
                             for n, s in shapes.items()} for _ in range(world)]


def test_op_bytes_count_the_padding_and_traffic_is_their_sum():
    G = 4
    owners = {"layers.0.a": (0, 0), "layers.0.b": (2, 0)}
    shapes = {"layers.0.a": (3, 4), "layers.0.b": (2, 3)}
    lay = bucket_layout(owners, shapes, {n: F64 for n in owners}, hook_groups(list(owners)), G)
    (ag,) = unshard_schedule(lay, "layers.0", style="per_bucket")
    (rs,) = reduce_schedule(lay, "layers.0", style="per_bucket")
    assert isinstance(ag, ShardAllGather) and isinstance(rs, ShardReduceScatter)
    assert ag.sizes == (12, 0, 6, 0) and ag.numel == 12 and ag.padding == 4 * 12 - 18
    for op in (ag, rs):
        for pos in range(G):  # every member: its padded part to / from each other member
            assert op_bytes(op, pos, G) == (3 * 12 * 8, 3 * 12 * 8)
        assert wire_bytes(op, G) == 3 * 12 * 8
    per_owner = unshard_schedule(lay, "layers.0")
    assert [type(o) for o in per_owner] == [Broadcast, Broadcast]
    assert wire_bytes(per_owner.ops[0], G) == 12 * 8
    tr = unshard_schedule(lay, "layers.0", style="per_bucket").traffic()
    assert tr.total_sent(["unshard"]) == G * 3 * 12 * 8 > per_owner.traffic().total_sent(["unshard"])
    with pytest.raises(ValueError, match="per_owner"):
        unshard_schedule(lay, "layers.0", style="ring")
    with pytest.raises(ValueError, match="part 1"):
        ShardAllGather(id="x", axis="shard", at=None, bucket=BucketKey("layers.0", -1, F64),
                       offset=0, numel=12, dtype=F64, lane="unshard",
                       keys=(ag.keys[0], ag.keys[2], None, None), sizes=(12, 6, 0, 0))


@pytest.mark.parametrize("G,R,z3", [(3, 1, True), (2, 2, True), (3, 2, False), (1, 2, True)])
def test_per_bucket_step_equals_per_owner_bitwise_in_the_simulator(G, R, z3):
    po, pb = _program(G, R, "per_owner", z3), _program(G, R, "per_bucket", z3)
    assert {g.collectives for g in pb.groups.values()} == {"per_bucket"}
    # Z3 re-gathers use the group's style
    regather = [op for op in pb.step_schedule() if op.id.startswith("regather:")]
    assert bool(regather) == (z3 and G > 0) and all(isinstance(op, ShardAllGather)
                                                    for op in regather)
    W = G * R
    gen = torch.Generator().manual_seed(0)
    shapes = {e.name: e.shape for b in po.unshard_layout.buckets for e in b.entries}
    params = {n: torch.randn(*s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    grads = [{n: torch.randn(*s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
             for _ in range(W)]
    col = lambda i: {n: params[n].clone() for n in shapes if po.owners[n][0] == i % G}  # noqa
    hp = fmuon.MuonHParams(lr=0.02, ns_dtype=torch.float64)
    a, _, _ = world_step([col(i) for i in range(W)], grads, po, None, hp)
    b, _, sched = world_step([col(i) for i in range(W)], grads, pb, None, hp)
    for i in range(W):
        assert a[i].keys() == b[i].keys()
        for n in a[i]:
            assert torch.equal(a[i][n], b[i][n]), (i, n)
    # the forward gather: every rank ends with every column's bucket
    bufs = zeros_like_layout(pb.unshard_layout)
    for i in range(W):
        for bk in pb.unshard_layout.buckets:
            if bk.key.column == i % G:
                bufs[i][bk.key].fill_(float(bk.key.column + 1))
    fwd = simulate(pb.groups["layers.0"].unshard + pb.groups["layers.1"].unshard, bufs)
    for i in range(W):
        for bk in pb.unshard_layout.buckets_of("layers.0") + pb.unshard_layout.buckets_of("layers.1"):
            assert torch.all(fwd[i][bk.key] == bk.key.column + 1)
    # fewer collectives, the same per-rank order on every rank: no deadlock
    assert len(pb.step_schedule()) < len(po.step_schedule()) or G == 1
    assert check_orders(rank_orders(pb.step_schedule()), G, R) > 0 or G * R == 1


def test_memory_model_adds_the_staging():
    po, pb = _program(3, 1, "per_owner"), _program(3, 1, "per_bucket")
    m_o, m_b = rank_memory(po, (0, 0)), rank_memory(pb, (0, 0))
    assert m_b.phases["between_steps"] == m_o.phases["between_steps"]
    assert m_b.phases["forward"] > m_o.phases["forward"]
    assert m_b.phases["backward"] > m_o.phases["backward"]


def _uniform(G: int, per_group: int, numel: int) -> tuple[dict, dict]:
    owners = {f"layers.0.m{i}": (i % G, 0) for i in range(per_group)}
    return owners, {n: (numel // 8, 8) for n in owners}


def test_auto_picks_per_bucket_when_latency_dominates_and_per_owner_when_padding_does():
    # 64 small matrices, one per column: 64 broadcasts of 4 KiB against one all-gather
    owners, shapes = _uniform(64, 64, 512)
    prog = step_program(owners, shapes, {n: "torch.float32" for n in owners}, shard_size=64,
                        collectives="auto")
    g = prog.groups["layers.0"]
    assert g.collectives == "per_bucket" and g.collectives_reason.startswith("auto: per_bucket")
    assert len(g.unshard) == 1 and len(g.reduce) == 1
    # 2 large matrices on a 64-rank group: the all-gather would move 64 padded parts; the two
    # per-owner broadcasts / reduces as one group call each move the per-owner bytes with one
    # latency (before the grouped style: per owner)
    owners, shapes = _uniform(64, 2, 1 << 20)
    prog = step_program(owners, shapes, {n: "torch.float32" for n in owners}, shard_size=64,
                        collectives="auto")
    g = prog.groups["layers.0"]
    assert g.collectives == "grouped" and "per_owner" in g.collectives_reason
    assert g.collectives_reason.startswith("auto: grouped") and "per_bucket" in g.collectives_reason
    # the same group on a slow-start link with huge bandwidth: latency dominates; one launch per
    # phase either way, and the grouped one moves no padding (before the grouped style: per bucket)
    lay = prog.unshard_layout
    fast = LinkCost(alpha_s=1e-3, alpha_hop_s=0.0, busbw_bytes_per_s=1e15)
    assert choose_style(lay, prog.reduce_layout, "layers.0", "auto", cost=fast).style == "grouped"
    # a cost function (the projector passes its machine model); a tie goes to the earlier style
    # of (per_owner, grouped, per_bucket)
    c = choose_style(lay, prog.reduce_layout, "layers.0", "auto", cost=lambda op, n: 1.0)
    assert c.style == "grouped"
    assert c.collectives == {"per_owner": 4, "per_bucket": 2, "grouped": 2}
    # Z3: the gather counts twice
    c3 = choose_style(lay, prog.reduce_layout, "layers.0", "auto", z3=True, cost=lambda o, n: 1.0)
    assert c3.collectives == {"per_owner": 6, "per_bucket": 3, "grouped": 3}
    # one owner column in the group: nothing to group, per owner
    one = step_program({n: (5, 0) for n in owners}, shapes, {n: "torch.float32" for n in owners},
                       shard_size=64, collectives="auto")
    assert one.groups["layers.0"].collectives == "per_owner"
    # G = 1: nothing moves, per owner
    owners1 = {n: (0, 0) for n in owners}
    p1 = step_program(owners1, shapes, {n: "torch.float32" for n in owners}, shard_size=1,
                      collectives="auto")
    assert p1.groups["layers.0"].collectives == "per_owner"
    # a mapping chooses per group
    pm = step_program(owners, shapes, {n: "torch.float32" for n in owners}, shard_size=64,
                      collectives={"layers.0": "per_bucket"})
    assert pm.groups["layers.0"].collectives == "per_bucket"


def test_the_option_is_checked():
    for good in ("per_owner", "per_bucket", "grouped", "auto"):
        assert check_choice(good) == good
    assert check_choice("grouped", "ddp") == check_choice("grouped", tp=True) == "grouped"
    with pytest.raises(ValueError, match="collectives must be one of"):
        check_choice("bucket")
    with pytest.raises(ValueError, match="data_parallel='ddp' has no shard axis"):
        check_choice("per_bucket", "ddp")
    assert check_choice("auto", "ddp") == "auto"
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        check_choice("per_bucket", tp=True)
    # split NS (split_ns > 1) with TP or DDP: not supported (checked with the agreed local checks)
    for mode in (dict(tp=True), dict(data_parallel="ddp")):
        with pytest.raises(NotImplementedError, match="split Newton–Schulz runs with FSDP2"):
            check_choice("auto", split=True, **mode)
    assert check_choice("auto", split=True) == "auto"
    # the style the program is built with: per owner under TP and DDP mode, else the choice
    assert mode_collectives("grouped", "ddp") == mode_collectives("auto", tp=True) == "per_owner"
    assert mode_collectives("per_bucket") == "per_bucket"
    with pytest.raises(ValueError, match="collectives must be one of"):
        step_program({"a": (0, 0)}, {"a": (2, 2)}, {"a": F64}, shard_size=1, collectives="x")


def test_a_group_of_two_dtypes_gets_one_collective_per_dtype():
    owners = {"layers.0.a": (0, 0), "layers.0.b": (1, 0), "layers.0.c": (1, 0)}
    shapes = {"layers.0.a": (3, 4), "layers.0.b": (2, 3), "layers.0.c": (4, 4)}
    dts = {"layers.0.a": F64, "layers.0.b": "torch.float32", "layers.0.c": F64}
    po = step_program(owners, shapes, dts, shard_size=2)
    pb = step_program(owners, shapes, dts, shard_size=2, collectives="per_bucket")
    un = pb.groups["layers.0"].unshard
    assert [(type(op), op.dtype, op.sizes) for op in un] == [
        (ShardAllGather, F64, (12, 16)), (ShardAllGather, "torch.float32", (0, 6))]
    assert len(po.groups["layers.0"].unshard) == 3
    gen = torch.Generator().manual_seed(1)
    bufs = [{b.key: torch.randn(b.numel, generator=gen).to(getattr(torch, b.key.dtype[6:]))
             for b in pb.reduce_layout.buckets} for _ in range(2)]
    a = simulate(po.groups["layers.0"].reduce, bufs)
    b = simulate(pb.groups["layers.0"].reduce, bufs)
    for i in range(2):
        for bk in pb.reduce_layout.buckets:
            if bk.key.column == i:   # the owner's reduced bucket; elsewhere NaN in both
                assert torch.equal(a[i][bk.key], b[i][bk.key])
            else:
                assert torch.isnan(b[i][bk.key]).all() and torch.isnan(a[i][bk.key]).all()


@pytest.mark.parametrize("G,R,z3", [(3, 1, True), (2, 2, True), (3, 2, False)])
def test_grouped_is_the_per_owner_ops_as_one_group_call_per_phase(G, R, z3):
    """``"grouped"``: the per-owner ops (stage-2 reduces after stage 1), each phase's under one
    ``coalesce`` key (the Z3 re-gather's its own); the same bytes, and in the simulator the
    same step bitwise."""
    po, gr = _program(G, R, "per_owner", z3), _program(G, R, "grouped", z3)
    assert {g.collectives for g in gr.groups.values()} == {"grouped"}
    plain = lambda ops: sorted((op.id, type(op), op.numel, op.root) for op in ops)  # noqa: E731
    for key, g in gr.groups.items():
        p = po.groups[key]
        for phase in ("unshard", "reduce", "publish"):
            assert plain(g.phase(phase)) == plain(p.phase(phase)), (key, phase)
            assert all(not op.coalesce for op in p.phase(phase))
        assert {op.coalesce for op in g.unshard} == {f"unshard/{key}"}
        assert {op.coalesce for op in g.regather} == {f"regather:unshard/{key}"}
        assert {op.coalesce for op in g.publish} <= {f"publish/{key}"}
        lanes = [op.lane for op in g.reduce]
        assert lanes == sorted(lanes, key=("reduce", "replicate").index)  # stage 1 first
        assert {op.coalesce for op in g.reduce} == {f"reduce/{key}"} | (
            {f"reduce2/{key}"} if R > 1 else set())
    assert gr.traffic() == po.traffic()
    W = G * R
    gen = torch.Generator().manual_seed(2)
    shapes = {e.name: e.shape for b in po.unshard_layout.buckets for e in b.entries}
    params = {n: torch.randn(*s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    grads = [{n: torch.randn(*s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
             for _ in range(W)]
    col = lambda i: {n: params[n].clone() for n in shapes if po.owners[n][0] == i % G}  # noqa
    hp = fmuon.MuonHParams(lr=0.02, ns_dtype=torch.float64)
    a, _, _ = world_step([col(i) for i in range(W)], grads, po, None, hp)
    b, _, _ = world_step([col(i) for i in range(W)], grads, gr, None, hp)
    for i in range(W):
        assert a[i].keys() == b[i].keys() and all(torch.equal(a[i][n], b[i][n]) for n in a[i])
    assert check_orders(rank_orders(gr.step_schedule()), G, R) > 0
    assert "group=unshard/layers.0" in gr.groups["layers.0"].unshard.dump()


def test_a_group_call_waits_only_on_ops_before_it_and_runs_on_one_lane():
    key = BucketKey("layers.0", 0, F64)
    kw = dict(axis="shard", at=None, bucket=key, offset=0, numel=4, dtype=F64)
    a = Broadcast(id="a", lane="unshard", src=0, coalesce="g", **kw)
    b = Broadcast(id="b", lane="unshard", src=0, coalesce="g", waits=("a",), **kw)
    with pytest.raises(ValueError, match="wait only on ops before the first of them"):
        Schedule((a, b), 2, 1)
    c = Reduce(id="c", lane="reduce", dst=0, coalesce="g", **kw)
    with pytest.raises(ValueError, match="run on one lane"):
        Schedule((a, c), 2, 1)
    d = Reduce(id="d", lane="reduce", dst=1, coalesce="h", waits=("a",), **kw)
    assert len(Schedule((a, c.__class__(**{**c.__dict__, "coalesce": ""}), d), 2, 1)) == 3


def test_a_group_call_costs_one_latency_plus_the_parts_bytes():
    """The cost model of a grouped launch: one start-up ``alpha`` (and hops) for all the parts,
    their bytes summed on the bus (per owner: one start-up per part; the same bytes)."""
    G = 8
    owners = {f"layers.0.m{i}": (i, 0) for i in range(4)}
    shapes = {n: (256, 256) for n in owners}
    lay = bucket_layout(owners, shapes, {n: "torch.float32" for n in owners},
                        hook_groups(list(owners)), G)
    link = LinkCost()
    po = unshard_schedule(lay, "layers.0")
    gr = unshard_schedule(lay, "layers.0", style="grouped")
    (unit,) = coalesced_units(gr)
    assert [len(u) for u in coalesced_units(po)] == [1, 1, 1, 1]
    per_op = [link.seconds(op, G) for op in po]
    lat = link.alpha_s + G * link.alpha_hop_s
    grouped = unit_seconds(unit, link.seconds, G)
    assert grouped == pytest.approx(lat + 4 * 256 * 256 * 4 / link.busbw_bytes_per_s)
    assert grouped == pytest.approx(sum(per_op) - 3 * lat)
    c = choose_style(lay, lay, "layers.0", "auto", cost=link)
    assert c.seconds["grouped"] == pytest.approx(c.seconds["per_owner"] - 2 * 3 * lat)
    assert c.wire["grouped"] == c.wire["per_owner"] and c.collectives["grouped"] == 2
    # the publish of a grouped HSDP group: one group call per replicate column
    pub = step_program({f"layers.0.m{i}": (i % 2, i // 2) for i in range(4)}, shapes,
                       {n: F64 for n in shapes}, shard_size=2, replicate_size=2,
                       collectives="grouped").groups["layers.0"].publish
    assert sorted(tuple(op.at for op in u) for u in coalesced_units(pub)) == [(0, 0), (1, 1)]


def _hsdp_boundary_program(cost: LinkCost):
    """HSDP G = 8, R = 4, three layers: a large matrix on column 0 (owner replica 1), six 1024 x
    1024 ones on columns 1..6."""
    owners, shapes = {}, {}
    for layer in range(3):
        owners[f"layers.{layer}.big"], shapes[f"layers.{layer}.big"] = (0, 1), (4096, 4096)
        for i in range(1, 7):
            name = f"layers.{layer}.m{i}"
            owners[name], shapes[name] = (i, (i + layer) % 4), (1024, 1024)
    return step_program(owners, shapes, {n: "torch.float32" for n in owners}, shard_size=8,
                        replicate_size=4, reshard_after_forward=False, collectives="auto",
                        cost=cost)


def test_auto_weighs_the_replicate_axis_wait_of_the_steps_first_group():
    """Issue 47: grouped, a group's stage-2 (replicate) reduces wait for the whole stage-1 group
    call and its broadcasts for every column's publish; per owner, column 0's large stage-2 reduce
    starts after column 0's own stage-1 reduce. Between layers compute hides that; the first
    group of the forward order closes the backward, so there auto weighs it: per owner. The other
    groups stay grouped (one latency per phase), and shard-link work after the last reduce
    (FSDP2's root reduce-scatter, ``shard_tail_s``) long enough to hide the wait makes the first
    group grouped again."""
    prog = _hsdp_boundary_program(LinkCost())
    first = prog.groups["layers.0"]
    assert first.collectives == "per_owner", first.collectives_reason
    assert "replicate" in first.collectives_reason
    assert {prog.groups[g].collectives for g in ("layers.1", "layers.2")} == {"grouped"}
    hidden = _hsdp_boundary_program(LinkCost(shard_tail_s=0.1))
    assert hidden.groups["layers.0"].collectives == "grouped", hidden.groups["layers.0"]
    # R = 1: nothing on the replicate axis, the first group is chosen like the others
    owners = {f"layers.{k}.m{i}": (i, 0) for k in range(2) for i in range(4)}
    flat = step_program(owners, {n: (512, 512) for n in owners},
                        {n: "torch.float32" for n in owners}, shard_size=4, collectives="auto")
    assert len({(g.collectives, g.collectives_reason) for g in flat.groups.values()}) == 1
