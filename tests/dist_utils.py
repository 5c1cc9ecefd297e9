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

* ``spawn`` start method (never fork: torch and threads), one process per rank;
* rendezvous through a ``TCPStore`` that the parent creates on port 0 (no port collisions, no
  leftover files), default process group ``timeout`` = ``timeout`` (60 s);
* in each worker: ``torch.set_num_threads(1)`` (2-core CI machine), ``init_process_group``, then
  ``fn(rank, world_size, *args, **kwargs)``, then ``destroy_process_group``;
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

import datetime
import io
import multiprocessing as _mp
import os
import queue as _queue
import time
import traceback
from typing import Any, Callable

import torch

__all__ = ["run_ranks"]

_STARTUP_MARGIN_S = 30.0


def _worker_main(fn, rank, world_size, backend, host, port, timeout_s, args, kwargs, q, env):
    try:
        os.environ.update(env)
        torch.set_num_threads(1)
        import torch.distributed as dist
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown must not mask the real error
                pass
        buf = io.BytesIO()
        torch.save(result, buf)
        q.put(("ok", rank, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        q.put(("error", rank, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 60.0, env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks; return results.

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
    import torch.distributed as dist

    ctx = _mp.get_context("spawn")
    q = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    procs = [ctx.Process(target=_worker_main,
                         args=(fn, rank, world_size, backend, "127.0.0.1", store.port, timeout,
                               args, kwargs, q, dict(env or {})),
                         daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout + _STARTUP_MARGIN_S
    first_error: float | None = None
    try:
        while len(results) + len(errors) < world_size:
            try:
                kind, rank, payload = q.get(timeout=0.2)
                _store(kind, rank, payload, results, errors)
            except _queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if not p.is_alive() and i not in results and i not in errors]
                if dead:
                    time.sleep(0.5)  # a message may still be in flight
                    _drain_queue(q, results, errors)
                    for i in dead:
                        if i not in results and i not in errors:
                            errors[i] = (f"worker exited with code {procs[i].exitcode} "
                                         "without reporting")
            now = time.monotonic()
            if errors and first_error is None:
                first_error = now
            # after a failure the others usually hang in a collective: give them 5 s to report
            if now > deadline or (first_error is not None and now > first_error + 5.0):
                for i in range(world_size):
                    if i not in results and i not in errors:
                        errors[i] = (f"timed out after {timeout + _STARTUP_MARGIN_S:.0f} s"
                                     if first_error is None else
                                     "did not finish (stopped after another rank failed)")
                break
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors else 10.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        q.close()
        del store
    if errors:
        msg = "\n".join(f"--- rank {i} ---\n{errors[i]}" for i in sorted(errors))
        raise AssertionError(f"run_ranks({getattr(fn, '__name__', fn)}, {world_size}) failed:\n{msg}")
    return [results[i] for i in range(world_size)]


def _drain_queue(q, results, errors):
    while True:
        try:
            kind, rank, payload = q.get_nowait()
        except _queue.Empty:
            return
        _store(kind, rank, payload, results, errors)


def _store(kind, rank, payload, results, errors):
    if kind == "ok":
        results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    else:
        errors[rank] = payload
