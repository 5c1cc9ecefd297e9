"""Tensor parallelism's part of the plan (pure): which TP index runs each matrix's Newton–Schulz,
and the bytes the owners' TP group moves per step.

With TP degree ``T`` the ``T`` owners of a matrix's slices (one per TP index, at one dp
coordinate) gather their NS inputs to one of them, the *root*, which runs NS on the assembled
``(M, N)`` matrix and scatters each owner its slice of the result
(:mod:`dmuon.stateful.modes.tensor_parallel`). Roots balance the NS work over the TP group.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from dmuon.functional.buckets import BucketKey
from dmuon.functional.matrix_view import Batch, Sliced
from dmuon.functional.policy import Decision
from dmuon.functional.schedule import Gather, Scatter, Schedule

__all__ = ["ns_cost", "tp_roots", "tp_step_schedule", "grid_tp_schedule", "tp_step_bytes",
           "with_tp_views", "TPLayout", "tp_slicing_problem"]


def ns_cost(shape: Sequence[int]) -> int:
    """Relative cost of one Newton–Schulz iteration on an ``(M, N)`` matrix: ``M N min(M, N)``."""
    m, n = (int(d) for d in shape)
    return m * n * min(m, n)


def tp_roots(shapes: Mapping[str, Sequence[int]], parts: int) -> dict[str, int]:
    """The root TP index of each matrix of one TP group: largest NS cost first, onto the least
    loaded index (ties: the lower index, then the name order of ``shapes``).

    Args:
      shapes: ``{name: full (M, N)}`` of the TP-sliced matrices one dp coordinate owns, in the
        model's order (the same on every rank of the TP group).
      parts: the TP degree ``T``.

    Returns:
      dict: ``{name: t}`` with ``0 <= t < T``.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    load = [0] * parts
    roots: dict[str, int] = {}
    for n in sorted(shapes, key=lambda n: -ns_cost(shapes[n])):  # stable: model order on ties
        t = min(range(parts), key=lambda i: (load[i], i))
        roots[n] = t
        load[t] += ns_cost(shapes[n])
    return roots


def tp_step_schedule(groups: Sequence[Sequence[int]],
                     shapes: Sequence[Mapping[str, Sequence[int]]],
                     dtypes: Mapping[str, str], world_size: int,
                     roots: Optional[Sequence[Mapping[str, int]]] = None) -> Schedule:
    """The TP groups' NS gathers and scatters of one step, as a schedule (lane ``"tp"``).

    Each matrix of ``P`` elements is one bucket ``BucketKey("tp:<name>", k, dtype)`` holding the
    ``T`` slices one after the other (slice ``j`` at ``[j P/T, (j+1) P/T)``: the root concatenates
    them along the sliced dim); a ``Gather`` to the root (:func:`tp_roots`), then (after NS on
    the root) a ``Scatter`` from it. The mesh is the world as one shard axis
    (``shard_size = world_size``), so members are global ranks.

    Args:
      groups: the TP groups, each its global ranks in TP order (slice ``j`` on ``groups[k][j]``).
      shapes: per group, ``{name: full (M, N)}`` of the TP-sliced matrices it owns, in model order.
      dtypes: ``{name: str(torch dtype)}`` of the NS inputs (the master dtype).
      world_size: ranks of the world.
      roots: per group, ``{name: root TP index}`` (default: :func:`tp_roots`).
    """
    ops: list = []
    for k, (members, mats) in enumerate(zip(groups, shapes)):
        T = len(members)
        root = tp_roots(mats, T) if roots is None else roots[k]
        for n, shape in mats.items():
            m, c = (int(d) for d in shape)
            numel, piece = m * c, m * c // T
            key = BucketKey(f"tp:{n}", k, dtypes[n])
            parts = tuple((j * piece, piece) for j in range(T))
            common = dict(axis="group", at=None, bucket=key, offset=0, numel=numel,
                          dtype=dtypes[n], lane="tp", members=tuple(int(x) for x in members),
                          parts=parts)
            gid = f"tp-gather|{k}|{n}"
            ops.append(Gather(id=gid, dst=root[n], **common))
            ops.append(Scatter(id=f"tp-scatter|{k}|{n}", src=root[n], waits=(gid,), **common))
    return Schedule(ops=tuple(ops), shard_size=int(world_size), replicate_size=1)



def grid_tp_schedule(tp_grids: Sequence[Sequence[Sequence[int]]],
                     owners: Mapping[str, Sequence[int]], shapes: Mapping[str, Sequence[int]],
                     dtypes: Mapping[str, str], world_size: int) -> Schedule:
    """:func:`tp_step_schedule` over one dp grid per TP index (``tp_grids[t][r][s]``): the TP
    group of each ``(s, r)`` (its ranks in TP order) runs the NS of the TP-sliced matrices of
    ``shapes`` (full shapes, in model order) whose owner is ``(s, r)``."""
    R, G = len(tp_grids[0]), len(tp_grids[0][0])
    coords = [(s, r) for r in range(R) for s in range(G)]
    return tp_step_schedule(
        [[tg[r][s] for tg in tp_grids] for s, r in coords],
        [{n: sh for n, sh in shapes.items() if tuple(owners[n]) == c} for c in coords],
        dtypes, world_size=world_size)

def tp_step_bytes(shapes: Mapping[str, Sequence[int]], roots: Mapping[str, int], parts: int,
                  dtypes: Mapping[str, str]) -> list[int]:
    """Bytes each TP index of one TP group receives per step for the NS of its matrices, from
    :func:`tp_step_schedule`'s accounting: the root of a matrix of ``P`` bytes receives
    ``(T-1)/T P`` (the other slices of the NS input), every other index ``P/T`` (its slice of
    the result).

    Args:
      shapes: ``{name: full (M, N)}``.  roots: ``{name: root TP index}`` (:func:`tp_roots`).
      parts: ``T``.  dtypes: ``{name: str(torch dtype)}`` of the NS inputs.

    Returns:
      ``[bytes received by TP index t for t in range(T)]``.
    """
    tr = tp_step_schedule([list(range(parts))], [shapes], dtypes, parts, roots=[roots]).traffic()
    return [tr.rank_received(t) for t in range(parts)]


def with_tp_views(decisions: Mapping[str, Decision], views: Mapping[str, Sliced], *,
                  error: Callable[[str], Exception] = NotImplementedError) -> dict[str, Decision]:
    """The policy's ``decisions`` with the :class:`~dmuon.functional.matrix_view.Sliced` view
    (``views``) of each TP-sliced matrix.

    Raises:
      ``error``: a TP-sliced matrix whose decided view is not the default ``Batch(0)`` (a rule or
        ``batch_dims`` would need the full matrix before TP).
    """
    out = dict(decisions)
    for n, view in views.items():
        d = decisions[n]
        if d.view != Batch(0):
            raise error(
                f"dedicate_params: {n!r} is tensor-parallel, and its matrix view {d.view} (from "
                f"{d.source}) would need the full matrix before TP; dmuon supports the default "
                "view of TP-sliced matrices only. Drop its view rule / batch_dims for it.")
        out[n] = dataclasses.replace(d, view=view, source="tensor parallel")
    return out


@dataclass(frozen=True)
class TPLayout:
    """How tensor parallelism splits one dedicated matrix.

    Attributes:
      mesh: the 1-D TP ``DeviceMesh``.  placements: the DTensor's placements (``(Shard(dim),)``).
      shape, stride: the full matrix's.  dim: the sharded dim (0: rows, 1: columns).
      parts: ``T``, the TP degree.
      group: the 1-D TP mesh when ``mesh`` is a full SPMD mesh (``dp_mesh_dims``; ``placements``
        are then its placements on every axis), else ``None`` (``mesh`` is the TP mesh).
      local: the model computes on the plain local slice (a param with ``spmd_types``
        annotations: torchtitan 0.3's default backend, whose forward runs TP's collectives
        itself), so its forward is shown that slice, not a DTensor.
    """

    mesh: Any
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dim: int
    parts: int
    group: Any = None
    local: bool = False

    def view(self) -> Sliced:
        """The matrix view NS and the shape scale see
        (:class:`~dmuon.functional.matrix_view.Sliced`)."""
        return Sliced(self.dim, self.parts)



def tp_slicing_problem(shape: Sequence[int], placements: tuple, mesh_ndim: int, parts: int, *,
                       contiguous: bool, tied: bool) -> Optional[str]:
    """Why dmuon cannot dedicate a TP ``DTensor`` of (full) ``shape`` with ``placements`` on a
    ``mesh_ndim``-D mesh of ``parts`` ranks (``None``: it can). ``contiguous``: its placement is a
    plain ``Shard`` (the slices one after the other); ``tied``: shared by several modules."""
    if mesh_ndim != 1 or len(placements) != 1:
        return "the mesh is not the 1-D TP mesh (was fully_shard applied before dedicate_params?)"
    if len(shape) != 2 or not placements[0].is_shard():
        return "not a row- or column-sharded 2-D matrix"
    if not contiguous:  # e.g. _StridedShard (a fused qkv): slices interleave
        return (f"{type(placements[0]).__name__} interleaves the slices (a fused weight's TP "
                "layout); dmuon assembles contiguous Shard slices only")
    dim = placements[0].dim % 2
    if shape[dim] % parts:
        return f"its dim {dim} ({shape[dim]}) is not divisible by the TP degree {parts}"
    if tied:
        return "it is tied (shared by several modules)"
    return None
