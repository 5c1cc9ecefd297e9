"""Per-rank collective orders, and the check that they cannot deadlock (pure).

Every rank issues the collectives it takes part in, in its own order. A collective completes once
every member of its group has issued it; a rank that issued one waits for it before its next
collective *of the same lane* (each lane has its own process groups and, on CUDA, its own stream,
so lanes progress independently unless an op ``waits`` on another; ``lanes_async=False`` models
one blocking sequence per rank instead). If some ranks issue collectives of one process group in
different orders, they wait for each other forever (NCCL, gloo's timeout) or, worse, match the
wrong collectives. :func:`check_orders` plays the per-rank orders against each other and either
finds them all completing or raises :class:`DeadlockError` naming, per stuck rank, the collective it
waits in and the members that have not reached it.

* :func:`rank_orders` — each rank's sequence of one schedule's ops (those it takes part in);
* :func:`check_orders` — the deadlock check of any per-rank orders.

The runtime issues the step program's phases in one fixed order on every rank (forward order for
gathers, the reverse for the gradient reduces, whatever order the gradients arrive in), so
``check_orders(rank_orders(program.step_schedule()))`` passes for every mode; a rank that reduced
in its own gradient-arrival order would not (``tests/test_order_check.py`` plants one).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from dmuon.functional.schedule import Op, Schedule, op_members

__all__ = ["DeadlockError", "rank_orders", "check_orders", "op_group"]


class DeadlockError(RuntimeError):
    """Per-rank collective orders that cannot all complete (the message names the ops and ranks).

    Attributes:
      stuck: ``{rank: op id it waits in}`` at the point where nothing can progress.
    """

    def __init__(self, message: str, stuck: Mapping[int, str]):
        super().__init__(message)
        self.stuck = dict(stuck)


def op_group(op: Op, shard_size: int, replicate_size: int, rank: int) -> tuple[int, ...] | None:
    """The global ranks (``r * G + s``; explicit groups: ``members``) of ``op``'s group that holds
    ``rank``, or ``None`` when ``rank`` takes no part."""
    G = shard_size
    if op.axis == "group":
        return tuple(op.members) if rank in op.members else None
    for group in op_members(op, shard_size, replicate_size):
        ranks = tuple(r * G + s for s, r in group)
        if rank in ranks:
            return ranks
    return None


def rank_orders(schedule: Schedule) -> dict[int, list[Op]]:
    """``{rank: the ops of schedule it takes part in, in schedule order}`` (groups of one
    included: they complete at once)."""
    W = schedule.world_size
    if any(op.axis == "group" for op in schedule):
        W = max(W, 1 + max(m for op in schedule if op.axis == "group" for m in op.members))
    return {r: [op for op in schedule
                if op_group(op, schedule.shard_size, schedule.replicate_size, r) is not None]
            for r in range(W)}


def check_orders(orders: Mapping[int, Sequence[Op]], shard_size: int, replicate_size: int = 1, *,
                 lanes_async: bool = True) -> int:
    """Play per-rank orders against each other; return how many collectives completed.

    Args:
      orders: ``{rank: its ops in issue order}`` (ids unique per rank; ``waits`` name earlier ops of
        the same rank's order).
      shard_size, replicate_size: the mesh the ops address.
      lanes_async: lanes progress independently (the executor); ``False``: one blocking sequence
        per rank.

    Raises:
      DeadlockError: no collective can complete while some rank still has ops to issue; the message
        names each stuck rank's op and the members that never reach it (or reach another op).
      ValueError: an op's group does not hold a rank whose order lists it.
    """
    G, R = shard_size, replicate_size
    seqs = {r: list(ops) for r, ops in orders.items()}
    pos = {r: {} for r in seqs}                       # {rank: {lane: index into its lane list}}
    lanes = {r: {} for r in seqs}                     # {rank: {lane: [ops]}}
    done: dict[int, set[str]] = {r: set() for r in seqs}
    for r, ops in seqs.items():
        for op in ops:
            if op_group(op, G, R, r) is None:
                raise ValueError(f"rank {r}'s order lists {op.id!r}, whose group does not hold it")
            lane = op.lane if lanes_async else "*"
            lanes[r].setdefault(lane, []).append(op)
            pos[r].setdefault(lane, 0)

    def current(r: int) -> list[Op]:
        return [lanes[r][ln][i] for ln, i in pos[r].items() if i < len(lanes[r][ln])]

    completed = 0
    while True:
        progressed = False
        for r in seqs:
            for op in current(r):
                if any(w not in done[r] for w in op.waits):
                    continue
                group = op_group(op, G, R, r)
                ready = all(any(o.id == op.id and o.bucket == op.bucket and
                                all(w in done[m] for w in o.waits) for o in current(m))
                            for m in group if m in seqs)
                if not ready or any(m not in seqs for m in group):
                    continue
                for m in group:
                    ln = op.lane if lanes_async else "*"
                    pos[m][ln] += 1
                    done[m].add(op.id)
                completed += 1
                progressed = True
        left = {r: current(r) for r in seqs if current(r)}
        if not left:
            return completed
        if not progressed:
            lines, stuck = [], {}
            for r, ops in sorted(left.items()):
                op = ops[0]
                group = op_group(op, G, R, r) or ()
                elsewhere = {m: [o.id for o in current(m)] for m in group if m != r and m in seqs
                             and not any(o.id == op.id for o in current(m))}
                stuck[r] = op.id
                others = "; ".join(f"rank {m} is in {ids or 'nothing'}"
                                   for m, ids in elsewhere.items())
                lines.append(f"rank {r} waits in {op.id!r} (lane {op.lane}, ranks {list(group)})"
                             + (f"; {others}" if others else ""))
            raise DeadlockError("collective orders deadlock (the ranks of a process group issue "
                                "its collectives in different orders): " + "; ".join(lines), stuck)
