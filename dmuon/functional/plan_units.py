"""The owner plan's allocation units and cost model (see :mod:`dmuon.functional.plan`'s docstring).

``cost(param) = sum of the NS flops of its matrix view's blocks + flops_per_byte * nbytes``;
small params of one layer are packed into units that move together.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from dmuon.functional.specs import ParamSpec
from dmuon.newton_schulz.cost import ns_cost

__all__ = ["AllocationUnit", "natural_key", "param_cost", "build_units", "DEFAULT_FLOPS_PER_BYTE",
           "DEFAULT_SMALL_UNIT_THRESHOLD"]

#: Flops-equivalent charged per byte a slot owns (see the module docstring for the derivation).
DEFAULT_FLOPS_PER_BYTE = 1024
#: A param cheaper than this fraction of the most expensive param is packed with its layer's others.
DEFAULT_SMALL_UNIT_THRESHOLD = 1 / 16

@dataclass(frozen=True)
class AllocationUnit:
    """Params that move together in the plan (one matrix, or a layer's packed small matrices).

    Attributes:
      name: the param's name, or ``"<layer_key>:small<i>"`` for a packed unit.
      params: names of the params in the unit (sorted).
      layer_key: their common layer key (``None`` outside blocks).
      flops: Newton–Schulz flops (all matrices of all params).
      nbytes: bytes of the params in their dtypes.
      cost: ``flops + flops_per_byte * nbytes``.
      matrices: number of matrices (``sum of B``).
    """

    name: str
    params: tuple[str, ...]
    layer_key: Optional[str]
    flops: int
    nbytes: int
    cost: int
    matrices: int


def natural_key(name: str) -> tuple:
    """Sort key that orders embedded integers numerically (``layers.2`` before ``layers.10``)."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t)


def param_cost(spec: ParamSpec, *, ns_steps: int = 5, ns_variant: str = "auto",
               flops_per_byte: int = DEFAULT_FLOPS_PER_BYTE) -> tuple[int, int, int, int]:
    """``(cost, flops, nbytes, matrices)`` of one Muon param under the plan's cost model."""
    blocks = spec.matrix_view.blocks(spec.shape)
    flops = sum(ns_cost(m, n, ns_steps, variant=ns_variant, batch=b).flops for b, m, n in blocks)
    nbytes = spec.nbytes
    return flops + flops_per_byte * nbytes, flops, nbytes, sum(b for b, _, _ in blocks)


def build_units(specs: Sequence[ParamSpec], *, ns_steps: int = 5, ns_variant: str = "auto",
                flops_per_byte: int = DEFAULT_FLOPS_PER_BYTE,
                small_unit_threshold: float = DEFAULT_SMALL_UNIT_THRESHOLD) -> tuple[AllocationUnit, ...]:
    """Allocation units of the ``route == "muon"`` specs, sorted canonically by ``(-cost, name)``.

    A param with ``cost < small_unit_threshold * max_cost`` and a layer key is small; the small params
    of a layer are packed in natural name order into units whose cost stays ``<= threshold * max_cost``.
    """
    muon = sorted((s for s in specs if s.route == "muon"), key=lambda s: s.name)
    costs = {s.name: param_cost(s, ns_steps=ns_steps, ns_variant=ns_variant, flops_per_byte=flops_per_byte)
             for s in muon}
    if not muon:
        return ()
    bound = small_unit_threshold * max(c[0] for c in costs.values())
    units: list[AllocationUnit] = []
    small_by_layer: dict[str, list[ParamSpec]] = {}
    for s in muon:
        c, f, nb, b = costs[s.name]
        if s.layer_key is not None and c < bound:
            small_by_layer.setdefault(s.layer_key, []).append(s)
        else:
            units.append(AllocationUnit(s.name, (s.name,), s.layer_key, f, nb, c, b))
    for key in sorted(small_by_layer):
        groups: list[list[ParamSpec]] = [[]]
        total = 0
        for s in sorted(small_by_layer[key], key=lambda s: natural_key(s.name)):
            c = costs[s.name][0]
            if groups[-1] and total + c > bound:
                groups.append([])
                total = 0
            groups[-1].append(s)
            total += c
        for i, g in enumerate(groups):
            names = tuple(sorted(s.name for s in g))
            name = names[0] if len(g) == 1 else f"{key}:small{i}"
            units.append(AllocationUnit(
                name, names, key, sum(costs[n][1] for n in names), sum(costs[n][2] for n in names),
                sum(costs[n][0] for n in names), sum(costs[n][3] for n in names)))
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise ValueError("allocation unit names collide; parameter names must not contain ':small'")
    return tuple(sorted(units, key=lambda u: (-u.cost, u.name)))
