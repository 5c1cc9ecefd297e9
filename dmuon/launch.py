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
"""
from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["run"]

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
