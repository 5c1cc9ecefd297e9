"""Data-parallel axes of a full SPMD mesh (pure): ``fully_shard(..., dp_mesh_dims=...)``.

torch's FSDP2 (2.13+) takes either a 1-D mesh (FSDP) / 2-D mesh (HSDP), or the *full* SPMD mesh
of the model (data-parallel, TP, CP, EP axes together) plus ``DataParallelMeshDims(shard=...,
replicate=...)`` naming which of its axes are data-parallel (several names: flattened into one
axis). torchtitan 0.3 applies FSDP2 that way by default. dmuon reads the same two things: the
shard and replicate axes come from the names, never from how many dims or ranks the mesh has;
every other axis of size > 1 is a model axis (TP), on which a dedicated matrix's DTensor
placements say whether and how it is sliced.

These functions decide; :mod:`dmuon.stateful.setup.dedicate` acts (slices the meshes, builds the
layouts). The placements are passed as plain descriptions (``("R", None)``, ``("S", dim)``, or
``(other name, None)``) so that this file imports no torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

__all__ = ["DPAxes", "SPMD_FIX", "dp_axes", "names_of", "spmd_slicing", "placement_kind",
           "fsdp_dims_problem", "plain_params_problem", "spmd_meshes", "SpmdTypes",
           "spmd_types_kinds"]

#: how to hand dmuon the mesh of an FSDP2 applied with ``dp_mesh_dims`` (ends errors)
SPMD_FIX = ("Pass dedicate_params the mesh and dp_mesh_dims that fully_shard gets: "
            "dmuon.dedicate_params(model, spmd_mesh, predicate, options=dmuon.DedicateOptions("
            "dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...))); in torchtitan 0.3: "
            "spmd_mesh, dp_mesh_dims = torchtitan.distributed.full_dtensor.resolve_fsdp_mesh("
            "parallel_dims)")

Names = Union[str, Sequence[str], None]


def names_of(value: Names) -> tuple[str, ...]:
    """``DataParallelMeshDims.shard`` / ``.replicate`` as a tuple of names (``None``: none)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


@dataclass(frozen=True)
class DPAxes:
    """The axes of a full SPMD mesh, by role.

    Attributes:
      shard: the data-parallel axes FSDP2 shards over (flattened in this order), maybe empty.
      replicate: the HSDP replicate axes (flattened in this order), maybe empty.
      model: every other axis of size > 1 (TP, CP, EP): a dedicated matrix may be sliced on one.
      sizes: ``{axis name: size}`` of every axis of the mesh.
    """

    shard: tuple[str, ...]
    replicate: tuple[str, ...]
    model: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]

    def size(self, names: Sequence[str]) -> int:
        """The number of ranks of ``names`` flattened (1 for none)."""
        by = dict(self.sizes)
        out = 1
        for n in names:
            out *= by[n]
        return out

    @property
    def dp(self) -> tuple[str, ...]:
        return self.shard + self.replicate


def dp_axes(dim_names: Optional[Sequence[str]], sizes: Sequence[int], shard: Names,
            replicate: Names) -> DPAxes:
    """The roles of the axes of a mesh with ``dim_names`` / ``sizes`` under
    ``DataParallelMeshDims(shard, replicate)``.

    Raises:
      ValueError: the mesh has no dim names; neither shard nor replicate is named; a name is not
        a dim of the mesh, or is named twice; only ``replicate`` is named (pure DDP over an SPMD
        mesh: dmuon's ``data_parallel="ddp"`` takes a 1-D mesh). Each message says how to fix it.
    """
    sh, rep = names_of(shard), names_of(replicate)
    if not dim_names:
        raise ValueError("DedicateOptions(dp_mesh_dims=...) needs a mesh with named dims "
                         "(init_device_mesh(..., mesh_dim_names=...)). " + SPMD_FIX)
    names = tuple(str(n) for n in dim_names)
    if len(names) != len(sizes):
        raise ValueError(f"mesh dim names {names} do not match its shape {tuple(sizes)}")
    if not sh and not rep:
        raise ValueError("dp_mesh_dims names no axis: set shard= (and replicate= for HSDP). "
                         + SPMD_FIX)
    unknown = [n for n in sh + rep if n not in names]
    if unknown:
        raise ValueError(f"dp_mesh_dims names {unknown}, which are not dims of the mesh {names}. "
                         + SPMD_FIX)
    twice = sorted({n for n in sh + rep if (sh + rep).count(n) > 1})
    if twice:
        raise ValueError(f"dp_mesh_dims names {twice} more than once (shard={sh}, "
                         f"replicate={rep}); an axis is either sharded or replicated")
    if not sh:
        raise ValueError(
            f"dp_mesh_dims has replicate={rep} and no shard axis (DDP over an SPMD mesh), which "
            "dedicate_params does not take: for DDP pass the 1-D mesh of the DDP ranks with "
            "options=DedicateOptions(data_parallel='ddp'), or name a shard axis (of size 1 "
            "if need be)")
    by = dict(zip(names, (int(s) for s in sizes)))
    model = tuple(n for n in names if n not in sh + rep and by[n] > 1)
    return DPAxes(sh, rep, model, tuple(by.items()))


def placement_kind(placement: Any, shard_type: type, replicate_type: type) -> tuple[str, Any]:
    """A DTensor placement as this module's plain description: ``("R", None)`` for a
    ``Replicate``, ``("S", dim)`` for exactly a ``Shard`` (not a subclass), else
    ``(type name, None)``."""
    if type(placement) is replicate_type:
        return ("R", None)
    if type(placement) is shard_type:
        return ("S", int(placement.dim))
    return (type(placement).__name__, None)


@dataclass(frozen=True)
class SpmdTypes:
    """A plain param's ``spmd_types`` annotations (torchtitan 0.3's default backend), as plain
    descriptions (:func:`dmuon.compat.spmd_mesh.spmd_types_of` reads them).

    Attributes:
      axes: per axis the annotation names, ``(label, letter, mesh dim, size)``: ``letter`` is its
        local type (``"R"`` replicate, ``"I"`` invariant, ``"V"`` varying, ``"P"`` partial),
        ``mesh dim`` the dim of the mesh given to ``dedicate_params`` that is the same axis
        (``None``: none is, e.g. the dp axes flattened).
      spec: its ``PartitionSpec``, per tensor dim the labels of the axes that shard it (``None``:
        it has none).
      shape: the local tensor's shape.
    """

    axes: tuple[tuple[str, str, Optional[str], int], ...]
    spec: Optional[tuple[tuple[str, ...], ...]]
    shape: tuple[int, ...]


def spmd_types_kinds(name: str, types: SpmdTypes, dim_names: Sequence[str], axes: DPAxes
                     ) -> tuple[list[tuple[str, Any]], tuple[int, ...]]:
    """A plain param's ``spmd_types`` annotations as the placements of a DTensor on the mesh
    (``dim_names``): ``(kinds, full shape)``, ``kinds`` as :func:`placement_kind`'s per mesh dim
    (feed :func:`spmd_slicing`): ``R`` / ``I`` on an axis is ``("R", None)``, ``V`` with the axis
    alone on tensor dim ``d`` of its ``PartitionSpec`` is ``("S", d)``, ``P`` is ``("P", None)``
    (which :func:`spmd_slicing` refuses on every axis of size > 1). An axis the annotations leave
    out is ``Replicate`` on a data-parallel axis (FSDP2 shards it there) and unknown on a model
    axis. The full shape is the local one times the axis size on the sliced dim.

    Raises:
      ValueError (naming the param and what to do): ``V`` without a ``PartitionSpec`` that puts the
        axis on exactly one tensor dim, alone; ``V`` / ``P`` on an axis that is no dim of the mesh;
        a model axis of size > 1 the annotations leave out.
    """
    advice = ("dmuon dedicates matrices that are whole on every model axis or sliced by one plain "
              "S(dim) on one; leave this one to FSDP2 and AdamW (the predicate or a policy rule)")
    by_dim: dict[str, tuple[str, Any]] = {}
    full = list(types.shape)
    for label, letter, dim_name, size in types.axes:
        if letter in ("R", "I") or size <= 1:
            if dim_name is not None:
                by_dim[dim_name] = ("R", None)
            continue
        if dim_name is None:
            raise ValueError(
                f"param {name!r}: its spmd_types type is {letter} on the mesh axis {label}, which "
                f"is not a dim of the mesh given to dedicate_params {tuple(dim_names)}; pass the "
                f"full SPMD mesh (resolve_fsdp_mesh's). {advice}.")
        if letter != "V":
            by_dim[dim_name] = (letter, None)
            continue
        dims = [d for d, entry in enumerate(types.spec or ()) if label in entry]
        if len(dims) != 1 or types.spec[dims[0]] != (label,):
            raise ValueError(
                f"param {name!r}: its spmd_types type is V on the mesh axis {label} with the "
                f"PartitionSpec {types.spec}, which does not put {label} alone on one tensor dim, "
                f"so dmuon cannot tell how its local tensor is cut from the matrix. {advice}.")
        by_dim[dim_name] = ("S", dims[0])
        full[dims[0]] *= size
    kinds = []
    for dim_name, size in axes.sizes:
        kind = by_dim.get(dim_name)
        if kind is None and size > 1 and dim_name not in axes.dp:
            raise ValueError(
                f"param {name!r}: its spmd_types annotations {[a[:2] for a in types.axes]} name "
                f"no type on the model axis {dim_name!r} (size {size}), so dmuon cannot tell "
                f"whether it is sliced there. {advice}.")
        kinds.append(kind or ("R", None))
    return kinds, tuple(full)


def spmd_slicing(name: str, shape: Sequence[int], dim_names: Sequence[str],
                 kinds: Sequence[tuple[str, Any]], axes: DPAxes) -> Optional[tuple[str, int]]:
    """How a dedicated matrix that is a DTensor on the full SPMD mesh is sliced: ``None`` when it
    is whole on every rank (``Replicate`` on every axis of size > 1), else ``(model axis, dim)``:
    ``Shard(dim)`` on that one model axis (tensor parallelism; dmuon then dedicates each slice in
    its own data-parallel grid).

    Args:
      kinds: :func:`placement_kind` of each placement, in mesh-dim order.

    Raises:
      ValueError: a data-parallel axis does not hold it ``Replicate`` (FSDP2's own rule for
        ``dp_mesh_dims``), it is sliced on more than one model axis, or by a placement other
        than a plain ``Shard`` (``Partial``, ``_StridedShard``): each message names the param.
    """
    by = dict(axes.sizes)
    if len(kinds) != len(dim_names):
        raise ValueError(f"param {name!r}: {len(kinds)} placements on a {len(dim_names)}-D mesh")
    sliced: list[tuple[str, int]] = []
    for axis, (kind, dim) in zip(dim_names, kinds):
        if by.get(axis, 1) <= 1 or kind == "R":
            continue
        if axis in axes.dp:
            raise ValueError(
                f"param {name!r} has {kind}{'' if dim is None else f'({dim})'} on the "
                f"data-parallel axis {axis!r}; with dp_mesh_dims every param must be Replicate() "
                "on the data-parallel axes (FSDP2 shards it there itself). Distribute it with "
                "Replicate() on those axes.")
        if kind != "S":
            raise ValueError(
                f"param {name!r} has {kind} on the model axis {axis!r}; dmuon dedicates matrices "
                "that are whole or sliced by one plain Shard(0) / Shard(1) on one model axis. "
                "Leave it to FSDP2 and AdamW (the predicate or a policy rule).")
        sliced.append((axis, int(dim) % max(len(shape), 1)))
    if len(sliced) > 1:
        raise ValueError(f"param {name!r} (shape {tuple(shape)}) is sliced on several model axes "
                         f"{[a for a, _ in sliced]}; dmuon dedicates matrices sliced on one model "
                         "axis at most. Leave it to FSDP2 and AdamW (the predicate or a policy "
                         "rule).")
    return sliced[0] if sliced else None


def fsdp_dims_problem(given: Optional[tuple[tuple[str, ...], tuple[str, ...]]],
                      recorded: Sequence[tuple[str, Optional[tuple[tuple[str, ...],
                                                                   tuple[str, ...]]]]]
                      ) -> Optional[str]:
    """Whether ``fully_shard`` used the data-parallel axes dmuon was given.

    Args:
      given: ``(shard names, replicate names)`` of ``DedicateOptions(dp_mesh_dims=...)``, or
        ``None`` when it got none.
      recorded: ``(module name, (shard names, replicate names) or None)`` of every FSDP2 param
        group of the model (FSDP2's recorded ``dp_mesh_dims``).

    Returns:
      ``None`` when they agree, else what is wrong and how to fix it: ``fully_shard`` got
      ``dp_mesh_dims`` and dmuon did not (dmuon would read a full SPMD mesh by its rank count),
      or the two name other axes.
    """
    bad = [(m, r) for m, r in recorded if r != given]
    if not bad:
        return None
    mods = sorted({m or "<root>" for m, _ in bad})
    rec = sorted({r for _, r in bad}, key=repr)
    shown = ", ".join("none" if r is None else f"shard={r[0]}, replicate={r[1]}" for r in rec)
    if given is None:
        return (f"fully_shard was applied with dp_mesh_dims ({shown}) on a full SPMD mesh "
                f"(modules {mods[:4]}{' ...' if len(mods) > 4 else ''}), but dedicate_params got "
                "none, so dmuon would take the mesh's rank count for the data-parallel axes. "
                + SPMD_FIX + ".")
    return (f"fully_shard's dp_mesh_dims ({shown}; modules {mods[:4]}"
            f"{' ...' if len(mods) > 4 else ''}) differ from dedicate_params' (shard={given[0]}, "
            f"replicate={given[1]}): the dedicated and the FSDP2 gradients would be averaged over "
            "different ranks. " + SPMD_FIX + ".")


def plain_params_problem(plain: Sequence[str], annotated: Sequence[str],
                         axes: Optional[DPAxes]) -> Optional[str]:
    """Why dmuon cannot dedicate the selected params that are plain tensors (not DTensors), or
    ``None``.

    Args:
      plain: the selected params that are plain tensors.  annotated: those of them that carry
        ``spmd_types`` annotations (torchtitan 0.3's default backend keeps each param a plain
        local tensor, a TP slice included, and records its layout in them:
        :func:`spmd_types_kinds` reads it).
      axes: the mesh's roles from ``dp_mesh_dims``, or ``None`` when dedicate_params got none.

    A problem: annotations without ``dp_mesh_dims`` (the mesh dmuon was given is not the one
    FSDP2 gets); plain tensors without annotations on a mesh with a model axis of size > 1 (a TP
    slice cannot be told from a whole matrix).
    """
    if axes is None:
        if not annotated:
            return None
        return (f"dedicate_params: the selected params (e.g. {annotated[0]!r}) carry spmd_types "
                "annotations (torchtitan 0.3's default parallelism.spmd_backend='spmd_types', "
                "where fully_shard runs on the full SPMD mesh with dp_mesh_dims), but "
                f"dedicate_params got no dp_mesh_dims. {SPMD_FIX}.")
    bare = [n for n in plain if n not in set(annotated)]
    if bare and axes.model:
        return (f"dedicate_params: the mesh has the model axes {list(axes.model)} of size > 1 "
                f"but {len(bare)} selected params (e.g. {bare[0]!r}) are plain tensors without "
                "spmd_types annotations, not DTensors, so dmuon cannot tell a TP slice from a "
                "whole matrix. dmuon takes tensor parallelism from DTensor placements or from "
                "spmd_types annotations (torchtitan 0.3's parallelize records them): make the "
                "model's params DTensors on the mesh, or annotate them (spmd_types.assert_type "
                "with a PartitionSpec), or leave them to AdamW (the predicate).")
    return None


def spmd_meshes(mesh: Any, replicate_mesh: Any, dp_mesh_dims: Any, *,
                sub_mesh: Callable[[Any, Sequence[str]], Any]
                ) -> tuple[Any, Any, Optional[DPAxes], Optional[Exception]]:
    """``(shard mesh, replicate mesh, axes, error)`` for ``dedicate_params(mesh, replicate_mesh,
    dp_mesh_dims=...)``: without ``dp_mesh_dims`` the meshes as given and no axes; with it, the
    sub-meshes of the full SPMD ``mesh`` it names (:func:`dp_axes`), made by ``sub_mesh(mesh,
    names)`` (:func:`dmuon.compat.spmd_mesh.axes_mesh`).
    A problem is returned as ``error`` (the meshes as given), for every rank to raise together."""
    if dp_mesh_dims is None:
        return mesh, replicate_mesh, None, None
    try:
        if replicate_mesh is not None:
            raise ValueError("dedicate_params: pass dp_mesh_dims or replicate_mesh, not both (with"
                             f" dp_mesh_dims, dp_mesh_dims.replicate names the axes). {SPMD_FIX}")
        axes = dp_axes(getattr(mesh, "mesh_dim_names", None), tuple(mesh.mesh.shape),
                       getattr(dp_mesh_dims, "shard", None), getattr(dp_mesh_dims, "replicate",
                                                                    None))
        return (sub_mesh(mesh, axes.shard),
                sub_mesh(mesh, axes.replicate) if axes.replicate else None, axes, None)
    except (ValueError, AttributeError, TypeError) as e:
        return mesh, replicate_mesh, None, e
