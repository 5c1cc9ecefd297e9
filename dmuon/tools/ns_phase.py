"""Time of the owners' optimizer phase on every rank: Newton–Schulz of whole and split units.

Each rank computes, on one compute resource, its whole units (one task each: the NS of its
matrices, :func:`~dmuon.tools.machine.ns_matrix_seconds`) and the pieces of its split units.
A piece is a chain: compute segment, collective, compute segment, ... (exact flops per segment from
:func:`~dmuon.functional.split_ns.split_piece_segments`, timed at the whole matrix's rate); a
collective starts when every member of its group has finished the segment before it and every
member's link is free, and lasts :func:`~dmuon.tools.machine.collective_time` (NVLink: a split
stays in one node). While a piece waits for a collective its rank computes other ready work
(list scheduling, deterministic priorities: split segments first in unit-name order, then whole
units by cost), so split communication overlaps other NS work where there is some. As the
optimizer executes a split (:mod:`dmuon.functional.split_exec`), its chain starts with the owner's
scatter of the NS input and ends with the gather of the result, and the owner alone runs the
matrix's element-wise stages. (The runtime runs a rank's split units in unit order and blocks in
their collectives; the overlap modeled here is an upper bound on what it gets.)

Plus the owner's element-wise Muon work, ``fused_s_per_param`` per owned element (the momentum
stage before NS and the update after it, one task).

Returns per-rank finish times; the phase lasts their maximum (every rank's next forward waits for
the slowest owner's update through the forward broadcasts).
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Mapping, Sequence

from dmuon.tools.machine import Machine, collective_time, interp_log2, ns_matrix_seconds
from dmuon.functional.owner_plan import OwnerPlan
from dmuon.functional.specs import ParamSpec
from dmuon.functional.split_ns import split_ns_program, split_piece_segments

__all__ = ["NSPhase", "ns_phase", "owner_work_by_group", "reference_slowdown"]


@dataclass(frozen=True)
class NSPhase:
    """Per-rank results of the owners' phase.

    Attributes:
      finish: seconds until each rank's last NS / element-wise work ends.
      compute: seconds each rank computes (its busy time).
      split_comm: seconds of split collectives each rank takes part in.
      split_units: number of split units.
      elementwise: seconds of each rank's element-wise Muon work (part of ``compute``).
    """

    finish: tuple[float, ...]
    compute: tuple[float, ...]
    split_comm: tuple[float, ...]
    split_units: int
    elementwise: tuple[float, ...] = ()

    @property
    def seconds(self) -> float:
        return max(self.finish) if self.finish else 0.0

    @property
    def imbalance(self) -> float:
        """``max / mean`` of the per-rank finish times."""
        mean = sum(self.finish) / len(self.finish) if self.finish else 0.0
        return self.seconds / mean if mean else 1.0


def reference_slowdown(machine: Machine, hidden: int) -> float:
    """The reference implementation's NS time over dmuon's at model width ``hidden``
    (``machine.ref_ns_slowdown`` interpolated in ``log2(hidden)``, clamped)."""
    return interp_log2([(float(h), f) for h, f in machine.ref_ns_slowdown], float(hidden))


def ns_phase(plan: OwnerPlan, specs: Sequence[ParamSpec], machine: Machine, *, steps: int = 5,
             slowdown: float = 1.0, elementwise_s_per_param: float | None = None) -> NSPhase:
    """Simulate the owners' phase of one step (module docstring).

    Args:
      plan: the owner plan (split units included); specs: its specs.
      machine: the machine model; steps: NS iterations.
      slowdown: factor on every NS compute time (1: dmuon's engine; the reference: see
        :func:`reference_slowdown`).
      elementwise_s_per_param: seconds per owned element of element-wise work (default
        ``machine.fused_s_per_param``).
    """
    by_name: Mapping[str, ParamSpec] = {s.name: s for s in specs}
    n = plan.num_slots
    ew = machine.fused_s_per_param if elementwise_s_per_param is None else elementwise_s_per_param
    split_of = {b.name: sp for sp in plan.splits for b in sp.blocks}
    tasks: list[list[tuple]] = [[] for _ in range(n)]      # per rank: (priority, chain id)
    chains: dict[str, list[float]] = {}                    # compute segment durations
    owned = [0] * n
    for unit, slot in zip(plan.units, plan.unit_slots):
        for p in unit.params:
            if p not in split_of:
                owned[slot] += by_name[p].numel
        whole = [p for p in unit.params if p not in split_of]
        if whole:
            sec = sum(b * ns_matrix_seconds(machine, m, n, steps=steps)
                      for p in whole for b, m, n in by_name[p].matrix_view.blocks(by_name[p].shape))
            cid = f"w:{unit.name}"
            chains[cid] = [sec * slowdown]
            tasks[slot].append(((1, -sec, unit.name), cid))
    collectives: dict[str, list[tuple[float, tuple[int, ...]]]] = {}
    for sp in plan.splits:
        lay, restart = sp.layout, (machine.ns_restart if sp.variant == "gram" else None)
        program = split_ns_program(lay.m, steps, sp.variant, restart)
        members = sp.members
        nodes = len({m // machine.gpus_per_node for m in members})
        per_node = max(1, len(members) // nodes)
        itemsize = 2                                       # fp16 / bf16 compute dtype
        # executed (dmuon.functional.split_exec): the owner scatters the fp32 NS input's blocks
        # first and gathers the result blocks last ((k-1)/k of the matrix each, timed as a ring)
        move = (collective_time(machine, "all_gather", lay.m * lay.n * 4, len(members),
                                members_per_node=per_node, nodes=nodes), members)
        collectives[sp.param] = [move] + [
            (collective_time(machine, c.kind, c.numel * (4 if c.acc else itemsize), len(members),
                             members_per_node=per_node, nodes=nodes), members)
            for c in program] + [move]
        whole_s = ns_matrix_seconds(machine, lay.m, lay.n, steps=steps)
        whole_f = sum(sum(split_piece_segments(lay, i, steps, sp.variant, restart))
                      for i in range(lay.k))
        for i, blk in enumerate(sp.blocks):
            segs = split_piece_segments(lay, i, steps, sp.variant, restart)
            cid = f"s:{sp.param}:{i}"
            chains[cid] = [0.0] + [whole_s * f / whole_f * slowdown for f in segs] + [0.0]
            tasks[blk.slot].append(((0, sp.param, i), cid))
        owned[sp.blocks[0].slot] += by_name[sp.param].numel   # the owner's element-wise stages
    for r in range(n):
        if owned[r]:
            chains[f"e:{r}"] = [owned[r] * ew]
            tasks[r].append(((2, 0.0, ""), f"e:{r}"))
    res = _simulate(n, tasks, chains, collectives, len(plan.splits))
    return dataclasses.replace(res, elementwise=tuple(o * ew for o in owned))


def owner_work_by_group(plan: OwnerPlan, specs: Sequence[ParamSpec], machine: Machine, *,
                        steps: int = 5, slowdown: float = 1.0,
                        elementwise_s_per_param: float | None = None) -> list[dict[str, float]]:
    """Per rank, ``{layer key ("" outside blocks): seconds}`` of its whole units' owner work: the
    NS of :func:`ns_phase` (times ``slowdown``) and the element-wise stages of its owned elements
    (the overlapped owners' phase, :mod:`dmuon.tools.ns_overlap`; split units are not counted)."""
    by_name: Mapping[str, ParamSpec] = {s.name: s for s in specs}
    ew = machine.fused_s_per_param if elementwise_s_per_param is None else elementwise_s_per_param
    split = {b.name for sp in plan.splits for b in sp.blocks}
    out: list[dict[str, float]] = [{} for _ in range(plan.num_slots)]
    for unit, slot in zip(plan.units, plan.unit_slots):
        for p in unit.params:
            if p in split:
                continue
            s = by_name[p]
            sec = slowdown * sum(b * ns_matrix_seconds(machine, m, n, steps=steps)
                                 for b, m, n in s.matrix_view.blocks(s.shape)) + s.numel * ew
            key = s.layer_key or ""
            out[slot][key] = out[slot].get(key, 0.0) + sec
    return out


def _simulate(n: int, tasks, chains, collectives, n_split: int) -> NSPhase:
    ready: list[list] = [sorted(t) for t in tasks]        # heaps of (priority, chain id)
    for h in ready:
        heapq.heapify(h)
    pos = {cid: 0 for cid in chains}                       # next segment index per chain
    busy = [False] * n
    finish = [0.0] * n
    compute = [0.0] * n
    comm = [0.0] * n
    link = [0.0] * n
    arrived: dict[tuple[str, int], list[float]] = {}
    events: list[tuple] = []
    seq = 0

    def push(t, kind, payload):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    def start(r: int, t: float) -> None:
        if busy[r] or not ready[r]:
            return
        prio, cid = heapq.heappop(ready[r])
        d = chains[cid][pos[cid]]
        busy[r] = True
        compute[r] += d
        push(t + d, "done", (r, prio, cid))

    for r in range(n):
        start(r, 0.0)
    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "done":
            r, prio, cid = payload
            busy[r] = False
            finish[r] = max(finish[r], t)
            j = pos[cid]
            pos[cid] = j + 1
            if cid.startswith("s:") and j < len(chains[cid]) - 1:
                _, param, _ = cid.split(":", 2)
                dur, members = collectives[param][j]
                got = arrived.setdefault((param, j), [])
                got.append(t)
                if len(got) == len(members):
                    t0 = max([t] + [link[m] for m in members])
                    for m in members:
                        link[m] = t0 + dur
                        comm[m] += dur
                    push(t0 + dur, "coll", (param, j, prio))
            start(r, t)
        else:
            param, j, prio = payload
            for i, m in enumerate(collectives[param][j][1]):
                cid = f"s:{param}:{i}"
                heapq.heappush(ready[m], ((0, param, i), cid))
                start(m, t)
    return NSPhase(tuple(finish), tuple(compute), tuple(comm), n_split)
