"""Run a function on N torch.distributed ranks in fresh processes, for tests (gloo on CPU by default).

Usage::

    from dist_utils import run_ranks

    def _worker(rank, world_size, scale):          # module-level: spawn pickles it by reference
        import torch, torch.distributed as dist
        x = torch.full((2,), float(rank))
        dist.all_reduce(x)
        return {"sum": x * scale}                   # anything torch.save can write

    def test_sum():
        results = run_ranks(_worker, 2, 3.0)        # list indexed by rank
        assert results[0]["sum"].tolist() == [3.0, 3.0]

What it does:

* ``forkserver`` start method (never fork: torch and threads), one process per rank, forked from
  multiprocessing's server process, which imported torch once (:data:`PRELOAD`): a rank starts in
  ~0.1 s instead of re-importing torch (~1.5 s a process on the 2-core CI machine). Each rank gets
  the parent's current environment. ``DMUON_TEST_START_METHOD=spawn`` runs fresh interpreters;
* rendezvous through a ``TCPStore`` that the parent creates on port 0 (no port collisions, no
  leftover files), default process group ``timeout`` = ``timeout`` (60 s);
* in each worker: ``torch.set_num_threads(1)`` (2-core CI machine), ``init_process_group``, then
  ``fn(rank, world_size, *args, **kwargs)``, then its result or traceback is sent to the parent, then
  ``destroy_process_group``;
* results come back serialized with ``torch.save`` (tensors are copied, no shared memory that dies
  with the worker) and are returned as a list indexed by rank;
* a worker that raises fails the call with an ``AssertionError`` carrying that worker's traceback
  (every worker's, if several failed); a worker that dies without reporting, or a run that exceeds
  ``timeout`` (+ a margin for startup), fails it too, after the remaining workers are killed — the
  test never hangs.

``fn`` runs after the process group is up; it can create more groups, set devices, etc. Put several
checks in one ``fn`` (spawning costs seconds) and return what the parent should assert.
"""
from __future__ import annotations

import multiprocessing
import os
from typing import Any, Callable

from dmuon.launch import run_local_ranks

#: how the tests start ranks (``dmuon.launch.run_local_ranks``' start_method)
START_METHOD = os.environ.get("DMUON_TEST_START_METHOD", "forkserver")
#: what the forkserver imports once, for every rank it forks (torch only: dmuon's own import,
#: which installs its FSDP2 patch, still happens in each rank, in the order its test chose)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor"]
if START_METHOD == "forkserver":
    multiprocessing.set_forkserver_preload(PRELOAD)

__all__ = ["run_ranks"]

_STARTUP_MARGIN_S = 30.0


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 60.0, env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks; return results.

    The spawning, rendezvous and result transport are :func:`dmuon.launch.run_local_ranks`; this
    wrapper adds the whole-run deadline and turns failures into an ``AssertionError``.

    Args:
      fn: a module-level (picklable) function.
      world_size: number of ranks (processes).
      *args, **kwargs: passed to ``fn`` (picklable).
      backend: process-group backend (``"gloo"``; ``"nccl"`` needs one GPU per rank).
      timeout: seconds for the process-group timeout and for the whole run (plus a startup margin).
      env: extra environment variables for the workers.

    Returns:
      ``[result of rank 0, result of rank 1, ...]``.

    Raises:
      AssertionError: a worker raised (message includes its traceback), died without reporting, or
        the run timed out.
    """
    results, errors = run_local_ranks(fn, world_size, args, kwargs, backend=backend,
                                      timeout_s=timeout, env=env, grace_s=5.0,
                                      deadline_s=timeout + _STARTUP_MARGIN_S,
                                      start_method=START_METHOD)
    if errors:
        msg = "\n".join(f"--- rank {i} ---\n{errors[i]}" for i in sorted(errors))
        raise AssertionError(f"run_ranks({getattr(fn, '__name__', fn)}, {world_size}) failed:\n{msg}")
    return [results[i] for i in range(world_size)]


def run_each(paths: dict, env: dict) -> dict:
    """``{key: path(env)}`` for each of ``paths``; a path that raises gives ``{"error": its type,
    message and traceback}`` and the others still run (a spawn checks many user paths at once)."""
    import traceback
    out = {}
    for key, path in paths.items():
        try:
            out[key] = path(env)
        except Exception as e:  # noqa: BLE001 - reported per path
            out[key] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return out


def catch(fn) -> tuple:
    """Run ``fn()``; return ``(exception type name, message)``, or ``(None, None)`` if it did not raise.

    For error tests that inspect, in the parent, what every rank raised."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller inspects type and message
        return type(e).__name__, str(e)
    return None, None


def assert_all_ranks(results, key, kind, *needles):
    """Assert that every rank's ``catch`` result ``results[rank][key]`` is ``(kind, msg)`` with each
    of ``needles`` in ``msg`` (``kind=None``, no needles: no rank raised)."""
    for rank, out in enumerate(results):
        got_kind, msg = out[key]
        assert got_kind == kind, (rank, key, out[key])
        for s in needles:
            assert s in msg, (rank, key, s, msg)
