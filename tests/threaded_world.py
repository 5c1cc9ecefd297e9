"""N ranks as N threads of one process, on torch's multi-threaded process group: how the CUDA path
runs at world >= 2 on the one GPU we have (issue 39).

Why threads. NCCL refuses two ranks on one GPU ("Duplicate GPU detected", a check NCCL added in
2.5 because its topology search cannot work so: NVIDIA/nccl#418); gloo moves CUDA tensors only in
``broadcast`` and ``all_reduce`` (torch's backend table), while FSDP2 needs
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` and dmuon ``reduce``, ``gather`` and
``scatter`` on them; a fake process group (``torch.testing._internal.distributed.fake_pg``)
moves no data. torch's multi-threaded process group
(``torch.testing._internal.distributed.multi_threaded_pg``, what torch's own DTensor / FSDP tests
use) runs real collectives: each rank is a thread, its ``_world`` is thread-local, and a
collective joins the ranks' threads, after which rank 0's thread moves every rank's data (tensor
copies and reductions, on the GPU for CUDA tensors).

Two things it lacks, added here (:func:`install`), without which it would not be a faithful CUDA
backend:

* ``reduce`` (dmuon reduces each gradient bucket to its owner): the reduction of every rank's
  tensor into the root's, like its ``allreduce``;
* **stream order**. Rank 0's thread enqueues the copies on *its* current stream, while each rank
  produced its inputs, and will read its outputs, on its own streams (dmuon's lane streams,
  FSDP2's all-gather / reduce-scatter streams). So each rank records an event on its current
  stream when it joins, rank 0's stream waits for all of them before moving the data, records a
  done event after, and every rank's current stream waits for that before the collective
  returns: the order NCCL gives (the collective starts after what the caller's stream enqueued
  before it, and what the stream enqueues after sees its result). Host-side the collective is
  synchronous (its ``Work`` is complete), as gloo's is.

The same harness runs on CPU (the device tests of the default tier validate it there against the
single-process reference, ``tests/test_threaded_world.py``); on the H200 the GPU test runs dmuon's
CUDA executor (lane streams and events), the NS engine's graph replay and the HSDP publish at
world 2 and 4 (``tests/test_world_gpu_threads.py``). What it does not exercise: NCCL itself (its
kernels, its own internal streams and watchdog, high-priority stream options), and two processes'
CUDA contexts.
"""
from __future__ import annotations

import threading
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["install", "run_threads"]

_INSTALLED: list = []


def install() -> Any:
    """Add ``reduce``, ``send`` / ``recv`` and the stream fencing to torch's multi-threaded process group (once)."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtp
    if _INSTALLED:
        return mtp

    class Reduce:
        def __init__(self, op: Any, root: int):
            self.op, self.root = op.op, root

        @torch.no_grad()
        def work(self, data):
            for i in range(len(data[0])):
                dst = data[self.root][i]
                res = mtp._reduce_ops[self.op]([data[r][i].to(dst.device) for r in range(len(data))])
                dst.detach().copy_(res)

    def reduce(self, tensor_list, opts=dist.ReduceOptions()):
        coll = mtp.ProcessLocalGroup._start_coll(Reduce(opts.reduceOp, opts.rootRank), self)
        res = coll.join(self._rank, tensor_list)
        mtp.ProcessLocalGroup._end_coll(coll, self)
        return res

    class Fenced(mtp.Collective):
        """A collective whose data moves after every rank's stream reached it, and which every
        rank's stream waits for (module docstring)."""

        def __init__(self, world_size, collective, pg):
            super().__init__(world_size, collective, pg)
            self._ready: dict[int, Any] = {}
            self._finished = None
            inner, outer = collective, self

            class Work:
                def work(self, data):
                    if outer._ready:
                        stream = torch.cuda.current_stream()
                        for ev in outer._ready.values():
                            stream.wait_event(ev)
                    inner.work(data)
                    if outer._ready:
                        outer._finished = torch.cuda.Event()
                        outer._finished.record()
            self._collective = Work()

        def join(self, rank, data):
            from torch.utils._pytree import tree_leaves
            if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_leaves(data)):
                ev = torch.cuda.Event()
                ev.record()
                self._ready[rank] = ev
            out = super().join(rank, data)
            if self._finished is not None:
                torch.cuda.current_stream().wait_event(self._finished)
            return out

    import queue
    import threading
    mailboxes: dict = {}
    boxes_lock = threading.Lock()

    def _box(pg: Any, src: int, dst: int, tag: int) -> "queue.Queue":
        with boxes_lock:
            return mailboxes.setdefault((pg.pg_name, src, dst, tag), queue.Queue())

    def send(self, tensors, dst, tag=0):
        """Point-to-point send: the data is copied now (after the sender's stream reached this
        point) and queued for the receiver; never blocks."""
        copies = []
        for t in tensors:
            c = t.detach().clone()
            if c.is_cuda:
                torch.cuda.current_stream().synchronize()
            copies.append(c)
        _box(self, self._rank, dst, tag).put(copies)
        return mtp.ret_work(tensors)

    def recv(self, tensors, src, tag=0):
        """Point-to-point receive: blocks until the matching send was made (bounded)."""
        got = _box(self, src, self._rank, tag).get(timeout=120)
        for t, c in zip(tensors, got):
            t.detach().copy_(c.to(t.device))
        return mtp.ret_work(tensors)

    mtp.ProcessLocalGroup.reduce = reduce
    mtp.ProcessLocalGroup.send = send
    mtp.ProcessLocalGroup.recv = recv
    mtp.Collective = Fenced
    _INSTALLED.append(True)
    return mtp


def run_threads(fn: Callable[..., Any], world: int, *args: Any, device: str = "cpu",
                timeout: float = 300.0) -> list[Any]:
    """``[fn(rank, world, *args) for each rank]``, the ranks as threads on the multi-threaded
    process group (``device="cuda"``: every rank on GPU 0). A rank that raises fails the call
    with an ``AssertionError`` carrying its traceback (the others are released, not left
    waiting); so does a run longer than ``timeout``."""
    mtp = install()
    mtp.ProcessLocalGroup.reset()
    world_obj = mtp._install_threaded_pg()
    # per-thread registries of group names (as torch's spawn_threads_and_init_comms does)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    results: list[Any] = [None] * world
    errors: dict[int, str] = {}

    def run(rank: int) -> None:
        try:
            if device == "cuda":
                torch.cuda.set_device(0)
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            results[rank] = fn(rank, world, *args)
        except BaseException as e:  # noqa: BLE001 - reported below; releases the other ranks
            errors[rank] = traceback.format_exc(limit=-12)
            mtp.ProcessLocalGroup.exception_handle(e)
        finally:
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except AttributeError:  # torch 2.11's ThreadLocalWorld has no .comms to abort
                    pass

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if device == "cuda":
            torch.cuda.synchronize()
    finally:
        alive = [r for r, t in enumerate(threads) if t.is_alive()]
        if alive:
            mtp.ProcessLocalGroup.exception_handle(RuntimeError("timeout"))
        mtp._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        del world_obj
    if alive:
        raise AssertionError(f"threaded ranks {alive} still running after {timeout} s")
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)))
    return results


_SERIAL = threading.Lock()


def serialized(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run by one thread-rank at a time: for code that uses process-global state a
    process per rank would not share, e.g. the tests' ``make_model`` (it seeds torch's global
    RNG, builds, and restores it: two ranks interleaving would build different weights)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        with _SERIAL:
            return fn(*args, **kwargs)
    return run
