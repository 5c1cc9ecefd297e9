"""A dmuon job's processes exit cleanly: the heartbeat thread (``dmuon.compat.heartbeat``, a
daemon thread bumping a store counter) must not be inside its store call when the interpreter
finalizes. There, a daemon thread that returns from C++ into Python is ended by a forced unwind
through pybind11's frames, which aborts the process ("terminate called without an active
exception", exit code 134): a training script that ends without ``destroy_process_group`` — or
with it, if the thread beat just then — would be reported failed by torchrun.

The slow test makes the race likely (the thread beats continuously) and exits a real process
that built a dmuon model; the default-tier test checks the stop the fix adds, in-process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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


XFAIL = pytest.mark.xfail(strict=True, reason="the heartbeat daemon thread is in its store call "
                          "at finalization: the process aborts (fix: stop it at exit)")


# with the group destroyed first the thread ends at its next check, so only some exits abort
# (about 1 in 6 to 2 in 3 here): not strict
FLAKY = pytest.mark.xfail(strict=False, reason="aborts in some exits (the same race)")


@pytest.mark.slow
@pytest.mark.parametrize("ending", [pytest.param("", marks=XFAIL),
                                    pytest.param("dist.destroy_process_group()", marks=FLAKY)],
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


@XFAIL
def test_the_heartbeat_stops_when_asked():
    """What the exit hook does: every beating thread ends within a beat, and its counter stops."""
    from dmuon.compat import heartbeat as hb
    store = dist.HashStore()
    hb.start_heartbeat(3, store)
    thread = hb._STARTED[id(store)]
    time.sleep(0.05)
    assert thread.is_alive() and int(store.get("dmuon/alive/3")) >= 1
    hb.stop_heartbeats(timeout=2 * hb.BEAT_S)
    assert not thread.is_alive()
    count = int(store.get("dmuon/alive/3"))
    time.sleep(1.5 * hb.BEAT_S)
    assert int(store.get("dmuon/alive/3")) == count
