"""Schedule ops, builders, validation, byte accounting (Z2 / Z3 / HSDP) and the readable dump."""
import pytest

from dmuon.functional.program import program_from_layouts, step_traffic
from dmuon.functional.buckets import BucketKey
from dmuon.functional.schedule import (LANES, Broadcast, Reduce, Schedule,
                                       publish_schedule, reduce_schedule, schedule_traffic,
                                       unshard_schedule)
from sched_cases import random_layout

KEY = BucketKey("g", 0, "torch.float32")


def _bc(**kw):
    base = dict(id="a", axis="shard", at=None, bucket=KEY, offset=0, numel=4, dtype=KEY.dtype,
                lane="unshard", src=0)
    base.update(kw)
    return Broadcast(**base)


def test_op_validation():
    assert _bc().nbytes == 16 and _bc().root == 0
    with pytest.raises(ValueError, match="lane"):
        _bc(lane="replicate")
    with pytest.raises(ValueError, match="every replica"):
        _bc(at=0)
    with pytest.raises(ValueError, match="column"):
        _bc(axis="replicate", lane="replicate")
    with pytest.raises(ValueError, match="dtype"):
        _bc(dtype="torch.float64")
    with pytest.raises(ValueError, match="reduce op"):
        Reduce(id="r", axis="shard", at=None, bucket=KEY, offset=0, numel=1, dtype=KEY.dtype,
               lane="reduce", dst=0, op="max")
    with pytest.raises(ValueError, match="duplicate"):
        Schedule((_bc(), _bc()), 2, 1)
    with pytest.raises(ValueError, match="not an earlier op"):
        Schedule((_bc(waits=("b",)), _bc(id="b")), 2, 1)
    with pytest.raises(ValueError, match="outside"):
        Schedule((_bc(src=2),), 2, 1)
    with pytest.raises(TypeError):
        Broadcast(KEY)  # keyword-only


@pytest.mark.parametrize("seed", range(20))
def test_builders_structure(seed):
    layout, owners, _, _ = random_layout(seed)
    G, R = layout.shard_size, layout.replicate_size
    steps = program_from_layouts(layout, layout, layout)
    for g in layout.groups:
        bs = layout.buckets_of(g)
        un = unshard_schedule(layout, g)
        assert un == steps.groups[g].unshard
        assert [op.bucket for op in un] == [b.key for b in bs]
        assert all(isinstance(op, Broadcast) and op.axis == "shard" and op.at is None
                   and op.src == op.bucket.column and op.numel == layout.bucket(op.bucket).numel
                   and op.lane == "unshard" for op in un)
        red = reduce_schedule(layout, g)
        s1 = red.by_lane("reduce")
        s2 = red.by_lane("replicate")
        assert len(s1) == len(bs) and all(op.dst == op.bucket.column and op.op == "avg" for op in s1)
        if R == 1:
            assert not s2
        else:
            assert len(s2) == sum(len(b.ranges) for b in bs)
            for op in s2:
                b = layout.bucket(op.bucket)
                assert op.axis == "replicate" and op.at == b.key.column
                assert (op.offset, op.numel) == b.range_of(op.dst)
                assert op.waits == (f"reduce/{b.key}",)
                assert red.op(op.waits[0]).bucket == op.bucket
    pub = publish_schedule(layout)
    assert pub == steps.publish_all()
    assert (len(pub) == 0) == (R == 1)
    for op in pub:
        assert op.axis == "replicate" and op.lane == "replicate"
        assert (op.offset, op.numel) == layout.bucket(op.bucket).range_of(op.src)
    # every param is covered by exactly one publish range in HSDP
    if R > 1:
        covered = {}
        for op in pub:
            for e in layout.bucket(op.bucket).entries:
                if op.offset <= e.offset < op.offset + op.numel:
                    covered[e.name] = covered.get(e.name, 0) + 1
                    assert e.owner == (op.at, op.src)
        assert covered == {n: 1 for n in owners}


@pytest.mark.parametrize("seed", range(30))
def test_accounting_z2_z3_hsdp(seed):
    layout, _, _, _ = random_layout(seed, dtypes=("torch.float32", "torch.bfloat16"))
    G, R = layout.shard_size, layout.replicate_size
    W, P = G * R, layout.nbytes()
    shard_lanes = ("unshard", "reduce")
    z2 = step_traffic(layout, reshard_after_forward=False)
    z3 = step_traffic(layout, reshard_after_forward=True)
    # totals over all G*R ranks: R shard groups, each moving (G-1) P per op kind (exact integers)
    assert z2.total_sent(shard_lanes) == 2 * (G - 1) * P * R
    assert z2.total_received(shard_lanes) == 2 * (G - 1) * P * R
    assert z3.total_sent(shard_lanes) == 3 * (G - 1) * P * R
    assert z3.total_received(shard_lanes) == 3 * (G - 1) * P * R
    assert abs(z2.mean_sent(shard_lanes) - 2 * (G - 1) / G * P) < 1e-6 * max(P, 1)
    assert abs(z3.mean_received(shard_lanes) - 3 * (G - 1) / G * P) < 1e-6 * max(P, 1)
    # HSDP: stage-2 reduce moves P in total, the publish another P
    stage2 = sum(reduce_schedule(layout, g).traffic().total_sent(["replicate"])
                 for g in layout.groups)
    assert stage2 == (R - 1) * P
    pub = publish_schedule(layout).traffic()
    assert pub.total_sent() == pub.total_received() == (R - 1) * P
    assert z2.total_sent(["replicate"]) == 2 * (R - 1) * P
    assert step_traffic(layout, reshard_after_forward=False, publish=False).total_sent(["replicate"]) == (R - 1) * P
    # sent == received for every lane
    for lane in LANES:
        assert z3.total_sent([lane]) == z3.total_received([lane])


def test_accounting_per_rank_roles():
    # G=2, R=1, one 2x3 fp32 matrix owned by rank 1: rank 1 sends 24 B (broadcast), receives 24 B
    from dmuon.functional.buckets import bucket_layout, hook_groups
    lay = bucket_layout({"layers.0.w": (1, 0)}, {"layers.0.w": (2, 3)},
                        {"layers.0.w": "torch.float32"}, hook_groups(["layers.0.w"]), 2)
    t = step_traffic(lay, reshard_after_forward=False)
    assert t.sent["unshard"] == (0, 24) and t.received["unshard"] == (24, 0)
    assert t.sent["reduce"] == (24, 0) and t.received["reduce"] == (0, 24)
    assert t.collectives["unshard"] == (1, 1)
    assert t.for_rank(1)["unshard"] == {"collectives": 1, "sent_bytes": 24, "received_bytes": 0}
    one = bucket_layout({"layers.0.w": (0, 0)}, {"layers.0.w": (2, 3)},
                        {"layers.0.w": "torch.float32"}, hook_groups(["layers.0.w"]), 1)
    assert step_traffic(one, reshard_after_forward=True).total_sent() == 0  # groups of one: nothing
    with pytest.raises(TypeError, match="reshard_after_forward"):
        step_traffic(lay, "z3")  # the old string spelling is refused, not read as True


def test_dump_and_concat():
    layout, _, _, _ = random_layout(3, G=2, R=2, n_layers=2)
    g = layout.groups[0]
    s = unshard_schedule(layout, g) + reduce_schedule(layout, g) + publish_schedule(layout, g)
    text = s.dump()
    assert text.splitlines()[0] == f"Schedule G=2 R=2 ops={len(s)}"
    assert len(text.splitlines()) == 1 + len(s) + 3
    assert "waits=" in text and "reduce[avg]" in text and "column s=" in text
    assert schedule_traffic(s) == s.traffic()
    with pytest.raises(ValueError, match="duplicate"):
        unshard_schedule(layout, g) + unshard_schedule(layout, g)
    with pytest.raises(ValueError, match="different meshes"):
        s + Schedule((), 4, 1)
