"""CUDA lanes of the executor on a 1-rank NCCL group: distinct streams per lane (shard-axis lanes at
high priority), ordering by events only (producer -> lane -> dependent lane -> consumer), and
``Pending.wait()`` never blocks the host. Ordering is observed with ``torch.cuda._sleep`` spins: an
event behind a spinning stream must still be pending right after the call that enqueued it."""
import datetime

import pytest
import torch

from dmuon.functional.buckets import BucketKey
from dmuon.functional.schedule import Broadcast, Reduce, Schedule

pytestmark = pytest.mark.gpu

SPIN = int(3e8)   # cycles: ~0.1-0.2 s on an H200, far longer than the host code between checks


@pytest.fixture
def nccl_one_rank(tmp_path):
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        torch.cuda.synchronize()
        dist.destroy_process_group()


def test_cuda_lanes_streams_and_event_ordering(nccl_one_rank):
    from dmuon.stateful.runtime.executor import Executor
    from dmuon.stateful.runtime.process_groups import make_process_groups

    dev = torch.device("cuda", 0)
    mg = make_process_groups(shard_size=1)
    assert set(mg.groups) == {"unshard", "reduce", "replicate"}
    ex = Executor(mg, issue_trivial=True)
    key = BucketKey("layers.0", 0, "torch.float32")
    b1 = Broadcast(id="b", axis="shard", at=None, bucket=key, offset=0, numel=1024,
                   dtype=key.dtype, lane="unshard", src=0)
    r2 = Reduce(id="r", axis="shard", at=None, bucket=key, offset=0, numel=1024,
                dtype=key.dtype, lane="reduce", dst=0, waits=("b",))
    p3 = Broadcast(id="p", axis="replicate", at=0, bucket=key, offset=512, numel=512,
                   dtype=key.dtype, lane="replicate", src=0, waits=("r",))
    sched = Schedule((b1, r2, p3), 1, 1)

    # lanes are distinct streams, distinct from the compute stream; shard lanes high priority
    cur = torch.cuda.current_stream(dev)
    streams = {lane: ex.lane_stream(lane, dev) for lane in ("unshard", "reduce", "replicate")}
    ids = {s.stream_id for s in streams.values()} | {cur.stream_id}
    assert len(ids) == 4
    lo, hi = torch.cuda.Stream.priority_range()
    if lo != hi:
        assert streams["unshard"].priority == streams["reduce"].priority == hi
        assert streams["replicate"].priority != hi

    buf = torch.zeros(1024, device=dev)
    # warm up: first use of a kernel (lazy module loading) and of each lane's communicator may
    # synchronize the device, which would hide ordering bugs behind host waits
    ex.launch(sched, {key: buf}).wait()
    _ = (buf * 2, buf + 1, buf.fill_(0.0))
    torch.cuda.synchronize()
    ex.reset_counters()
    # 1) producer on the compute stream spins, then writes: lane ops must wait for it
    torch.cuda._sleep(SPIN)
    buf.fill_(7.0)
    pend = ex.launch(sched, {key: buf})
    events = [rec.event for rec in pend._recs]
    assert not any(e.query() for e in events), "lane ops ran before their producer"
    pend.wait()                       # must not block the host
    assert not events[-1].query(), "Pending.wait() blocked the host"
    y = buf * 2                       # consumer on the compute stream, after the lanes
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 14.0))

    # 2) a spin on the unshard lane delays the dependent reduce and replicate ops and the consumer
    with torch.cuda.stream(streams["unshard"]):
        torch.cuda._sleep(SPIN)
    pend = ex.launch(sched, {key: buf})
    pend.wait()
    consumer = torch.cuda.Event()
    z = buf + 1
    consumer.record(cur)
    ev = [rec.event for rec in pend._recs]
    assert not ev[1].query() and not ev[2].query() and not consumer.query()
    torch.cuda.synchronize()
    assert all(e.query() for e in ev) and torch.equal(z, torch.full_like(z, 8.0))

    c = ex.counters()
    assert c["unshard"]["collectives"] == 2 and c["reduce"]["collectives"] == 2
    assert c["replicate"]["collectives"] == 2
    assert all(v["sent_bytes"] == v["received_bytes"] == 0 for v in c.values())


def test_cuda_per_bucket_ops_stage_on_their_lane_and_order_by_events(nccl_one_rank):
    """A ``ShardAllGather`` and a ``ShardReduceScatter`` (one collective per hook group) on the
    CUDA lanes: the staging copies run on the lane stream after the producer, the bucket holds the
    result once ``Pending.wait()`` ordered the consumer, the host is never blocked, and the
    counters are ``op_bytes``' (a group of one: issued, 0 bytes)."""
    from dmuon.functional.schedule import ShardAllGather, ShardReduceScatter
    from dmuon.stateful.runtime.executor import Executor
    from dmuon.stateful.runtime.process_groups import make_process_groups

    dev = torch.device("cuda", 0)
    ex = Executor(make_process_groups(shard_size=1), issue_trivial=True)
    key = BucketKey("layers.0", 0, "torch.float32")
    kw = dict(axis="shard", at=None, bucket=BucketKey("layers.0", -1, key.dtype), offset=0,
              numel=1000, dtype=key.dtype, keys=(key,), sizes=(1000,))
    ag = ShardAllGather(id="ag", lane="unshard", **kw)
    rs = ShardReduceScatter(id="rs", lane="reduce", op="sum", waits=("ag",), **kw)
    sched = Schedule((ag, rs), 1, 1)
    buf = torch.zeros(1000, device=dev)
    ex.launch(sched, {key: buf}).wait()   # warm up the lanes' communicators
    torch.cuda.synchronize()
    ex.reset_counters()
    torch.cuda._sleep(SPIN)
    buf.fill_(3.0)
    pend = ex.launch(sched, {key: buf})
    events = [rec.event for rec in pend._recs]
    assert not any(e.query() for e in events), "per-bucket ops ran before their producer"
    pend.wait()
    assert not events[-1].query(), "Pending.wait() blocked the host"
    y = buf * 2
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 6.0))
    c = ex.counters()
    assert c["unshard"]["collectives"] == c["reduce"]["collectives"] == 1
    assert c["unshard"]["sent_bytes"] == c["reduce"]["received_bytes"] == 0


def test_cuda_grouped_ops_are_one_group_call_per_phase_on_their_lane(nccl_one_rank, monkeypatch):
    """Grouped-style ops (one ``coalesce`` key per phase, buckets of two dtypes): each phase is
    one group call (:func:`dmuon.compat.torch_api.coalesced_calls`, i.e. ``_coalescing_manager``
    on the NCCL group), staged on its lane stream after the producer, ordered by events (a spin on
    the gather's lane delays the reduces and the publish behind it), the host never blocked,
    every part of a call marked done by one event, and counted per part (``op_bytes``)."""
    from dmuon.stateful.runtime import executor as exmod
    from dmuon.stateful.runtime.executor import Executor
    from dmuon.stateful.runtime.process_groups import make_process_groups

    real, calls = exmod.coalesced_calls, []

    def spy(group, device, parts=2):
        calls.append(parts)
        return real(group, device, parts)

    monkeypatch.setattr(exmod, "coalesced_calls", spy)
    dev = torch.device("cuda", 0)
    ex = Executor(make_process_groups(shard_size=1), issue_trivial=True)
    k32, k64 = BucketKey("layers.0", 0, "torch.float32"), BucketKey("layers.0", 0, "torch.float64")

    def ops(kind, key, n, i, lane, **kw):
        return kind(id=f"{lane}{i}", axis="replicate" if lane == "replicate" else "shard",
                    at=0 if lane == "replicate" else None, bucket=key, offset=0, numel=n,
                    dtype=key.dtype, lane=lane, coalesce=f"{lane}/layers.0", **kw)

    sched = Schedule((ops(Broadcast, k32, 1000, 0, "unshard", src=0),
                      ops(Broadcast, k64, 600, 1, "unshard", src=0),
                      ops(Reduce, k32, 1000, 0, "reduce", dst=0, op="sum",
                          waits=("unshard0", "unshard1")),
                      ops(Reduce, k64, 600, 1, "reduce", dst=0, op="sum", waits=("unshard1",)),
                      ops(Broadcast, k32, 1000, 0, "replicate", src=0, waits=("reduce0",)),
                      ops(Broadcast, k64, 600, 1, "replicate", src=0, waits=("reduce1",))), 1, 1)
    b32 = torch.zeros(1000, device=dev)
    b64 = torch.zeros(600, device=dev, dtype=torch.float64)
    bufs = {k32: b32, k64: b64}
    ex.launch(sched, bufs).wait()   # warm up the lanes' communicators
    torch.cuda.synchronize()
    assert calls == [2, 2, 2]
    ex.reset_counters()
    torch.cuda._sleep(SPIN)
    b32.fill_(3.0)
    b64.fill_(5.0)
    pend = ex.launch(sched, bufs)
    events = [rec.event for rec in pend._recs]
    assert events[0] is events[1] and events[2] is events[3] and events[4] is events[5]
    assert not any(e.query() for e in events), "grouped ops ran before their producer"
    pend.wait()
    assert not events[-1].query(), "Pending.wait() blocked the host"
    y, z = b32 * 2, b64 * 2
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 6.0)) and torch.equal(z, torch.full_like(z, 10.0))
    # a spin on the gather's lane: the reduce and publish calls wait for it, the consumer too
    with torch.cuda.stream(ex.lane_stream("unshard", dev)):
        torch.cuda._sleep(SPIN)
    pend = ex.launch(sched, bufs)
    pend.wait()
    consumer = torch.cuda.Event()
    w = b32 + 1
    consumer.record(torch.cuda.current_stream(dev))
    ev = [rec.event for rec in pend._recs]
    assert not ev[2].query() and not ev[4].query() and not consumer.query()
    torch.cuda.synchronize()
    assert all(e.query() for e in ev) and torch.equal(w, torch.full_like(w, 4.0))
    assert calls == [2] * 9
    c = ex.counters()
    assert c["unshard"]["collectives"] == c["reduce"]["collectives"] == 4
    assert c["replicate"]["collectives"] == 4
    assert all(v["sent_bytes"] == v["received_bytes"] == 0 for v in c.values())
