"""Owner planning: which rank orthogonalizes (and holds the master of) each dedicated matrix.

Every ``route == "muon"`` :class:`~dmuon.functional.specs.ParamSpec` gets one owner coordinate
``(s, r)`` on the ``(replicate R) x (shard G)`` mesh; its *slot* (= global rank) is ``r * G + s``.

Cost model (integers, so sums are exact and order-free)::

    cost(param) = sum_i ns_cost(m_i, n_i, ns_steps, variant=ns_variant, batch=B_i).flops
                  + flops_per_byte * nbytes

with ``(B_i, m_i, n_i)`` the blocks of the param's matrix view (:mod:`dmuon.functional.matrix_view`;
``Batch(batch_dims)`` by default: one block) and ``nbytes = numel * itemsize(dtype)``.
The first term is the Newton–Schulz work of the variant that will actually run (the same
:func:`~dmuon.newton_schulz.cost.ns_cost` the NS code uses to choose direct vs Gram). The second term
charges the owner's per-step element-wise and memory work (momentum, Nesterov input, casts, decay,
update of the fp32 master: about 6 bytes of HBM traffic per parameter byte) at the H200's ratio of
~780 TFLOP/s bf16 matmul to ~4.8 TB/s HBM (~160 flops per HBM byte): ``DEFAULT_FLOPS_PER_BYTE = 1024``.

Allocation units: a param whose cost is below ``small_unit_threshold`` times the largest param cost
is *small*; the small params of one layer are packed (in name order) into units of total cost at most
that bound, which then move together. Other params are units of their own.

Algorithm (deterministic: no RNG, no dependence on input order, rank, process or hash seed):

1. Units are sorted canonically by ``(-cost, name)``.
2. Longest-processing-time greedy over the ``G*R`` slots. Candidate = least-loaded slot of the
   least-loaded shard column (column balance first in HSDP; with ``R == 1`` simply the least-loaded
   slot); ties by index. Soft layer spread: if that slot already holds a unit of the same layer, the
   best slot among those holding the fewest units of that layer is taken instead, unless its load
   (or, in HSDP, its column's load) exceeds the candidate's by more than ``layer_spread_tolerance``
   times the mean slot (column) load.
3. Bounded local search: while the most-loaded slot has a move of one of its units to another slot,
   or a swap with a cheaper unit elsewhere, that lowers the larger of the two loads below the
   current maximum without raising the number of same-layer collisions or (HSDP) the maximum column
   load, apply the best such change (at most ``local_search_steps`` changes).
4. Round-robin (units in natural name order, unit ``i`` on slot ``i % (G*R)``) is computed too; the
   plan with the smaller maximum slot cost is returned (ties: the greedy), ``strategy`` says which.

Metrics: ``imbalance = max / mean`` slot cost and ``balance = max / max(mean, largest unit cost)``
(1.0 is optimal: no plan can beat either denominator).

References: R. Graham, "Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 17 (1969)
(LPT); K. Jordan et al., "Muon" (2024); the dedicated-ownership design in SPEC.md.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from dmuon.functional.plan_units import (DEFAULT_FLOPS_PER_BYTE, DEFAULT_SMALL_UNIT_THRESHOLD,
                                         AllocationUnit, build_units, natural_key, param_cost)
from dmuon.functional.owner_plan import Coord, OwnerPlan, assemble_plan
from dmuon.functional.specs import ParamSpec

__all__ = [
    "Coord",
    "AllocationUnit",
    "OwnerPlan",
    "plan_owners",
    "build_units",
    "param_cost",
    "natural_key",
    "DEFAULT_FLOPS_PER_BYTE",
    "DEFAULT_SMALL_UNIT_THRESHOLD",
    "DEFAULT_LAYER_SPREAD_TOLERANCE",
    "DEFAULT_LOCAL_SEARCH_STEPS",
    "PLAN_FORMAT_VERSION",
]


#: Soft layer-spread tolerance, as a fraction of the mean slot (column) load.
DEFAULT_LAYER_SPREAD_TOLERANCE = 0.02
#: Upper bound on local-search changes after the greedy.
DEFAULT_LOCAL_SEARCH_STEPS = 2000
#: Bumped whenever the algorithm changes what it returns for the same inputs (part of the fingerprint).
PLAN_FORMAT_VERSION = 1


# ----------------------------------------------------------------------------------------------------
# Greedy + local search


class _State:
    """Mutable working state of one planning run (private; never escapes ``plan_owners``)."""

    def __init__(self, g: int, r: int, units: Sequence[AllocationUnit]):
        self.g, self.r, self.n = g, r, g * r
        self.units = units
        self.load = [0] * self.n
        self.col = [0] * g
        self.where = [-1] * len(units)
        self.members: list[list[int]] = [[] for _ in range(self.n)]
        self.layer_count: list[dict[str, int]] = [{} for _ in range(self.n)]

    def place(self, i: int, slot: int) -> None:
        u = self.units[i]
        self.where[i] = slot
        self.load[slot] += u.cost
        self.col[slot % self.g] += u.cost
        self.members[slot].append(i)
        if u.layer_key is not None:
            d = self.layer_count[slot]
            d[u.layer_key] = d.get(u.layer_key, 0) + 1

    def remove(self, i: int) -> None:
        u, slot = self.units[i], self.where[i]
        self.load[slot] -= u.cost
        self.col[slot % self.g] -= u.cost
        self.members[slot].remove(i)
        if u.layer_key is not None:
            d = self.layer_count[slot]
            d[u.layer_key] -= 1
            if not d[u.layer_key]:
                del d[u.layer_key]
        self.where[i] = -1

    def lc(self, slot: int, key: Optional[str]) -> int:
        return 0 if key is None else self.layer_count[slot].get(key, 0)

    def best_slot(self, allowed=None) -> int:
        """Least-loaded slot of the least-loaded column having an allowed slot (ties: index)."""
        g = self.g
        for s in sorted(range(g), key=lambda s: (self.col[s], s)):
            cands = [r * g + s for r in range(self.r) if allowed is None or allowed(r * g + s)]
            if cands:
                return min(cands, key=lambda k: (self.load[k], k))
        raise AssertionError("no slot allowed")  # pragma: no cover


def _greedy(st: _State, tol: float) -> None:
    total = sum(u.cost for u in st.units)
    slot_tol = tol * total / st.n
    col_tol = tol * total / st.g
    layer_slots: dict[str, dict[int, int]] = {}
    for i, u in enumerate(st.units):
        best = st.best_slot()
        key = u.layer_key
        if key is not None:
            held = layer_slots.setdefault(key, {})
            c0 = 0 if len(held) < st.n else min(held.values())
            if held.get(best, 0) > c0:
                alt = st.best_slot(lambda k: held.get(k, 0) == c0)
                if (st.load[alt] <= st.load[best] + slot_tol
                        and st.col[alt % st.g] <= st.col[best % st.g] + col_tol):
                    best = alt
            held[best] = held.get(best, 0) + 1
        st.place(i, best)


def _local_search(st: _State, max_steps: int) -> int:
    """Move/swap units off the most-loaded slot while that strictly lowers the pair's max load."""
    units, g, hsdp = st.units, st.g, st.r > 1
    steps = 0
    while steps < max_steps:
        a = max(range(st.n), key=lambda k: (st.load[k], -k))
        la = st.load[a]
        colmax = max(st.col)
        best = None  # (new pair max, b, i, j)  j == -1: move
        for i in sorted(st.members[a]):
            ui = units[i]
            for b in range(st.n):
                if b == a:
                    continue
                lb = st.load[b]
                cross = hsdp and (a % g) != (b % g)
                # moves and swaps with every unit j on b (cheaper than i)
                for j in [-1] + st.members[b]:
                    cj = 0 if j < 0 else units[j].cost
                    d = ui.cost - cj
                    if d <= 0:
                        continue
                    na, nb = la - d, lb + d
                    m = max(na, nb)
                    if m >= la or (best is not None and (m, b, i, j) >= best):
                        continue
                    if cross and max(st.col[a % g] - d, st.col[b % g] + d) > colmax:
                        continue
                    kj = None if j < 0 else units[j].layer_key
                    if ui.layer_key != kj:
                        # never create a same-layer collision (a swap within one layer changes none)
                        if ui.layer_key is not None and st.lc(b, ui.layer_key) > 0:
                            continue
                        if kj is not None and st.lc(a, kj) > 0:
                            continue
                    best = (m, b, i, j)
        if best is None:
            break
        _, b, i, j = best
        st.remove(i)
        if j >= 0:
            st.remove(j)
            st.place(j, a)
        st.place(i, b)
        steps += 1
    return steps


def _collisions(st: _State) -> int:
    return sum(c - 1 for d in st.layer_count for c in d.values() if c > 1)


def _round_robin(units: Sequence[AllocationUnit], n: int) -> list[int]:
    order = sorted(range(len(units)), key=lambda i: natural_key(units[i].name))
    slots = [0] * len(units)
    for k, i in enumerate(order):
        slots[i] = k % n
    return slots


def _check_int(name: str, v: Any, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


def plan_owners(
    specs: Sequence[ParamSpec],
    shard_size: int,
    replicate_size: int = 1,
    *,
    ns_steps: int = 5,
    ns_variant: str = "auto",
    flops_per_byte: int = DEFAULT_FLOPS_PER_BYTE,
    small_unit_threshold: float = DEFAULT_SMALL_UNIT_THRESHOLD,
    layer_spread_tolerance: float = DEFAULT_LAYER_SPREAD_TOLERANCE,
    local_search_steps: int = DEFAULT_LOCAL_SEARCH_STEPS,
    max_split: int = 1,
    node_size: int = 8,
    split_score: Optional[Callable[["OwnerPlan"], float]] = None,
    force_split: Optional[dict[str, int]] = None,
) -> OwnerPlan:
    """Assign an owner ``(s, r)`` to every ``route == "muon"`` spec (see the module docstring).

    Args:
      specs: all param specs (AdamW ones are ignored by the assignment but enter the fingerprint).
      shard_size: ``G``, the shard group size; replicate_size: ``R`` (HSDP replicas, 1 for FSDP).
      ns_steps, ns_variant: Newton–Schulz iterations and variant, as the optimizer will run them.
      flops_per_byte: int flops-equivalent charged per owned byte.
      small_unit_threshold: fraction of the largest param cost under which a layer's params are packed.
      layer_spread_tolerance: soft layer-spread tolerance (fraction of mean slot / column load).
      local_search_steps: bound on local-search changes (0 disables it).
      max_split: split the Newton–Schulz of a matrix over up to this many ranks of one node where
        that lowers the maximum slot cost (:mod:`dmuon.functional.split_plan`); 1 (default): never.
        The optimizer executes them (:mod:`dmuon.functional.split_exec`).
      node_size: ranks per node (consecutive global ranks); a split stays inside one node.
      split_score: ranks candidate split plans (lower is better; default: the maximum slot cost),
        e.g. a projected NS-phase time.
      force_split: ``{param: k}``: split exactly these (whatever they score); needs
        ``max_split >= 2``.

    Returns:
      the :class:`OwnerPlan`; identical (same fingerprint) for the same specs in any order.

    Raises:
      ValueError: on bad sizes or settings, or duplicate param names.
    """
    g = _check_int("shard_size", shard_size, 1)
    r = _check_int("replicate_size", replicate_size, 1)
    _check_int("ns_steps", ns_steps, 1)
    _check_int("flops_per_byte", flops_per_byte, 0)
    _check_int("local_search_steps", local_search_steps, 0)
    if not 0.0 <= float(small_unit_threshold) <= 1.0:
        raise ValueError(f"small_unit_threshold must be in [0, 1], got {small_unit_threshold!r}")
    if not float(layer_spread_tolerance) >= 0.0:
        raise ValueError(f"layer_spread_tolerance must be >= 0, got {layer_spread_tolerance!r}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[:5]
        raise ValueError(f"duplicate param names in specs: {dup}")
    units = build_units(specs, ns_steps=ns_steps, ns_variant=ns_variant, flops_per_byte=flops_per_byte,
                        small_unit_threshold=small_unit_threshold)
    n = g * r

    st = _State(g, r, units)
    _greedy(st, float(layer_spread_tolerance))
    _local_search(st, local_search_steps)
    lpt_max = max(st.load) if units else 0
    rr_slots = _round_robin(units, n)
    rr_st = _State(g, r, units)
    for i, k in enumerate(rr_slots):
        rr_st.place(i, k)
    rr_max = max(rr_st.load) if units else 0
    if rr_max < lpt_max:
        strategy, chosen = "round_robin", rr_st
    else:
        strategy, chosen = "lpt", st
    settings = {
        "ns_steps": ns_steps, "ns_variant": ns_variant, "flops_per_byte": flops_per_byte,
        "small_unit_threshold": float(small_unit_threshold),
        "layer_spread_tolerance": float(layer_spread_tolerance),
        "local_search_steps": local_search_steps, "format_version": PLAN_FORMAT_VERSION,
    }
    plan = assemble_plan(specs, g, r, units, tuple(chosen.where), strategy=strategy,
                         lpt_max=lpt_max, rr_max=rr_max, layer_collisions=_collisions(chosen),
                         settings=settings)
    if force_split and max_split < 2:
        raise ValueError("force_split needs max_split >= 2 (the largest k allowed)")
    if _check_int("max_split", max_split, 1) > 1:
        from dmuon.functional.split_plan import plan_splits
        plan = plan_splits(specs, plan, max_split=max_split,
                           node_size=_check_int("node_size", node_size, 1),
                           local_search_steps=local_search_steps, score=split_score,
                           force=dict(force_split) if force_split else None)
    return plan
