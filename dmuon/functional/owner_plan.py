"""The owner plan as data: :class:`OwnerPlan` (who owns each dedicated matrix, per-slot totals,
balance metrics, fingerprint) and :func:`assemble_plan`, which builds it from a finished
assignment of allocation units to slots. Planned by :func:`dmuon.functional.plan.plan_owners`
(and, with split units, :mod:`dmuon.functional.split_plan`)."""
from __future__ import annotations

import hashlib
import json
import types
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from dmuon.functional.plan_units import AllocationUnit
from dmuon.functional.specs import ParamSpec

__all__ = ["Coord", "OwnerPlan", "assemble_plan"]

Coord = tuple[int, int]
"""``(s, r)``: shard index, replicate index (slot / global rank ``r * G + s``)."""


@dataclass(frozen=True, eq=False)
class OwnerPlan:
    """Immutable owner assignment of the dedicated params (see the module docstring).

    Attributes:
      shard_size: ``G``; replicate_size: ``R``; slot (global rank) of ``(s, r)`` is ``r * G + s``.
      owners: read-only ``{param name: (s, r)}``.
      units: allocation units in canonical order; ``unit_slots[i]`` is the slot of ``units[i]``.
      slot_costs, slot_bytes, slot_matrices: per-slot totals (index = slot).
      imbalance: ``max / mean`` slot cost; balance: ``max / max(mean, largest unit cost)``.
      strategy: ``"lpt"`` (greedy + local search) or ``"round_robin"``, whichever had the smaller max.
      lpt_max_cost, round_robin_max_cost: max slot cost of each candidate.
      layer_collisions: ``sum over slots and layers of (units of the layer on the slot - 1)+``.
      params: the cost-model settings used (ns_steps, ns_variant, flops_per_byte, thresholds, ...).
      fingerprint: sha256 hex over a canonical text of all specs, settings and owners.
      splits: :class:`~dmuon.functional.split_plan.SplitUnit` s, one per matrix whose NS is split
        over several ranks (``max_split > 1``); its blocks are the ``owners`` entries
        ``"<name>@split<i>of<k>"`` (the param's own name is then not in ``owners``). Empty by default.
    """

    shard_size: int
    replicate_size: int
    owners: Mapping[str, Coord]
    units: tuple[AllocationUnit, ...]
    unit_slots: tuple[int, ...]
    slot_costs: tuple[int, ...]
    slot_bytes: tuple[int, ...]
    slot_matrices: tuple[int, ...]
    imbalance: float
    balance: float
    strategy: str
    lpt_max_cost: int
    round_robin_max_cost: int
    layer_collisions: int
    params: Mapping[str, Any]
    fingerprint: str = field(default="")
    splits: tuple = ()

    @property
    def num_slots(self) -> int:
        return self.shard_size * self.replicate_size

    def slot_of(self, coord: Coord) -> int:
        """Global rank ``r * G + s`` of coordinate ``(s, r)``."""
        s, r = coord
        return r * self.shard_size + s

    def coord_of(self, slot: int) -> Coord:
        """Coordinate ``(s, r)`` of slot (global rank) ``slot``."""
        return slot % self.shard_size, slot // self.shard_size

    def owner(self, name: str) -> Coord:
        """Owner ``(s, r)`` of dedicated param ``name``; raises ``KeyError`` saying what is planned."""
        try:
            return self.owners[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a dedicated (route 'muon') param of this plan "
                           f"({len(self.owners)} planned); check the predicate and the name") from None

    def owned_by(self, coord: Coord) -> tuple[str, ...]:
        """Names of the params owned by ``(s, r)``, sorted."""
        c = tuple(coord)
        return tuple(sorted(n for n, o in self.owners.items() if o == c))

    @property
    def column_costs(self) -> tuple[int, ...]:
        """Total cost per shard column ``s`` (summed over replicas)."""
        g = self.shard_size
        return tuple(sum(self.slot_costs[r * g + s] for r in range(self.replicate_size)) for s in range(g))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OwnerPlan) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)


def assemble_plan(specs: Sequence[ParamSpec], g: int, r: int, units: Sequence[AllocationUnit],
                  unit_slots: Sequence[int], *, strategy: str, lpt_max: int, rr_max: int,
                  layer_collisions: int, settings: Mapping[str, Any],
                  splits: tuple = ()) -> OwnerPlan:
    """The :class:`OwnerPlan` of a finished assignment ``units[i] -> unit_slots[i]``: per-slot totals,
    owners, balance metrics and the fingerprint (over the specs, settings, owners and splits)."""
    n = g * r
    slot_costs = [0] * n
    slot_bytes = [0] * n
    slot_mats = [0] * n
    owners: dict[str, Coord] = {}
    for u, k in zip(units, unit_slots):
        slot_costs[k] += u.cost
        slot_bytes[k] += u.nbytes
        slot_mats[k] += u.matrices
        for p in u.params:
            owners[p] = (k % g, k // g)
    total = sum(slot_costs)
    mean = total / n
    mx = max(slot_costs)
    largest = max((u.cost for u in units), default=0)
    imbalance = mx / mean if total else 1.0
    denom = max(mean, largest)
    balance = mx / denom if denom else 1.0
    owners_sorted = dict(sorted(owners.items()))
    canon = {
        "G": g, "R": r, "settings": dict(settings), "strategy": strategy,
        "specs": sorted([s.name, list(s.shape), s.dtype, s.layer_key, s.route, s.batch_dims]
                        + ([] if s.view is None else [str(s.view)]) for s in specs),
        "owners": [[k, v[0], v[1]] for k, v in owners_sorted.items()],
    }
    if splits:
        canon["splits"] = [sp.canonical() for sp in splits]
    fp = hashlib.sha256(json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return OwnerPlan(
        shard_size=g, replicate_size=r, owners=types.MappingProxyType(owners_sorted), units=tuple(units),
        unit_slots=tuple(unit_slots), slot_costs=tuple(slot_costs), slot_bytes=tuple(slot_bytes),
        slot_matrices=tuple(slot_mats), imbalance=imbalance, balance=balance, strategy=strategy,
        lpt_max_cost=lpt_max, round_robin_max_cost=rr_max, layer_collisions=layer_collisions,
        params=types.MappingProxyType(dict(settings)), fingerprint=fp, splits=tuple(splits))
