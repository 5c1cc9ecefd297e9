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
