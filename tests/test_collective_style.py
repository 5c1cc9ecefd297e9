"""One collective per bucket, without processes: the ops' bytes (padding counted), the simulator
(a per-bucket step equals the per-owner step bitwise, Z3 re-gathers and HSDP included), the
per-rank orders and memory, and ``"auto"``'s choice (per bucket where latency dominates, per
owner where padding does)."""
from __future__ import annotations

import pytest
import torch

from dmuon.functional import muon as fmuon
from dmuon.functional.buckets import BucketKey, bucket_layout, hook_groups
from dmuon.functional.collectives import (LinkCost, check_choice, choose_style, wire_bytes)
from dmuon.functional.memory_model import rank_memory
from dmuon.functional.order_check import check_orders, rank_orders
from dmuon.functional.program import step_program
from dmuon.functional.schedule import (Broadcast, ShardAllGather, ShardReduceScatter, op_bytes,
                                       reduce_schedule, unshard_schedule)
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
    # 2 large matrices on a 64-rank group: the all-gather would move 64 padded parts
    owners, shapes = _uniform(64, 2, 1 << 20)
    prog = step_program(owners, shapes, {n: "torch.float32" for n in owners}, shard_size=64,
                        collectives="auto")
    g = prog.groups["layers.0"]
    assert g.collectives == "per_owner" and "per_owner" in g.collectives_reason
    # the same group on a slow-start link with huge bandwidth: latency dominates again
    lay = prog.unshard_layout
    fast = LinkCost(alpha_s=1e-3, alpha_hop_s=0.0, busbw_bytes_per_s=1e15)
    assert choose_style(lay, prog.reduce_layout, "layers.0", "auto", cost=fast).style == "per_bucket"
    # a cost function (the projector passes its machine model)
    c = choose_style(lay, prog.reduce_layout, "layers.0", "auto", cost=lambda op, n: 1.0)
    assert c.style == "per_bucket" and c.collectives == {"per_owner": 4, "per_bucket": 2}
    # Z3: the gather counts twice
    c3 = choose_style(lay, prog.reduce_layout, "layers.0", "auto", z3=True, cost=lambda o, n: 1.0)
    assert c3.collectives == {"per_owner": 6, "per_bucket": 3}
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
    for good in ("per_owner", "per_bucket", "auto"):
        assert check_choice(good) == good
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
