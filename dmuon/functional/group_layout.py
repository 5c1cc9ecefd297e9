"""Which process groups dmuon's runtime creates over the world (pure): the grids' check, this
rank's place in them, and every group's ranks in the one order every rank creates them
(:func:`dmuon.stateful.runtime.process_groups.make_process_groups` acts on it).

``grid[r][s]`` is the global rank of shard index ``s`` in replica ``r``; with tensor parallelism
there is one grid per TP index, and the ranks of one ``(s, r)`` across the grids form a TP group.
"""
from __future__ import annotations

from typing import Optional, Sequence

from dmuon.functional.schedule import LANE_AXIS, LANES
from dmuon.functional.setup_check import Grid

__all__ = ["standard_grid", "check_grids", "grid_position", "group_ranks"]


def standard_grid(shard_size: int, replicate_size: Optional[int] = None) -> Grid:
    """The ``r * G + s`` grid of ``replicate_size`` (default 1) replicas of ``shard_size`` ranks."""
    G, R = int(shard_size), int(replicate_size or 1)
    return tuple(tuple(r * G + s for s in range(G)) for r in range(R))


def check_grids(grids: Sequence[Sequence[Sequence[int]]], world_size: int) -> tuple[Grid, ...]:
    """``grids`` as tuples of ints, checked: ``R x G`` each (one per TP index), together a
    permutation of the ``world_size`` ranks.

    Raises:
      ValueError: another shape, or not every world rank exactly once.
    """
    out = tuple(tuple(tuple(int(x) for x in row) for row in g) for g in grids)
    g = out[0]
    R, G = len(g), len(g[0])
    flat = sorted(x for tg in out for row in tg for x in row)
    if any(len(tg) != R or any(len(row) != G for row in tg) for tg in out) \
            or flat != list(range(world_size)):
        what = f"grid {g}" if len(out) == 1 else f"grids {out}"
        raise ValueError(f"{what} must be an R x G arrangement (one per TP index) of all "
                         f"{world_size} world ranks (G*R*T = world size)")
    return out


def grid_position(grids: Sequence[Grid], rank: int) -> tuple[int, tuple[int, int]]:
    """``(TP index, (s, r))`` of global ``rank`` in :func:`check_grids`'s ``grids``."""
    return next((t, (s, r)) for t, g in enumerate(grids) for r, row in enumerate(g)
                for s, x in enumerate(row) if x == rank)


def group_ranks(grids: Sequence[Grid], lanes: Sequence[str] = LANES
                ) -> list[tuple[str, tuple[int, ...]]]:
    """Every process group to create, as ``(kind, ranks)`` in the one order every rank creates
    them: per grid, each of ``lanes`` in :data:`LANES` order (a shard-axis lane: one group per
    replica row; the replicate lane: one per shard column); with several grids, a ``"tp"`` group
    per ``(s, r)`` (its ranks in TP order); last the ``"control"`` group of the whole world.

    Raises:
      ValueError: an unknown lane.
    """
    for lane in lanes:
        if lane not in LANE_AXIS:
            raise ValueError(f"unknown lane {lane!r}; lanes: {list(LANES)}")
    R, G = len(grids[0]), len(grids[0][0])
    out: list[tuple[str, tuple[int, ...]]] = []
    for g in grids:
        for lane in (x for x in LANES if x in lanes):  # fixed global order, whatever `lanes` says
            if LANE_AXIS[lane] == "shard":
                out += [(lane, tuple(g[r])) for r in range(R)]
            else:
                out += [(lane, tuple(g[r][s] for r in range(R))) for s in range(G)]
    if len(grids) > 1:
        out += [("tp", tuple(g[r][s] for g in grids)) for r in range(R) for s in range(G)]
    return out + [("control", tuple(range(len(grids) * R * G)))]
