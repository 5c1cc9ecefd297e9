"""Pure checks of what every rank passed to ``dedicate_params``, before any group is created.

``dedicate_params`` all-gathers one :class:`RankSetup` per rank (what that rank's mesh, replicate
mesh and dedicated params look like, and the error its local checks raised, if any) and calls
:func:`check_setups` on the list. Every rank holds the same list, so every rank reaches the same
verdict: a problem on one rank raises on all of them instead of leaving the others waiting in a
collective the failing rank never reaches.

The grid convention is :mod:`dmuon.stateful.runtime.process_groups`'s: ``grid[r][s]`` is the global rank
of shard index ``s`` in replica ``r``; it must be an ``R x G`` arrangement of all world ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["RankSetup", "SetupCheck", "check_fsdp_meshes", "require_fsdp_meshes", "check_setups", "ddp_grid",
           "deferral_agreed", "error_type", "rank_setup", "already_dedicated"]

Grid = tuple[tuple[int, ...], ...]

_HSDP_HINT = ("For HSDP pass the 1-D shard mesh plus replicate_mesh=mesh2d['replicate'], or the "
              "2-D mesh with dims ('replicate', 'shard'). With tensor parallelism pass the dp "
              "sub-mesh (mesh['dp'] of a (dp, tp) mesh) and TP-sharded matrices; other parallel "
              "dims beside dp and tp (context parallel, pipeline stages) are not supported.")


@dataclass(frozen=True)
class RankSetup:
    """One rank's view of its ``dedicate_params`` arguments (picklable; all-gathered).

    Attributes:
      rank: global rank.
      mesh: the rank layout of ``mesh`` (``DeviceMesh.mesh.tolist()``: a list, or a list of lists).
      mesh_dim_names: ``mesh.mesh_dim_names`` (``None`` if unnamed).
      mesh_device_type: ``mesh.device_type``.
      replicate: the ranks of ``replicate_mesh`` (flattened row-major: any N-D mesh is one axis) or
        ``None``.
      replicate_device_type: ``replicate_mesh.device_type`` or ``None``.
      param_device_types: sorted device types of the dedicated params.
      error: ``(exception type name, message)`` of this rank's local checks, or ``None``.
      tp: tensor parallelism: the global ranks of this rank's TP group, in TP order (slice ``t``
        of every TP-sharded dedicated matrix lives on ``tp[t]``), or ``None`` without TP.
    """

    rank: int
    mesh: tuple = ()
    mesh_dim_names: Optional[tuple[str, ...]] = None
    mesh_device_type: str = "cpu"
    replicate: Optional[tuple[int, ...]] = None
    replicate_device_type: Optional[str] = None
    param_device_types: tuple[str, ...] = ()
    error: Optional[tuple[str, str]] = None
    tp: Optional[tuple[int, ...]] = None


def _nested_tuple(x: Any) -> Any:
    return tuple(_nested_tuple(v) for v in x) if isinstance(x, list) else int(x)


def rank_setup(rank: int, mesh: Any, replicate_mesh: Any = None, *,
               param_device_types: Sequence[str] = (), local_err: Optional[Exception] = None,
               tp_ranks: Optional[Sequence[int]] = None) -> RankSetup:
    """This rank's :class:`RankSetup`, read from its DeviceMesh objects (``mesh``, optional
    ``replicate_mesh``; anything else becomes a ``TypeError`` problem) and its local error."""
    err = None if local_err is None else (type(local_err).__name__, str(local_err))
    try:
        return RankSetup(
            rank=rank, mesh=_nested_tuple(mesh.mesh.tolist()),
            mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            mesh_device_type=str(mesh.device_type),
            replicate=(None if replicate_mesh is None
                       else _nested_tuple(replicate_mesh.mesh.flatten().tolist())),
            replicate_device_type=(None if replicate_mesh is None
                                   else str(replicate_mesh.device_type)),
            param_device_types=tuple(sorted(set(param_device_types))), error=err,
            tp=None if tp_ranks is None else tuple(int(x) for x in tp_ranks))
    except AttributeError:
        return RankSetup(rank=rank, error=err or (
            "TypeError", f"mesh / replicate_mesh must be DeviceMesh objects (init_device_mesh), got "
            f"{type(mesh).__name__} / {type(replicate_mesh).__name__}"))


@dataclass(frozen=True)
class SetupCheck:
    """Verdict of :func:`check_setups`: ``grid`` when ``problems`` is empty, else ``None``.

    With tensor parallelism (``tp`` set) there is one grid per TP index ``t`` (the dp ranks that
    hold slice ``t``): ``grids[t]``, each ``R x G``; ``grid`` is ``grids[0]``. Without TP,
    ``grids == (grid,)``."""

    problems: tuple[str, ...]
    grid: Optional[Grid]
    grids: Optional[tuple[Grid, ...]] = None


def _depth(x) -> int:
    """Nesting depth of a (nested) list / tuple of ints: 1 for a 1-D mesh, 2 for a 2-D one."""
    d = 0
    while isinstance(x, (list, tuple)):
        d += 1
        if not x:
            break
        x = x[0]
    return d


def _local_grid(su: RankSetup, shard_dim: str = "shard",
                replicate_dim: str = "replicate") -> tuple[Optional[Grid], Optional[str]]:
    """The grid this rank's arguments describe (1-D mesh + replicate: only this rank's row)."""
    d = _depth(su.mesh)
    if d == 2:
        if su.replicate is not None:
            return None, ("pass either a 2-D ('replicate', 'shard') mesh or a 1-D shard mesh plus "
                          "a 1-D replicate_mesh, not both")
        names = tuple(su.mesh_dim_names or ())
        if set(names) != {shard_dim, replicate_dim}:
            return None, (f"a 2-D mesh needs dims named ('replicate', 'shard'), got {names}; "
                          "name them with init_device_mesh(..., mesh_dim_names=('replicate', "
                          "'shard')) or pass the 1-D shard mesh (plus replicate_mesh)")
        rows = [tuple(int(x) for x in row) for row in su.mesh]
        if names.index(shard_dim) == 0:
            rows = [tuple(col) for col in zip(*rows)]
        return tuple(rows), None
    if d != 1:
        return None, f"mesh must be a 1-D or 2-D DeviceMesh, got a {d}-D one"
    shard = tuple(int(x) for x in su.mesh)
    if su.replicate is None:
        return (shard,), None
    if su.rank not in shard or su.rank not in su.replicate:
        return None, (f"rank {su.rank} is not in its own mesh {list(shard)} and replicate_mesh "
                      f"{list(su.replicate)}; each rank must pass the meshes that contain it "
                      "(mesh2d['shard'] and mesh2d['replicate'] of its 2-D mesh)")
    return None, None  # assembled from every rank's row in check_setups


def check_setups(setups: Sequence[RankSetup], world_size: int) -> SetupCheck:
    """Check the ranks' ``dedicate_params`` arguments against each other and the world.

    Args:
      setups: one :class:`RankSetup` per rank, indexed by rank.
      world_size: size of the default process group.

    Returns:
      :class:`SetupCheck`: every problem found (each says what is wrong and how to fix it), and
      the ``grid[r][s]`` of global ranks when there is none.

    Problems found: a local error on any rank (reported with the ranks that raised it); meshes of
    the wrong dimensionality or names; ranks that disagree on the mesh (e.g. each replica passed
    its own 1-D shard mesh without ``replicate_mesh``); a mesh that does not cover exactly the
    world's ranks; ``replicate size x shard size != world size``; a mesh on another device type
    than the dedicated params.
    """
    errs: dict[tuple[str, str], list[int]] = {}
    for su in setups:
        if su.error is not None:
            errs.setdefault(tuple(su.error), []).append(su.rank)
    if errs:
        return SetupCheck(
            tuple(f"on ranks {rs}: {kind}: {msg}" for (kind, msg), rs in errs.items()), None)
    tps = {su.tp for su in setups}
    if tps != {None}:
        return _check_tp_setups(setups, world_size)
    problems, grid = _check_grid(setups, list(range(world_size)), world_size)
    problems += _device_problems(setups)
    ok = not problems
    return SetupCheck(tuple(problems), grid if ok else None, (grid,) if ok else None)



#: the exception types a failed check raises as (:func:`error_type`)
_ERROR_TYPES = {"RuntimeError": RuntimeError, "TypeError": TypeError,
                "NotImplementedError": NotImplementedError}


def error_type(setups: Sequence[RankSetup]) -> type[Exception]:
    """The type to raise a failed :func:`check_setups` as: the ranks' one kind of local error
    (a ``RuntimeError``, ``TypeError`` or ``NotImplementedError``), else ``ValueError``."""
    kinds = {su.error[0] for su in setups if su.error is not None}
    return _ERROR_TYPES.get(kinds.pop() if len(kinds) == 1 else "", ValueError)

def _check_tp_setups(setups: Sequence[RankSetup], world_size: int) -> SetupCheck:
    """:func:`check_setups` with tensor parallelism: one dp grid per TP index, aligned so that
    the ranks at one ``(s, r)`` of every grid form one TP group (they hold one matrix's slices)."""
    problems: list[str] = []
    if any(su.tp is None for su in setups):
        return SetupCheck((f"ranks {[su.rank for su in setups if su.tp is None]} have no "
                           "tensor-parallel dedicated param but the others do; every rank must "
                           "apply the same parallelize_module plan before dedicate_params",), None)
    sizes = {len(su.tp) for su in setups}
    bad = [su.rank for su in setups if su.rank not in su.tp]
    if len(sizes) > 1 or bad:
        return SetupCheck((f"the TP groups differ in size ({sorted(sizes)}) or do not contain "
                           f"their own rank (ranks {bad}); use one (dp..., tp) DeviceMesh for "
                           "every rank",), None)
    T = sizes.pop()
    grids: list[Grid] = []
    for t in range(T):
        sub = [su for su in setups if su.tp.index(su.rank) == t]
        ranks = sorted(su.rank for su in sub)
        p, g = _check_grid(sub, ranks, world_size, tp_index=t)
        problems += p
        if g is not None:
            grids.append(g)
    if not problems:
        shapes = {(len(g), len(g[0])) for g in grids}
        if len(shapes) > 1:
            problems.append(f"the dp meshes of the TP indices differ in shape {sorted(shapes)}")
        else:
            by_rank = {su.rank: su.tp for su in setups}
            R, G = shapes.pop()
            for r in range(R):
                for s_ in range(G):
                    group = tuple(grids[t][r][s_] for t in range(T))
                    if any(by_rank[x] != group for x in group):
                        problems.append(
                            f"the ranks at dp coordinate (shard {s_}, replica {r}) across the TP "
                            f"indices are {list(group)}, but their TP groups are "
                            f"{sorted({by_rank[x] for x in group})}: dmuon needs the TP group of "
                            "each rank to be the ranks of the same dp coordinate; build one "
                            "init_device_mesh(dev, (..., dp, tp)) and pass its dp sub-mesh")
                        break
    problems += _device_problems(setups)
    ok = not problems
    return SetupCheck(tuple(problems), grids[0] if ok else None, tuple(grids) if ok else None)


def _check_grid(setups: Sequence[RankSetup], ranks: list[int], world_size: int,
                tp_index: Optional[int] = None) -> tuple[list[str], Optional[Grid]]:
    """The grid the ``setups`` of ``ranks`` (the world, or one TP index's ranks) agree on, and
    every problem found."""
    problems: list[str] = []
    world = ranks
    where = "" if tp_index is None else f" (TP index {tp_index})"
    grids: dict[Grid, list[int]] = {}
    local_problems: dict[str, list[int]] = {}
    rows: dict[int, dict[tuple[int, ...], list[int]]] = {}
    for su in setups:
        g, p = _local_grid(su)
        if p is not None:
            local_problems.setdefault(p, []).append(su.rank)
        elif g is not None:
            grids.setdefault(g, []).append(su.rank)
        else:  # 1-D + replicate: this rank's replica index and shard row
            rows.setdefault(su.replicate.index(su.rank), {}).setdefault(
                tuple(int(x) for x in su.mesh), []).append(su.rank)
    problems += [f"on ranks {rs}: {p}" for p, rs in local_problems.items()]
    if grids and rows:
        problems.append("some ranks passed replicate_mesh and others did not; pass the same kind "
                        "of meshes on every rank")
    grid: Optional[Grid] = None
    if not problems and grids:
        if len(grids) > 1:
            detail = "; ".join(f"ranks {rs}: {[list(r) for r in g]}" for g, rs in grids.items())
            problems.append(f"the ranks{where} disagree on the mesh ({detail}). dedicate_params "
                            f"needs one mesh over all {len(world)} ranks{where}, the same on "
                            "every rank. " + _HSDP_HINT)
        else:
            grid = next(iter(grids))
    elif not problems and rows:
        sizes = sorted({(len(su.replicate), len(su.mesh)) for su in setups})
        bad_rows = {r: list(v) for r, v in rows.items() if len(v) > 1}
        if len(sizes) > 1 or sizes[0][0] * sizes[0][1] != len(world) \
                or sorted(rows) != list(range(sizes[0][0])):
            problems.append(
                "replicate_mesh size x mesh size must equal the "
                + ("world size" if tp_index is None else f"number of ranks{where}")
                + f" {len(world)}, got "
                + ", ".join(f"{r} x {g} = {r * g}" for r, g in sizes)
                + ". Pass the two 1-D slices of one 2-D mesh: mesh2d['shard'] and "
                "mesh2d['replicate'] of init_device_mesh(dev, (R, G), mesh_dim_names="
                "('replicate', 'shard')). " + _HSDP_HINT)
        elif bad_rows:
            problems.append(f"ranks of one replica disagree on their shard mesh: {bad_rows}. "
                            + _HSDP_HINT)
        else:
            grid = tuple(next(iter(rows[r])) for r in range(len(rows)))
    if grid is not None:
        flat = sorted(x for row in grid for x in row)
        if any(len(row) != len(grid[0]) for row in grid) or flat != world:
            problems.append(
                f"the mesh covers ranks {flat} but "
                + ("the default process group has ranks" if tp_index is None
                   else f"the ranks{where} are")
                + f" {world[:8]}{' ...' if len(world) > 8 else ''}: dedicate_params needs the mesh "
                "that fully_shard uses, over every rank of the world (a sub-mesh, e.g. one "
                "pipeline stage, is not supported). " + _HSDP_HINT)
            grid = None
            if tp_index is not None:
                problems[-1] += (" With tensor parallelism, the dp mesh must hold every rank "
                                 "of its TP index: other parallel dims beside dp and tp (e.g. "
                                 "context parallel) are not supported.")
    return problems, grid


def _device_problems(setups: Sequence[RankSetup]) -> list[str]:
    problems: list[str] = []
    dev: dict[str, list[int]] = {}
    for su in setups:
        types = set(su.param_device_types) | {su.mesh_device_type}
        if su.replicate_device_type is not None:
            types.add(su.replicate_device_type)
        if len(types) > 1:
            dev.setdefault(f"mesh on {su.mesh_device_type!r}"
                           + (f", replicate_mesh on {su.replicate_device_type!r}"
                              if su.replicate_device_type is not None else "")
                           + f", dedicated params on {list(su.param_device_types)}", []).append(
                su.rank)
    for what, rs in dev.items():
        problems.append(
            f"on ranks {rs}: {what}. The dedicated params must live on the mesh's device type: "
            "move the model there first (model.to(device); fully_shard would move the other params "
            "but not the dedicated ones), or build the meshes with that device type.")
    return problems


def check_fsdp_meshes(grid: Grid, device_type: str,
                      fsdp_meshes: Sequence[tuple[str, tuple[int, ...], str]]) -> tuple[str, ...]:
    """Check that ``fully_shard`` used a mesh over the same ranks and device type as dmuon.

    dmuon averages the dedicated matrices' gradients over every rank of its ``grid``; FSDP2
    averages the other gradients over its own mesh. If the two rank sets differ, the two halves of
    the model would be trained on different batches (a silent wrong update).

    Args:
      grid: dmuon's ``grid[r][s]`` of global ranks.
      device_type: the dedicated params' device type.
      fsdp_meshes: ``(module name, sorted ranks of its fully_shard mesh, mesh device type)`` for
        every module with FSDP2 state.

    Returns:
      One problem per distinct FSDP2 mesh that does not match (empty when all match).
    """
    ranks = tuple(sorted(x for row in grid for x in row))
    bad: dict[tuple[tuple[int, ...], str], list[str]] = {}
    for name, mranks, dev in fsdp_meshes:
        if tuple(sorted(mranks)) != ranks or dev != device_type:
            bad.setdefault((tuple(sorted(mranks)), dev), []).append(name or "<root>")
    return tuple(
        f"modules {names[:4]}{' ...' if len(names) > 4 else ''} were fully_shard-ed on a "
        f"{dev!r} mesh over ranks {list(mr)}, but dedicate_params got a {device_type!r} mesh over "
        f"ranks {list(ranks)}: the dedicated and the FSDP2 gradients would be averaged over "
        "different ranks. Pass fully_shard the same mesh (for HSDP the 2-D mesh) as "
        "dedicate_params (its 1-D shard mesh plus replicate_mesh, or the same 2-D mesh)."
        for (mr, dev), names in bad.items())


def ddp_grid(grid: Grid) -> Grid:
    """The ``grid[r][s]`` of DDP mode: the 1-D mesh's ranks as ``R = world`` replicas of one
    shard (``G = 1``).

    Raises:
      ValueError: ``grid`` is not one row (a 2-D or HSDP mesh was given)."""
    if len(grid) != 1:
        raise ValueError(
            "dedicate_params(data_parallel=\"ddp\") takes the 1-D mesh of the ranks DDP spans "
            "(init_device_mesh(device, (world,))) and no replicate_mesh; got a 2-D / HSDP layout "
            f"of {len(grid)} x {len(grid[0])}. For HSDP use data_parallel=\"fsdp\" (the default).")
    return tuple((int(x),) for x in grid[0])


def deferral_agreed(votes: Sequence[tuple[Any, tuple[int, ...], bool]]) -> bool:
    """Whether every rank defers its dedication to ``dmuon.Muon(model)``: ``votes[r]`` is rank
    ``r``'s (local error or ``None``, the sorted ranks of its dp mesh(es), whether it wants to).
    Only when no rank's local checks failed, every rank wants to, and the ranks' dp meshes split
    the world into equal disjoint groups, each holding its own rank (a (dp, tp) layout)."""
    if any(e is not None for e, _, _ in votes) or not all(w for _, _, w in votes):
        return False
    groups = {ranks for _, ranks, _ in votes}
    flat = sorted(x for g in groups for x in g)
    return (flat == list(range(len(votes))) and len({len(g) for g in groups}) == 1
            and all(r in ranks for r, (_, ranks, _) in enumerate(votes)))


def require_fsdp_meshes(grid: Grid, device_type: str,
                        fsdp_meshes: Sequence[tuple[str, tuple[int, ...], str]],
                        dp_dims: Any = None, fsdp_dims: Sequence[tuple[str, Any]] = ()) -> None:
    """Raise ``ValueError`` naming every problem :func:`check_fsdp_meshes` finds (``dmuon.Muon``
    on a model ``fully_shard`` put on a mesh over other ranks or another device type), and
    :func:`dmuon.functional.spmd_mesh.fsdp_dims_problem`'s: ``fsdp_dims`` (FSDP2's recorded
    ``dp_mesh_dims`` per module) other than ``dp_dims`` (``dedicate_params``')."""
    from dmuon.functional.spmd_mesh import fsdp_dims_problem
    problems = check_fsdp_meshes(grid, device_type, fsdp_meshes)
    dims_problem = fsdp_dims_problem(dp_dims, fsdp_dims)
    problems += (dims_problem,) if dims_problem else ()
    if problems:
        raise ValueError("dmuon.Muon: " + " | ".join(problems))


def already_dedicated(released: bool) -> str:
    """``dedicate_params`` on a model it prepared before (``released``: then ``dmuon.release``d)."""
    if released:
        return ("dedicate_params: this model was released by dmuon.release(model): its dedicated "
                "matrices' values went with dmuon's state (each rank holds empty placeholders), so "
                "it cannot be dedicated again. Build a new model (or load saved values into one) "
                "and dedicate that. Nothing was changed.")
    return ("dedicate_params was already called on this model (on this rank); call it once per "
            "model, on every rank, before fully_shard. Nothing was changed.")
