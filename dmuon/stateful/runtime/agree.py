"""Decide on every rank, raise on every rank: dmuon's one agreement helper. A local check that may
fail on some ranks only ends in one small collective (:func:`gather`, :func:`agree`,
:func:`agree_equal`, :func:`rank_flags`, :func:`max_over_ranks`, :func:`host_sum`), so every
rank raises the same error or none does; :func:`join` refuses a collective call made on some ranks only. ``via``: a
:class:`~dmuon.stateful.runtime.process_groups.MeshGroups` (its bounded control group), a process
group, or ``None`` (the default group).

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.agree".
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dmuon.compat.heartbeat import PeerWatch
from dmuon.compat.torch_api import default_store
from dmuon.functional.rank_report import describe_problems, describe_values, not_on_every_rank
from dmuon.functional.tp_step import max_keeping_nan
from dmuon.kernels.streams import side_stream

__all__ = ["gather", "agree", "agree_equal", "rank_flags", "max_over_ranks", "host_sum", "join",
           "NotOnEveryRankError", "describe_problems", "describe_values"]


def _group(via: Any) -> Any:
    """The process group ``via`` names (``None``: the default group)."""
    return via.control if hasattr(via, "control_collective") else via


def _run(via: Any, what: str, fn: Callable[[Any], Any]) -> Any:
    """``fn(group)`` on ``via``'s group; through ``control_collective`` where ``via`` has one."""
    return via.control_collective(what, fn) if hasattr(via, "control_collective") else fn(via)


def gather(value: Any, *, what: str, via: Any = None) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order (collective: one ``all_gather_object``;
    ``what``: its name, for a timeout's message; ``via``: where it runs, see the module docstring).
    """
    got: list[Any] = [None] * dist.get_world_size(_group(via))
    _run(via, what, lambda g: dist.all_gather_object(got, value, group=g))
    return got


def agree(problems: Sequence[str], *, what: str, error: Callable[[str], BaseException],
          via: Any = None, payload: Any = None) -> list[Any]:
    """Collective: raise ``error(detail)`` on every rank if any rank has a problem.

    Args:
      problems: this rank's problems (messages; empty: none).  what: the collective's name.
      error: builds the exception from the detail (:func:`describe_problems`: the ranks and their
        messages); the caller's message frames it (what failed, that nothing changed, the fix).
      via: where it runs (see the module docstring).
      payload: a small picklable value to exchange in the same collective.

    Returns:
      every rank's ``payload``, in rank order (when no rank has a problem).
    """
    got = gather((list(problems), payload), what=what, via=via)
    detail = describe_problems({r: p for r, (p, _) in enumerate(got) if p})
    if detail:
        raise error(detail)
    return [pl for _, pl in got]


def agree_equal(value: Any, *, what: str, error: Callable[[str], BaseException],
                via: Any = None, show: Callable[[Any], str] = str) -> list[Any]:
    """Collective: raise ``error(detail)`` on every rank unless every rank passed an equal
    ``value`` (hashable; ``detail``: :func:`describe_values` with ``show``). Returns every
    rank's value."""
    got = gather(value, what=what, via=via)
    if len(set(got)) > 1:
        raise error(describe_values(got, show))
    return got


def rank_flags(local: torch.Tensor, *, what: str, via: Any = None) -> torch.Tensor:
    """Collective: ``flags[i, r]`` = rank ``r``'s ``local[i]`` (``local``: ``k`` flags on any
    device, nonzero = set), as float32 on ``local``'s device. Nothing is read back to the host
    before the collective (on CUDA the caller's ``bool(...)`` afterwards is the one wait)."""
    group = _group(via)
    flags = torch.zeros(local.numel(), dist.get_world_size(group), dtype=torch.float32,
                        device=local.device)
    flags[:, dist.get_rank(group)] = local.reshape(-1).to(torch.float32)
    _run(via, what, lambda g: dist.all_reduce(flags, group=g))
    return flags


def max_over_ranks(values: torch.Tensor, *, what: str, via: Any = None) -> torch.Tensor:
    """Collective: the elementwise maximum of ``values`` (floating) over ranks, NaN wherever any
    rank holds a NaN (:func:`dmuon.functional.tp_step.max_keeping_nan`). Same shape and dtype as
    ``values``."""
    return max_keeping_nan(values, lambda t: _run(
        via, what, lambda g: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)))


def host_sum(values: Sequence[int], *, what: str, via: Any, device: torch.device) -> list[int]:
    """Collective: the sum of the host ``values`` over ``via`` (see the module docstring), read
    back on the host.

    On CUDA the all-reduce runs on a side stream fed from pinned memory: the values depend on
    nothing the compute stream does, so the host waits for the collective alone, not for the
    backward still queued on the compute stream (a plain device tensor + ``tolist()`` would drain
    it, and the next kernels would start from an empty queue)."""
    def run(group: Any) -> list[int]:
        if device.type != "cuda":
            t = torch.tensor(list(values), dtype=torch.int64, device=device)
            dist.all_reduce(t, group=group)
            return t.tolist()
        src = torch.tensor(list(values), dtype=torch.int64).pin_memory()
        out = torch.empty_like(src).pin_memory()
        side = side_stream(torch.device(device), "step_checks")
        with torch.cuda.stream(side):
            t = src.to(device, non_blocking=True)
            dist.all_reduce(t, group=group)
            out.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()
        return out.tolist()
    return _run(via, what, run)


#: the environment variable that sets :func:`join`'s bound (seconds), and its default
JOIN_ENV = "DMUON_JOIN_TIMEOUT_S"
JOIN_TIMEOUT_S = 30.0
_POISON = 1 << 40  # added to a join's arrival counter by a rank that gave up on it


class NotOnEveryRankError(RuntimeError):
    """A collective call was made on some ranks only (:func:`join`); raised on the ranks that
    made it, before anything was sent."""


def _join_error(what: str, detail: str) -> NotOnEveryRankError:
    return NotOnEveryRankError(not_on_every_rank(what, detail, JOIN_ENV))


def join(what: str) -> None:
    """Collective entry check, on the rendezvous store (no collective): return once every rank has
    entered this :func:`join` (``what``: the call as the user wrote it, ``"model.state_dict()"``);
    a failed join is not counted (the next call is a fresh attempt).

    Raises:
      NotOnEveryRankError: on the ranks that entered, when some rank did not come within
        ``DMUON_JOIN_TIMEOUT_S`` seconds (default 30) or its process is gone (its heartbeat,
        :mod:`dmuon.compat.heartbeat`, stopped); at once on a rank that comes after another gave up.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = default_store()
    if store is None:  # pragma: no cover - a torch without it: the collective itself decides
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    # the joins this rank completed on this store, kept in the store: a count kept in the process
    # by id(store) went stale when a new store reused a freed one's id on some ranks only (a
    # process group made again in one process), and those ranks waited on another join's keys
    done = f"dmuon/join/done/{rank}"
    seq = store.add(done, 0) + 1
    bound = float(os.environ.get(JOIN_ENV, JOIN_TIMEOUT_S))
    base = f"dmuon/join/{seq}"
    key = f"{base}.{store.add(base + '/attempt', 0)}"
    with contextlib.suppress(Exception):  # a store without append: the message names no ranks
        store.append(key + "/ranks", f"{rank},")
    n = store.add(key + "/n", 1)
    if n >= _POISON:
        raise _join_error(what, f"another rank gave up waiting for this one at this call "
                          f"after {bound:g} s (this is rank {rank})")
    if n == world:
        store.set(key + "/go", "ok")
    deadline, nap, watch, gone = time.monotonic() + bound, 0.001, PeerWatch(store), []
    while not store.check([key + "/go"]):  # a peer whose heartbeat stopped ends it at once
        if time.monotonic() > deadline or deadline < math.inf and (
                gone := watch.gone(lambda: _missing(store, key, world))):
            v = store.add(key + "/n", _POISON)
            if v % _POISON < world:  # not everyone came: abort this attempt for all
                store.set(key + "/go", "abort")
                if v // _POISON == 1:
                    store.add(base + "/attempt", 1)
                break
            deadline = math.inf  # the last rank came just now: its "ok" follows
        time.sleep(nap)
        nap = min(2 * nap, 0.05)
    if store.get(key + "/go") != b"ok":
        raise _join_error(what, f"rank(s) {gone} stopped running (no heartbeat for "
                          f"{watch.bound:g} s: exited, killed or frozen; see its log)" if gone else
                          f"rank(s) {_missing(store, key, world) or '?'} did not reach it within "
                          f"{bound:g} s (this is rank {rank})")
    store.add(done, 1)


def _missing(store: Any, key: str, world: int) -> list[int]:
    """The ranks that have not entered join attempt ``key`` (``[]``: unknown)."""
    with contextlib.suppress(Exception):  # a store without append
        return sorted(set(range(world)) - set(map(int, store.get(f"{key}/ranks").split(b",")[:-1])))
    return []
