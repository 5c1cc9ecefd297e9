"""Run a script's ``main`` on a default process group, under ``torchrun`` or on local spawned ranks.

The examples end with::

    if __name__ == "__main__":
        dmuon.launch.run(main, sys.argv[1:], world_size=2, backend="gloo")

so that both ``torchrun --nproc_per_node N script.py ...`` and ``python script.py ...`` work:

* launched by ``torchrun`` (``RANK`` is in the environment): initialize the default process group
  from the environment (``env://``), run ``main(*args)``, destroy the group;
* otherwise: start ``world_size`` processes (``spawn``) that rendezvous through a ``TCPStore`` the
  parent holds on a port the OS picks (port 0: no collision with another run), each with the
  environment ``torchrun`` would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: libraries such as Accelerate read them),
  and each does the same as above.

Backend: ``nccl`` when CUDA is available, else ``gloo``, unless ``backend`` is given. With ``nccl``
each process first calls ``torch.cuda.set_device(LOCAL_RANK)``; otherwise it calls
``torch.set_num_threads(1)`` (the ranks share the machine's cores).

A spawned worker that raises logs its traceback (logger ``dmuon.launch``, stderr by default) and
makes :func:`run` raise in the parent with a worker's traceback in the message (the other workers
are terminated, none is left hanging in a collective), so an uncaught failure in a script's
``__main__`` block exits non-zero and prints it. Under ``torchrun`` the
exception propagates in the failing rank and ``torchrun`` reports it.

:func:`run_local_ranks` is the variant for callers that want each rank's *return value* (the demo's
launcher, the tests' ``run_ranks``): ``fn(rank, world_size, *args, **kwargs)`` on spawned local
ranks, results sent back with ``torch.save``, and every rank's traceback (or why it stopped) handed
to the caller, which decides how to report it.
"""
from __future__ import annotations

import datetime
import io
import logging
import os
import queue as _queue
import time
import traceback
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["run", "run_local_ranks", "RankOutcome"]

log = logging.getLogger(__name__)

_HOST = "127.0.0.1"


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _run_in_group(main: Callable[..., Any], args: tuple[Any, ...], backend: str,
                  timeout_s: float, store: dist.Store | None = None) -> None:
    """Initialize the default group (``store`` if given, else ``env://``), run ``main``, tear down.

    With ``store`` (a spawned worker) an exception is also logged with the rank before the group is
    torn down: the parent reports only one worker's error, often a peer's secondary "connection
    reset" rather than the first failure, so every worker's own traceback goes to stderr too.
    """
    if "nccl" in backend:  # "nccl" or e.g. "cpu:gloo,cuda:nccl"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    try:
        main(*args)
    except Exception:
        if store is not None:
            log.exception("rank %s of %s failed", os.environ["RANK"], os.environ["WORLD_SIZE"])
        raise
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world_size: int, port: int, main: Callable[..., Any],
             args: tuple[Any, ...], backend: str, timeout_s: float) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=_HOST, MASTER_PORT=str(port))
    store = dist.TCPStore(_HOST, port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    _run_in_group(main, args, backend, timeout_s, store)


def run(main: Callable[..., Any], *args: Any, world_size: int = 2, backend: str | None = None,
        timeout_s: float = 60.0) -> None:
    """Call ``main(*args)`` on every rank of a freshly initialized default process group.

    Args:
      main: the per-rank entry point; it finds its rank with ``dist.get_rank()``. When processes
        are spawned it must be picklable (a module-level function, e.g. a script's ``main``).
      *args: passed to ``main`` (picklable when spawning: argv lists, ``argparse.Namespace``...).
      world_size: number of local processes to spawn when not launched by ``torchrun``; ignored
        under ``torchrun`` (its ``WORLD_SIZE`` wins).
      backend: process-group backend; ``None`` picks ``"nccl"`` when CUDA is available, else
        ``"gloo"``. Scripts whose tensors live on the CPU pass ``"gloo"``.
      timeout_s: process-group timeout (and rendezvous timeout), in seconds.

    Returns:
      None (``main``'s return value is dropped: write results to files or stdout).

    Raises:
      ValueError: ``world_size < 1``.
      torch.multiprocessing.ProcessRaisedException / ProcessExitedException: a spawned worker
        raised (its traceback is in the message) or exited non-zero; the other workers are killed.
    """
    backend = backend or _default_backend()
    if "RANK" in os.environ:  # launched by torchrun (or any launcher that sets the env:// variables)
        _run_in_group(main, args, backend, timeout_s)
        return
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}; pass the number of local "
                         "ranks to spawn")
    import torch.multiprocessing as mp

    # The parent hosts the rendezvous store on a port the OS picks, so concurrent runs never collide;
    # the workers connect to it as clients. world_size + 1: the parent is a client of it too.
    store = dist.TCPStore(_HOST, 0, world_size + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    log.info("spawning %d local ranks (backend %s, store port %d)", world_size, backend, store.port)
    try:
        mp.spawn(_spawned, args=(world_size, store.port, main, args, backend, timeout_s),
                 nprocs=world_size, join=True)
    finally:
        del store


# --------------------------------------------------------------------- ranks that return values
class RankOutcome(NamedTuple):
    """What :func:`run_local_ranks` got back: ``results[rank]`` for the ranks that returned,
    ``errors[rank]`` (a traceback, or why the rank stopped) for the others."""

    results: dict[int, Any]
    errors: dict[int, str]


#: marks the environment handed to a forkserver rank as whole (it replaces the server's)
_WHOLE_ENV = "_DMUON_RANK_WHOLE_ENV"


def _rank_entry(fn: Callable[..., Any], rank: int, world_size: int, backend: str, port: int,
                timeout_s: float, args: tuple, kwargs: dict, env: dict, q: Any) -> None:
    """A spawned rank of :func:`run_local_ranks`: report ``("ok", rank, torch.save bytes)`` or
    ``("error", rank, traceback)`` *before* the teardown, so a failing rank is heard before its
    peers fail in a collective because it went away."""
    try:
        if env.pop(_WHOLE_ENV, None):  # forkserver: the parent's environment, not the server's
            os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(1)
        to = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(_HOST, port, world_size, is_master=False, timeout=to)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=to)
        result = fn(rank, world_size, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(result, buf)
        msg = ("ok", rank, buf.getvalue())
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        msg = ("error", rank, traceback.format_exc())
    q.put(msg)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown must not hide the real result
        pass


def run_local_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    kwargs: Optional[Mapping[str, Any]] = None, *, backend: str = "gloo",
                    timeout_s: float = 60.0, env: Optional[Mapping[str, str]] = None,
                    grace_s: float = 5.0, deadline_s: Optional[float] = None,
                    start_method: str = "spawn") -> RankOutcome:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned local ranks.

    Each rank (``spawn``, ``torch.set_num_threads(1)``) joins a default process group through a
    ``TCPStore`` the parent holds on a port the OS picks (no collisions), runs ``fn``, and sends
    back its return value (``torch.save``: tensors are copied out of the worker) or its traceback.
    Never hangs: a rank that dies without reporting is an error; once one rank failed the others
    get ``grace_s`` seconds to report, then are killed.

    Args:
      fn: a module-level (picklable) function.
      world_size: number of ranks (processes).
      args, kwargs: passed to ``fn`` (picklable).
      backend: process-group backend (``"gloo"``; ``"nccl"`` needs one GPU per rank).
      timeout_s: process-group (collective) and rendezvous timeout, in seconds.
      env: extra environment variables for the workers.
      grace_s: after the first failure, how long the other ranks get to report.
      deadline_s: optional limit on the whole run; ranks still running then are killed.
      start_method: ``"spawn"`` (a fresh interpreter per rank) or ``"forkserver"`` (ranks forked
        from multiprocessing's server process, which imports the modules given to
        ``multiprocessing.set_forkserver_preload`` once: ranks start without re-importing torch;
        each gets this process's current environment, as a spawned one does). Never ``"fork"``:
        torch and threads.

    Returns:
      :class:`RankOutcome` ``(results, errors)``, both keyed by rank; the caller raises on errors.
    """
    import multiprocessing as _mp

    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"run_local_ranks: start_method={start_method!r}; use 'spawn' or "
                         "'forkserver' (never 'fork': torch's threads do not survive it)")
    ctx = _mp.get_context(start_method)
    if start_method == "forkserver":
        env = {**os.environ, **(env or {}), _WHOLE_ENV: "1"}
    q = ctx.Queue()
    store = dist.TCPStore(_HOST, 0, world_size + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    procs = [ctx.Process(target=_rank_entry, daemon=True,
                         args=(fn, rank, world_size, backend, store.port, timeout_s, tuple(args),
                               dict(kwargs or {}), dict(env or {}), q))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}

    def take(kind: str, rank: int, payload: Any) -> None:
        if kind == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors[rank] = payload

    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    first_error: Optional[float] = None
    try:
        while len(results) + len(errors) < world_size:
            try:
                take(*q.get(timeout=0.2))
            except _queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if not p.is_alive() and i not in results and i not in errors]
                if dead:
                    time.sleep(0.5)  # its last message may still be in the pipe
                    while True:
                        try:
                            take(*q.get_nowait())
                        except _queue.Empty:
                            break
                    for i in dead:
                        if i not in results and i not in errors:
                            errors[i] = (f"process exited with code {procs[i].exitcode} "
                                         "without reporting")
            now = time.monotonic()
            if errors and first_error is None:
                first_error = now
            if (deadline is not None and now > deadline) or (
                    first_error is not None and now > first_error + grace_s):
                for i in range(world_size):
                    if i not in results and i not in errors:
                        errors[i] = (f"timed out after {deadline_s:.0f} s" if first_error is None
                                     else "did not finish (stopped after another rank failed)")
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
    return RankOutcome(results, errors)
