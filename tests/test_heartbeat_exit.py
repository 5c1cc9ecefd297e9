"""A dmuon job's processes exit cleanly: the heartbeat thread (``dmuon.compat.heartbeat``, a
daemon thread bumping a store counter) must not be inside its store call when the interpreter
finalizes. There, a daemon thread that returns from C++ into Python is ended by a forced unwind
through pybind11's frames, which aborts the process ("terminate called without an active
exception", exit code 134): a training script that ends without ``destroy_process_group`` — or
with it, if the thread beat just then — would be reported failed by torchrun.

The slow test makes the race likely (the thread beats continuously) and exits a real process
that built a dmuon model. In the default tier, in-process: the stop that runs at exit, and that
stopping did not make the heap soak's object count depend on the beat's phase."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch.distributed as dist

SCRIPT = textwrap.dedent("""
    import os, socket
    import torch, torch.nn as nn, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    import dmuon, dmuon.compat.heartbeat as hb
    hb.BEAT_S = 0.0  # beat without pause: the thread is in its store call at almost any time
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    mesh = init_device_mesh("cpu", (1,))
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2)
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.01)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    print("done", flush=True)
    {ending}
""")


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["", "dist.destroy_process_group()"],
                         ids=["without_destroy", "with_destroy"])
def test_a_dmuon_process_exits_cleanly(ending):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    for _ in range(6):  # the race is likely, not certain: any abort fails
        proc = subprocess.run([sys.executable, "-c", SCRIPT.format(ending=ending)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "done" in proc.stdout, (proc.returncode,
                                                                proc.stderr[-2000:])
        assert "terminate called" not in proc.stderr, proc.stderr[-2000:]


def test_the_heartbeat_stops_when_asked(monkeypatch):
    """What the exit hook does: every beating thread ends within a beat, and its counter stops."""
    from dmuon.compat import heartbeat as hb
    monkeypatch.setattr(hb, "BEAT_S", 0.1)  # a beat a tenth of the default's: a 0.15 s wait
    store = dist.HashStore()
    hb.start_heartbeat(3, store)
    thread = hb._STARTED[id(store)]
    time.sleep(0.05)
    assert thread.is_alive() and int(store.get("dmuon/alive/3")) >= 1
    hb.stop_heartbeats(timeout=2.0)
    assert not thread.is_alive()
    count = int(store.get("dmuon/alive/3"))
    time.sleep(1.5 * hb.BEAT_S)
    assert int(store.get("dmuon/alive/3")) == count


class _GatedStore:
    """A store whose first ``add`` holds its caller until the gate opens."""

    def __init__(self) -> None:
        self.inside, self.left, self.gate = threading.Event(), threading.Event(), threading.Lock()
        self.gate.acquire()

    def add(self, key: str, amount: int) -> int:
        if not self.left.is_set():
            self.inside.set()
            self.gate.acquire()
            self.left.set()
        return 1


def _tracked() -> int:
    """How many objects the collector tracks, collected until the count stops falling (a
    collection untracks a tuple of untracked items, one level of nesting at a time)."""
    count = None
    while True:
        gc.collect()
        now = len(gc.get_objects())
        if count is not None and now >= count:
            return now
        count = now


def test_a_sleeping_heartbeat_holds_no_more_tracked_objects_than_a_beating_one(monkeypatch):
    """The heap soak (``tests/test_heap_soak.py``) counts ``len(gc.get_objects())`` at two steps
    while the heartbeat runs, so the count must not depend on where the beat is: a beat asleep
    between two store calls holds no object the collector tracks that one inside its store call
    does not. (A beat waiting on a ``threading.Event`` holds 2 to 3: the waiter lock, the
    Condition's ``__exit__``, the wait's arguments; the soak failed in about 1 run of 5.)"""
    from dmuon.compat import heartbeat as hb
    hb.stop_heartbeats()  # other tests' beats: only this one may move the count
    monkeypatch.setattr(hb, "BEAT_S", 60.0)
    store = _GatedStore()
    hb.start_heartbeat(5, store)
    try:
        assert store.inside.wait(5)
        in_call = _tracked()  # the beat is held inside its store call
        store.gate.release()
        assert store.left.wait(5)
        time.sleep(0.1)  # the beat returned from its call and sleeps (BEAT_S is 60 s)
        asleep = _tracked()
    finally:
        hb.stop_heartbeats(timeout=5)
    assert asleep == in_call, (in_call, asleep)
