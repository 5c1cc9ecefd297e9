"""Per-axis, per-lane process groups for dedicated-param schedules, created once at setup
(:func:`make_process_groups`; ``grid[r][s]`` is the global rank of ``(s, r)``). ``new_group`` is
collective over the world: every rank creates every group in one order; groups are reused by later
models with the same arguments, never leaked.

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.process_groups".
"""
from __future__ import annotations

import datetime
import logging
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch.distributed as dist

from dmuon.compat.heartbeat import start_heartbeat
from dmuon.functional.group_layout import check_grids, grid_position, group_ranks, standard_grid
from dmuon.functional.rank_report import collective_failure
from dmuon.functional.schedule import LANE_AXIS, LANES
from dmuon.functional.setup_check import Grid, check_setups, error_type, rank_setup
from dmuon.stateful.runtime.agree import gather

log = logging.getLogger(__name__)

__all__ = ["MeshGroups", "make_process_groups", "agree_grids", "with_split_groups"]


@dataclass(frozen=True)
class MeshGroups:
    """This rank's view of the lane process groups.

    Attributes:
      shard_size: G.  replicate_size: R.
      grid: ``grid[r][s]`` = global rank of ``(s, r)``.
      rank: this process's global rank.  coord: its ``(s, r)``.
      groups: ``lane -> the process group of that lane containing this rank``.
      control: a group of the whole world with dmuon's timeout, for dmuon's own small collectives
        outside the schedules (finiteness and usage checks, the forward-order agreement, clipping,
        state dicts), so that none of them waits on the default group's bound.
      timeout: the groups' collective timeout (``None``: the default group's).
    """

    shard_size: int
    replicate_size: int
    grid: tuple[tuple[int, ...], ...]
    rank: int
    coord: tuple[int, int]
    groups: Mapping[str, Any]
    control: Any = None
    timeout: Optional[datetime.timedelta] = None
    #: tensor parallelism: the group of the ranks holding the other slices of this rank's
    #: matrices (the same ``(s, r)`` in every TP index's grid), its size and this rank's index
    tp_group: Any = None
    tp_size: int = 1
    tp_index: int = 0
    tp_ranks: tuple[int, ...] = ()
    #: every TP index's ``grid[r][s]`` (``()`` without TP): the TP group of ``(s, r)`` is
    #: ``[tp_grids[t][r][s] for t]``
    tp_grids: tuple = ()
    #: split Newton–Schulz: ``{members: group}`` of the split units this rank is a member of
    split_groups: Mapping[tuple[int, ...], Any] = None  # type: ignore[assignment]

    def control_collective(self, what: str, fn: Any) -> Any:
        """Run ``fn(group)`` on the control group; a failure (a timeout: a rank never came)
        raises ``RuntimeError`` naming ``what``, the ranks and the bound."""
        try:
            return fn(self.control)
        except RuntimeError as e:
            world = range(len(self.grid) * len(self.grid[0]) * self.tp_size)
            raise RuntimeError(collective_failure(what, world, self.rank, self.timeout, e)) from e

    def global_rank(self, s: int, r: int) -> int:
        return self.grid[r][s]

    def member_group(self, members: Sequence[int]) -> Any:
        """The process group of an explicit-group op's ``members`` (global ranks): this rank's
        tensor-parallel group."""
        if tuple(members) == tuple(self.tp_ranks) and self.tp_group is not None:
            return self.tp_group
        if self.split_groups and tuple(members) in self.split_groups:
            return self.split_groups[tuple(members)]
        raise KeyError(f"no process group for the ranks {list(members)} on rank {self.rank} "
                       f"(its TP group: {list(self.tp_ranks)})")

    def op_ranks(self, op: Any) -> list[int]:
        """Global ranks of the group that runs schedule op ``op`` on this rank's row (shard axis)
        or on ``op.at``'s column (replicate axis), in axis order; an explicit group's members."""
        if op.axis == "group":
            return list(op.members)
        if op.axis == "shard":
            return list(self.grid[self.coord[1]])
        return [row[op.at] for row in self.grid]


def agree_grids(mesh: Any, replicate_mesh: Any = None, *, param_device_types: Sequence[str] = (),
                local_err: Optional[Exception] = None, what: str = "dedicate_params",
                tp_ranks: Optional[Sequence[int]] = None) -> tuple[Grid, ...]:
    """The ``grid[r][s]`` of global ranks the meshes describe, agreed by every rank (collective:
    :func:`~dmuon.functional.setup_check.check_setups` on every rank's arguments).

    Args:
      mesh: a 2-D DeviceMesh with dims ``("replicate", "shard")`` (any order), or a 1-D shard mesh.
      replicate_mesh: optional 1-D replicate mesh (only with a 1-D ``mesh``): HSDP.
      param_device_types: device types of the params the groups will move (checked against the
        meshes' device type).
      local_err: an exception this rank's own earlier checks raised (re-raised here, after every
        rank knows).  what: the caller's name, for the messages.
      tp_ranks: tensor parallelism: the global ranks of this rank's TP group in TP order
        (``mesh`` is then this rank's dp sub-mesh, over the ranks of its TP index).

    Returns:
      ``grids[t]`` (``grid[r][s]`` of TP index ``t``; one grid without TP), the same on every rank.

    Raises:
      ``local_err`` where given; elsewhere, when any rank has a problem, the type of that rank's
      error (``ValueError`` for problems of the meshes) naming every problem.
    """
    su = rank_setup(dist.get_rank(), mesh, replicate_mesh, param_device_types=param_device_types,
                    local_err=local_err, tp_ranks=tp_ranks)
    setups = gather(su, what=f"{what} setup agreement")
    verdict = check_setups(setups, dist.get_world_size())
    if not verdict.problems:
        return verdict.grids
    if local_err is not None:
        raise local_err
    raise error_type(setups)(f"{what} failed (nothing was changed on any rank): "
                             + " | ".join(verdict.problems))


def make_process_groups(mesh=None, *, replicate_mesh=None, shard_size: int | None = None,
                        replicate_size: int | None = None,
                        grid: Sequence[Sequence[int]] | None = None,
                        tp_grids: Sequence[Sequence[Sequence[int]]] | None = None,
                        timeout: datetime.timedelta | None = None) -> MeshGroups:
    """Create every lane's process groups once (collective: every rank calls this, same args).

    Give exactly one of: ``mesh`` (DeviceMesh, 2-D or 1-D shard mesh, plus optional 1-D
    ``replicate_mesh``; checked on every rank by :func:`agree_grids`), ``grid`` (``grid[r][s]``
    global ranks), or ``shard_size`` (and optional ``replicate_size``, default 1) for the standard
    ``r * G + s`` layout over the world.

    Args:
      tp_grids: tensor parallelism, instead of ``grid``: one ``grid[r][s]`` per TP index (from
        :func:`agree_grids`); this rank's lanes are those of the grid that holds it, and a ``tp``
        group joins the ranks of one ``(s, r)`` across the grids.
      timeout: collective timeout of the new groups (default: the default group's); the groups
        use the default group's backend (on NCCL the shard-axis lanes' are high-priority streams).

    Returns:
      :class:`MeshGroups` for this rank.

    Raises:
      RuntimeError: torch.distributed is not initialized.
      ValueError: inconsistent sizes, a grid that is not a permutation of the world.
    """
    if not dist.is_initialized():
        raise RuntimeError("make_process_groups: call torch.distributed.init_process_group first")
    given = sum(x is not None for x in (mesh, grid, shard_size, tp_grids))
    if given != 1:
        raise ValueError("make_process_groups: give exactly one of mesh, grid, tp_grids, "
                         "shard_size")
    if mesh is not None:
        grids = agree_grids(mesh, replicate_mesh, what="make_process_groups")
    elif tp_grids is not None:
        grids = tp_grids
    else:
        grids = [grid if grid is not None else standard_grid(shard_size, replicate_size)]
    world, me = dist.get_world_size(), dist.get_rank()
    all_grids = check_grids(grids, world)
    tp_index, coord = grid_position(all_grids, me)
    to_make = group_ranks(all_grids, LANES)
    be = str(dist.get_backend())
    key = (all_grids, be, timeout, me)
    cached = _reusable(key)
    # reuse only when every rank can: new_group is collective over the world
    if all(gather(cached is not None, what="process-group reuse agreement")):
        return cached
    mine: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for kind, ranks in to_make:  # every rank creates every group, in one order
        pg = _new_group(ranks, timeout, LANE_AXIS.get(kind) == "shard" and "nccl" in be)
        if me in ranks:
            mine[kind] = (pg, ranks)
    tp_group, tp_ranks = mine.get("tp", (None, (me,)))
    groups = {lane: pg for lane, (pg, _) in mine.items() if lane in LANE_AXIS}
    G, R, T = len(all_grids[0][0]), len(all_grids[0]), len(all_grids)
    log.debug("dmuon process groups: G=%d R=%d T=%d rank=%d coord=%s lanes=%s", G, R, T, me,
              coord, list(groups))
    made = MeshGroups(G, R, all_grids[tp_index], me, coord, groups, control=mine["control"][0],
                      timeout=timeout, tp_group=tp_group, tp_size=T, tp_index=tp_index,
                      tp_ranks=tp_ranks, tp_grids=all_grids if T > 1 else ())
    _REUSE[key] = made
    start_heartbeat(me)  # the join (agree.py) tells a rank that is gone from one that is late
    return made


#: the groups made so far, by (grids, backend, timeout, rank): reused by later models instead of
#: adding groups that nothing could free
_REUSE: dict[tuple, MeshGroups] = {}


def _reusable(key: tuple) -> Optional[MeshGroups]:
    """The groups made for ``key`` before, if every one of them is still registered (a
    ``destroy_process_group()`` and a new ``init_process_group`` in between made them stale)."""
    if (made := _REUSE.get(key)) is None:
        return None
    pgs = [*made.groups.values(), made.control, made.tp_group]
    try:
        for pg in pgs:
            if pg is not None:
                dist.get_process_group_ranks(pg)
    except Exception:  # noqa: BLE001 - KeyError (or anything) for a destroyed group: make new ones
        del _REUSE[key]
        return None
    return made


def with_split_groups(mg: MeshGroups, member_sets: Sequence[Sequence[int]]) -> MeshGroups:
    """``mg`` plus a process group for each distinct ``members`` tuple of the split units
    (collective: every rank calls it with the same sets; groups are made in sorted order)."""
    sets = sorted({tuple(int(x) for x in m) for m in member_sets})
    if not sets:
        return mg
    made = {}
    for ranks in sets:
        pg = _new_group(ranks, mg.timeout)
        if mg.rank in ranks:
            made[ranks] = pg
    return dataclasses.replace(mg, split_groups=made)


def _new_group(ranks: Sequence[int], timeout: Optional[datetime.timedelta],
               high_priority: bool = False) -> Any:
    """``dist.new_group(ranks)`` with ``timeout`` (where given) and, ``high_priority``, NCCL's
    high-priority streams (collective over the world)."""
    kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if high_priority:
        kw["pg_options"] = opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
    return dist.new_group(list(ranks), **kw)
