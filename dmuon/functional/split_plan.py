"""Owner plans that split the Newton–Schulz of the largest matrices over several ranks of one node.

When a few matrices cost more than the mean slot (Llama-3.1-70B on 512 ranks: 240 MLP matrices
of 8192 x 28672 over 512 slots), no assignment of whole matrices can balance the step. A *split
unit* spreads one matrix over ``k`` ranks exactly (:mod:`dmuon.functional.split_ns`): rank ``i``
owns column block ``i`` of the wide orientation (a row block of a tall param, a column block of a
wide one) — its master, momentum and gradient — and does ``1/k`` of every NS product; the blocks
are ordinary entries of the bucket layout (so the forward broadcasts and gradient reduces of the
schedule carry them unchanged) and the NS adds the ``m x m`` collectives of
:func:`~dmuon.functional.split_ns.split_ns_schedule` on lane ``"split"``.

Piece cost (same units as :func:`~dmuon.functional.plan.param_cost`)::

    cost_i = flops_i + flops_per_byte * nbytes_i
             + SPLIT_COMM_FLOPS_PER_BYTE * ring bytes per rank + SPLIT_COLLECTIVE_FLOPS * collectives

``flops_i`` from :func:`~dmuon.functional.split_ns.split_piece_flops` (they sum to the matrix's
count), ring bytes with m x m buffers in 2-byte compute dtype and 4-byte Gram sums.

Algorithm (deterministic). From the whole-matrix plan and ``mean0`` = its mean slot cost, for each
target ``tau = f * mean0`` (``f`` in :data:`TARGET_FACTORS`): every single-matrix unit (``B = 1``)
costing more than ``tau`` is split into the smallest ``k <= min(max_split, node_size)`` whose
largest piece costs at most ``tau`` (else the largest ``k``); also, for ``k`` in
:data:`PARTIAL_FACTORS` and ``share`` in :data:`PARTIAL_SHARES`, the largest ``share`` of the
single-matrix units split ``k`` ways. For each such candidate the items are placed in order of
``(-largest piece cost, name)``: a whole unit on the least-loaded slot, a split unit's pieces on
the ``k`` least-loaded slots of the node where the largest resulting load is smallest (the largest
piece on the least-loaded slot); then a local search moves or swaps whole units off the most
loaded slot while that lowers the pair's larger load. The candidate with the lowest score wins
(default: its maximum slot cost; ``plan_owners(split_score=...)``, e.g. the projected step time);
ties keep the earlier candidate, the whole-matrix plan first, so it is kept unless beaten.

The optimizer executes split units (``dedicate_params(..., split_ns=...)``,
:mod:`dmuon.functional.split_exec`): the matrix stays whole on its owner, block 0's rank
(:func:`runtime_owners`), which scatters the NS input's blocks to the unit's members and gathers
the result blocks back. The costs above are of that execution: block 0 also carries the bytes of
the rest of the matrix, and every piece the scatter and gather of its block.
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from dmuon.newton_schulz.matrix_shape import as_matrix_shape
from dmuon.newton_schulz.cost import DEFAULT_GRAM_RESTART, choose_ns_variant
from dmuon.functional.owner_plan import OwnerPlan, assemble_plan
from dmuon.functional.plan_units import AllocationUnit
from dmuon.functional.specs import ParamSpec
from dmuon.functional.split_ns import (SplitLayout, ring_bytes_per_rank, split_layout, split_ns_program,
                                       split_piece_flops)

__all__ = ["SplitBlock", "SplitUnit", "plan_splits", "block_name", "split_unit_cost", "owner_entries",
           "SPLIT_COMM_FLOPS_PER_BYTE", "SPLIT_COLLECTIVE_FLOPS", "TARGET_FACTORS", "SPLIT_NOTE",
           "runtime_owners", "executed_entries"]

#: Flops-equivalent charged per byte a split piece moves: a quarter of the H200's 787 TFLOP/s
#: (measured, benchmarks/results/ns_whole_model_h200.json) over ~384 GB/s of NVLink bus bandwidth
#: (an assumption: 85 % of the 450 GB/s per direction of NVIDIA's H200 spec), i.e. 2048 / 4: the
#: share of split traffic assumed exposed, since a rank that holds several pieces computes one
#: while another's collectives run (benchmarks/NOTES_scale.md).
SPLIT_COMM_FLOPS_PER_BYTE = 512
#: Flops-equivalent charged per byte of the executed split's scatter and gather (out of and into
#: the owner): all of it, 787 TFLOP/s over ~384 GB/s (the assumptions above), since the owner's
#: runtime waits for them (:mod:`dmuon.functional.split_exec`).
EXEC_FLOPS_PER_BYTE = 2048
#: Flops-equivalent of one collective's latency: ~25 us (assumed) at 787 TFLOP/s.
SPLIT_COLLECTIVE_FLOPS = 2 * 10**10
#: Targets tried, as multiples of the whole-matrix plan's mean slot cost.
TARGET_FACTORS = (0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0)
#: Partial splits tried too: the first ``share`` of the candidates (largest first) split ``k`` ways,
#: for every ``k`` and ``share`` below (fills idle slots when whole units outnumber them unevenly).
PARTIAL_FACTORS = (2, 3, 4)
PARTIAL_SHARES = (0.25, 1 / 3, 0.5, 2 / 3, 0.75)
#: What every plan report says about split units.
SPLIT_NOTE = ("split units are executed by the optimizer with dedicate_params(..., split_ns=k): "
              "the matrix stays on block 0's rank, which scatters the NS input's blocks and "
              "gathers the result")


def block_name(param: str, index: int, k: int) -> str:
    """Owner-map name of block ``index`` of ``k`` of ``param``: ``"<param>@split<index>of<k>"``."""
    return f"{param}@split{index}of{k}"


@dataclass(frozen=True)
class SplitBlock:
    """One rank's block of a split matrix: ``param[start:stop]`` along ``SplitUnit.dim``.

    Attributes:
      name: its owner-map name (:func:`block_name`); slot: the global rank that owns it.
      start, stop: the range along the split dimension of the param; shape: the block's shape.
      flops: its NS flops; cost: its plan cost (module docstring).
    """

    name: str
    slot: int
    start: int
    stop: int
    shape: tuple[int, ...]
    flops: int
    cost: int


@dataclass(frozen=True)
class SplitUnit:
    """A matrix whose NS runs over ``k`` ranks.

    Attributes:
      param: the param name; shape, dtype, layer_key: its spec's.
      dim: the param dimension that is split (its long side: 0 for a tall param, whose wide
        orientation is its transpose, 1 for a wide one).
      variant: ``"direct"`` or ``"gram"``; gram_restart: the period the costs assume.
      layout: the :class:`~dmuon.functional.split_ns.SplitLayout` (``m`` = short side).
      blocks: in block order (block ``i`` = column block ``i`` of the wide orientation).
    """

    param: str
    shape: tuple[int, ...]
    dtype: str
    layer_key: str | None
    dim: int
    variant: str
    gram_restart: int | None
    layout: SplitLayout
    blocks: tuple[SplitBlock, ...]

    @property
    def k(self) -> int:
        return len(self.blocks)

    @property
    def members(self) -> tuple[int, ...]:
        """Global ranks of the blocks, in block order (the split schedule's group)."""
        return tuple(b.slot for b in self.blocks)

    def canonical(self) -> list:
        """Plain data for the plan fingerprint."""
        return [self.param, self.dim, self.variant, [[b.name, b.slot, b.start, b.stop] for b in self.blocks]]


def split_unit_cost(spec: ParamSpec, k: int, *, ns_steps: int, ns_variant: str, flops_per_byte: int
                    ) -> tuple[SplitLayout, str, int, list[tuple[int, int, tuple[int, ...], int, int]]]:
    """``(layout, variant, dim, pieces)`` of splitting ``spec`` (one matrix) ``k`` ways; each piece
    ``(start, stop, shape, flops, cost)`` (module docstring)."""
    _, rows, cols = as_matrix_shape(spec.shape, spec.batch_dims)
    layout = split_layout(rows, cols, k)
    variant = (choose_ns_variant(rows, cols, ns_steps) if ns_variant == "auto" else ns_variant)
    restart = DEFAULT_GRAM_RESTART if variant == "gram" else None
    program = split_ns_program(layout.m, ns_steps, variant, restart)
    comm = (SPLIT_COMM_FLOPS_PER_BYTE * ring_bytes_per_rank(program, k, 2, 4)
            + SPLIT_COLLECTIVE_FLOPS * len(program))
    dim = 0 if rows > cols else 1
    itemsize = spec.itemsize
    whole = rows * cols * itemsize
    pieces = []
    for i, ((c0, c1), f) in enumerate(zip(layout.col_ranges,
                                          split_piece_flops(layout, ns_steps, variant, restart))):
        shape = (c1 - c0, cols) if dim == 0 else (rows, c1 - c0)
        nbytes = math.prod(shape) * itemsize
        # executed (split_exec): block 0's rank owns the whole matrix and scatters / gathers the
        # other blocks (4-byte masters: what the runtime's NS input is)
        held = whole if i == 0 else nbytes
        moved = 2 * ((whole - nbytes) if i == 0 else nbytes) * 4 // itemsize
        pieces.append((c0, c1, shape, f, f + flops_per_byte * held + math.ceil(comm)
                       + EXEC_FLOPS_PER_BYTE * moved))
    return layout, variant, dim, pieces


def _place(items, n: int, node_size: int) -> tuple[list[int], dict[str, tuple[int, ...]]]:
    """Greedy placement (module docstring). ``items``: ``(name, [piece costs])``; returns loads and
    ``{name: slots}`` (one slot per piece, in piece order)."""
    load = [0] * n
    where: dict[str, tuple[int, ...]] = {}
    nodes = [sorted((0, s) for s in range(j, min(j + node_size, n))) for j in range(0, n, node_size)]
    node_of = [s // node_size for s in range(n)]
    heap = [(0, s) for s in range(n)]                      # (load, slot), lazily updated

    def add(slot: int, cost: int) -> None:
        lst = nodes[node_of[slot]]
        lst.remove((load[slot], slot))
        load[slot] += cost
        bisect.insort(lst, (load[slot], slot))
        heapq.heappush(heap, (load[slot], slot))

    for name, costs in sorted(items, key=lambda it: (-max(it[1]), it[0])):
        if len(costs) == 1:
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            k = heap[0][1]
            add(k, costs[0])
            where[name] = (k,)
            continue
        order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
        best = None
        for lst in nodes:
            if len(lst) < len(costs):
                continue
            peak = max(lst[t][0] + costs[i] for t, i in enumerate(order))
            if best is None or peak < best[0]:
                best = (peak, [sl for _, sl in lst[:len(costs)]])
        assert best is not None  # callers keep k <= node_size and k <= n
        slots = [0] * len(costs)
        for sl, i in zip(best[1], order):
            slots[i] = sl
        for sl, i in zip(best[1], order):
            add(sl, costs[i])
        where[name] = tuple(slots)
    return load, where


def _local_search(load: list[int], where: dict[str, tuple[int, ...]], cost: dict[str, int],
                  movable: Sequence[str], max_steps: int) -> None:
    """Move or swap whole units off the most-loaded slot while that lowers the pair's larger load."""
    members: list[list[str]] = [[] for _ in load]
    for name in movable:
        members[where[name][0]].append(name)
    for _ in range(max_steps):
        a = max(range(len(load)), key=lambda s: (load[s], -s))
        la = load[a]
        best = None
        by_load = sorted(range(len(load)), key=lambda s: (load[s], s))
        for i in sorted(members[a]):
            ci = cost[i]
            for b in by_load:
                lb = load[b]
                if lb + 1 > la or b == a:
                    continue
                for j in [None] + sorted(members[b]):
                    d = ci - (0 if j is None else cost[j])
                    if d <= 0:
                        continue
                    peak = max(la - d, lb + d)
                    key = (peak, b, i, j or "")
                    if peak < la and (best is None or key < best[0]):
                        best = (key, b, i, j)
        if best is None:
            return
        _, b, i, j = best
        members[a].remove(i)
        members[b].append(i)
        where[i] = (b,)
        load[a] -= cost[i]
        load[b] += cost[i]
        if j is not None:
            members[b].remove(j)
            members[a].append(j)
            where[j] = (a,)
            load[b] -= cost[j]
            load[a] += cost[j]


def plan_splits(specs: Sequence[ParamSpec], base: OwnerPlan, *, max_split: int, node_size: int,
                local_search_steps: int,
                score: Optional[Callable[[OwnerPlan], float]] = None,
                force: Optional[dict[str, int]] = None) -> OwnerPlan:
    """``base`` (a whole-matrix plan of ``specs``) or, when one scores lower, a plan with split
    units (module docstring). ``score(plan)`` ranks the candidates (default: the maximum slot
    cost; the projector passes the simulated NS-phase time); ties keep the earlier candidate, the
    whole-matrix plan first. Settings ``max_split`` and ``node_size`` enter the fingerprint of the
    returned plan either way. ``force``: ``{param: k}`` splits to take whatever they score (tests
    and experiments; the only candidate then)."""
    g, r = base.shard_size, base.replicate_size
    n = g * r
    settings = {**dict(base.params), "max_split": max_split, "node_size": node_size}
    kmax = min(max_split, node_size, n)
    by_name = {s.name: s for s in specs}
    fpb, steps, var = base.params["flops_per_byte"], base.params["ns_steps"], base.params["ns_variant"]
    mean0 = sum(base.slot_costs) / n
    # whole single matrices only (a Heads / Split / Transposed view is never split across ranks)
    candidates = [u for u in base.units if len(u.params) == 1 and u.matrices == 1
                  and by_name[u.name].view is None]
    options: dict[tuple[str, int], tuple] = {}

    def option(u: AllocationUnit, k: int):
        if (u.name, k) not in options:
            options[(u.name, k)] = split_unit_cost(by_name[u.name], k, ns_steps=steps, ns_variant=var,
                                                   flops_per_byte=fpb)
        return options[(u.name, k)]

    def k_for(u: AllocationUnit, tau: float) -> int:
        _, rows, cols = as_matrix_shape(by_name[u.name].shape)
        k = 2
        for k in range(2, min(kmax, rows, cols) + 1):
            if max(p[4] for p in option(u, k)[3]) <= tau:
                break
        return k

    trials: list[dict[str, int]] = []
    if force:
        ok = {u.name: u for u in candidates}
        for name, k in force.items():
            if name not in ok:
                raise ValueError(f"split_ns: {name!r} cannot be split: only whole single matrices "
                                 f"without a matrix view can (candidates: {sorted(ok)[:6]})")
            _, rows, cols = as_matrix_shape(by_name[name].shape)
            if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= min(node_size, n, rows, cols):
                raise ValueError(f"split_ns: {name!r} split {k!r} ways: k must be an int in "
                                 f"[2, min(node_size, ranks, rows, cols) = "
                                 f"{min(node_size, n, rows, cols)}]")
        trials.append(dict(force))
    for f in TARGET_FACTORS if kmax > 1 and not force else ():
        tau = f * mean0
        trials.append({u.name: k_for(u, tau) for u in candidates if u.cost > tau})
    for k in PARTIAL_FACTORS if kmax > 1 and not force else ():
        for q in PARTIAL_SHARES:
            if k <= kmax:
                top = candidates[:math.ceil(q * len(candidates))]
                trials.append({u.name: k for u in top
                               if min(as_matrix_shape(by_name[u.name].shape)[1:]) >= k})
    whole_plan = assemble_plan(specs, g, r, base.units, base.unit_slots, strategy=base.strategy,
                               lpt_max=base.lpt_max_cost, rr_max=base.round_robin_max_cost,
                               layer_collisions=base.layer_collisions, settings=settings)
    rank = score if score is not None else (lambda p: float(max(p.slot_costs)))
    best, best_score = whole_plan, rank(whole_plan)
    seen = set()
    for chosen in trials:
        key = tuple(sorted(chosen.items()))
        if not chosen or key in seen:
            continue
        seen.add(key)
        items = [(u.name, [p[4] for p in option(u, chosen[u.name])[3]] if u.name in chosen else [u.cost])
                 for u in base.units]
        load, where = _place(items, n, node_size)
        whole = [u.name for u in base.units if u.name not in chosen]
        _local_search(load, where, {u.name: u.cost for u in base.units}, whole, local_search_steps)
        plan = _assemble_split(specs, base, chosen, where, option, settings)
        sc = rank(plan)
        if sc < best_score or force:
            best, best_score = plan, sc
    return best


def _assemble_split(specs, base: OwnerPlan, chosen, where, option, settings) -> OwnerPlan:
    by_name = {s.name: s for s in specs}
    units, slots, splits = [], [], []
    for u in base.units:
        if u.name not in chosen:
            units.append(u)
            slots.append(where[u.name][0])
            continue
        spec = by_name[u.name]
        layout, variant, dim, pieces = option(u, chosen[u.name])
        k = len(pieces)
        blocks = []
        for i, ((start, stop, shape, fl, c), slot) in enumerate(zip(pieces, where[u.name])):
            name = block_name(u.name, i, k)
            blocks.append(SplitBlock(name, slot, start, stop, shape, fl, c))
            held = math.prod(spec.shape) if i == 0 else math.prod(shape)  # block 0: the master
            units.append(AllocationUnit(name, (name,), u.layer_key, fl, held * spec.itemsize, c, 1))
            slots.append(slot)
        splits.append(SplitUnit(u.name, spec.shape, spec.dtype, spec.layer_key, dim, variant,
                                DEFAULT_GRAM_RESTART if variant == "gram" else None, layout,
                                tuple(blocks)))
    order = sorted(range(len(units)), key=lambda i: (-units[i].cost, units[i].name))
    layer_slots: dict[tuple[str, int], int] = {}
    for u, s in zip(units, slots):
        if u.layer_key is not None:
            layer_slots[(u.layer_key, s)] = layer_slots.get((u.layer_key, s), 0) + 1
    collisions = sum(c - 1 for c in layer_slots.values() if c > 1)
    return assemble_plan(specs, base.shard_size, base.replicate_size, [units[i] for i in order],
                         [slots[i] for i in order], strategy="lpt+split", lpt_max=base.lpt_max_cost,
                         rr_max=base.round_robin_max_cost, layer_collisions=collisions,
                         settings=settings, splits=tuple(sorted(splits, key=lambda s: s.param)))


def owner_entries(plan: OwnerPlan, specs: Sequence[ParamSpec]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{owner-map name: (shape, dtype)}`` of ``plan``: every whole dedicated param, and every
    block of a split one (its block shape), ready for
    :func:`~dmuon.functional.buckets.bucket_layout`: the planned block layout, which the
    simulator can run; the optimizer executes :func:`executed_entries`."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    split = {sp.param: sp for sp in plan.splits}
    for s in specs:
        if s.route != "muon":
            continue
        if s.name in split:
            for b in split[s.name].blocks:
                out[b.name] = (b.shape, s.dtype)
        else:
            out[s.name] = (s.shape, s.dtype)
    return out


def runtime_owners(plan: OwnerPlan) -> dict[str, tuple[int, int]]:
    """``{param: (s, r)}`` as the optimizer runs ``plan``: whole params at their owner, a split
    param whole at its block 0's rank (:mod:`dmuon.functional.split_exec`)."""
    blocks = {b.name for sp in plan.splits for b in sp.blocks}
    out = {n: c for n, c in plan.owners.items() if n not in blocks}
    for sp in plan.splits:
        out[sp.param] = plan.coord_of(sp.blocks[0].slot)
    return dict(sorted(out.items()))


def executed_entries(plan: OwnerPlan, specs: Sequence[ParamSpec]
                     ) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[tuple[int, ...], str]]]:
    """``(owners, {name: (shape, dtype)})`` of every dedicated param as the optimizer places them
    (:func:`runtime_owners`: a split matrix whole on its block 0's rank), ready for
    :func:`~dmuon.functional.program.step_program`."""
    owners = runtime_owners(plan)
    return owners, {s.name: (tuple(s.shape), s.dtype) for s in specs if s.name in owners}
