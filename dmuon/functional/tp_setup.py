"""Tensor parallelism's decisions at ``dedicate_params`` (pure): the layouts of the TP-sliced
dedicated matrices, the modes they combine with, and their decided matrix views
(:mod:`dmuon.stateful.setup.dedicate`; the TP part of the plan: :mod:`dmuon.functional.tp_plan`)."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from dmuon.functional.matrix_view import Sliced
from dmuon.functional.policy import Decision
from dmuon.functional.spmd_mesh import (SPMD_FIX, DPAxes, SpmdTypes, placement_kind,
                                        plain_params_problem, spmd_slicing, spmd_types_kinds)
from dmuon.functional.tp_plan import TPLayout, tp_slicing_problem, with_tp_views

__all__ = ["tp_layouts_of", "tp_mesh_ranks", "tp_decisions", "spmd_layouts_of", "TP_FIX",
           "tp_after_dedicate", "tp_not_supported"]

#: what to do instead (named by every TP error)
TP_FIX = ("apply tensor parallelism first (parallelize_module with ColwiseParallel / "
          "RowwiseParallel on a 1-D TP mesh), then dmuon.dedicate_params(model, mesh['dp'], "
          "predicate), then fully_shard(..., mesh=mesh['dp']); or train with tp = 1")


def tp_after_dedicate(name: str, owner: object) -> str:
    """DTensor's API touched dedicated param ``name`` after ``dedicate_params``."""
    return (f"dmuon: tensor parallelism (DTensor distribute_tensor / parallelize_module) was "
            f"applied to the dedicated param {name!r} (owner rank {owner}) after "
            f"dedicate_params. {TP_FIX}.")


def tp_not_supported(what: str, names: Sequence[str]) -> str:
    """``what`` met the TP-sliced dedicated matrices ``names``, which it does not handle yet."""
    return (f"dmuon: {what} does not support tensor-parallel dedicated matrices yet (this model "
            f"has {len(names)}, e.g. {sorted(names)[:3]}). Nothing was changed. Supported with "
            "TP: forward, backward, dmuon.Muon.step, dmuon.clip_grad_norm_, and checkpoints as "
            "full tensors: dmuon.get_model_state_dict / set_model_state_dict and "
            "dmuon.get_optimizer_state_dict / set_optimizer_state_dict.")


def tp_layouts_of(dtensors: Mapping[str, Any], aliases: Mapping[int, Sequence[str]], *,
                  shard_type: type, fix: str,
                  error: Callable[[str], Exception]) -> dict[str, TPLayout]:
    """The :class:`~dmuon.functional.tp_plan.TPLayout` of every TP ``DTensor`` of ``dtensors``
    (``{name: DTensor}``, read by its placements, mesh, shape and stride), validated by
    :func:`~dmuon.functional.tp_plan.tp_slicing_problem`.

    Args:
      aliases: ``{id(param): its names}`` (:func:`dmuon.functional.selection.names_by_object`):
        a param with several is tied.
      shard_type: DTensor's ``Shard`` (a placement of a subclass interleaves the slices).

    Raises:
      ``error``: a layout dmuon does not support (naming it), or params on different TP meshes
        (the messages end with ``fix``).
    """
    out: dict[str, TPLayout] = {}
    meshes = set()
    for n, p in dtensors.items():
        pl, mesh = tuple(p.placements), p.device_mesh
        why = tp_slicing_problem(tuple(p.shape), pl, mesh.ndim, mesh.size(),
                                 contiguous=bool(pl) and type(pl[0]) is shard_type,
                                 tied=len(aliases.get(id(p), ())) > 1)
        if why is not None:
            raise error(
                f"dedicate_params: param {n!r} is a DTensor of shape {tuple(p.shape)} with "
                f"placements {pl} on a {mesh.ndim}-D mesh: {why}. dmuon dedicates 2-D matrices "
                "that TP shards with one Shard(0) (ColwiseParallel) or Shard(1) (RowwiseParallel) "
                f"on a 1-D TP mesh. {fix}.")
        meshes.add(tuple(mesh.mesh.flatten().tolist()))
        out[n] = TPLayout(mesh, pl, tuple(p.shape), tuple(p.stride()), pl[0].dim % 2, mesh.size())
    if len(meshes) > 1:
        raise error(
            f"dedicate_params: the TP-sharded params live on different TP meshes {sorted(meshes)}; "
            f"dmuon needs one TP mesh. {fix}.")
    return out


def tp_mesh_ranks(layouts: Mapping[str, TPLayout]) -> Optional[tuple[int, ...]]:
    """The global ranks of this rank's TP group in TP order (``None`` without TP layouts)."""
    for lay in layouts.values():
        mesh = lay.mesh if lay.group is None else lay.group
        return tuple(int(x) for x in mesh.mesh.flatten().tolist())
    return None


def spmd_layouts_of(dtensors: Mapping[str, Any], aliases: Mapping[int, Sequence[str]],
                    axes: Optional[DPAxes], *, shard_type: type, replicate_type: type, fix: str,
                    error: Callable[[str], Exception], plain: Sequence[str] = (),
                    annotated: Sequence[str] = (), typed: Optional[Mapping[str, Any]] = None,
                    spmd_mesh: Any = None
                    ) -> tuple[dict[str, TPLayout], dict[str, TPLayout]]:
    """The dedicated matrices that are DTensors on a full SPMD mesh (``axes``: its roles, from
    ``dp_mesh_dims``; :mod:`dmuon.functional.spmd_mesh`), or plain tensors with ``spmd_types``
    annotations on it: ``(TP-sliced layouts, whole views)``.
    A sliced one gets a :class:`~dmuon.functional.tp_plan.TPLayout` whose ``group`` is its 1-D TP
    mesh (checked as on that mesh by :func:`tp_layouts_of`); a whole DTensor (``Replicate()`` on
    every axis of size > 1) a layout of one part, so that the forward sees it as the DTensor it
    was; a whole annotated plain tensor nothing (it is a plain matrix). Without ``axes``, a DTensor
    on a mesh of several dims raises ``ValueError`` saying to pass ``dp_mesh_dims``; else this is
    :func:`tp_layouts_of`'s answer and no views.

    Args:
      plain, annotated: the selected params that are plain tensors, and those of them with
        ``spmd_types`` annotations (:func:`~dmuon.functional.spmd_mesh.plain_params_problem`).
      typed: ``{name: (param, the fields of its SpmdTypes)}`` of the annotated ones
        (:func:`dmuon.compat.spmd_mesh.spmd_types_of`); their layouts are ``local`` (the forward
        computes on the plain slice) and their placements the DTensor ones the annotations mean.
      spmd_mesh: the full SPMD mesh (``typed``'s TP sub-meshes are sliced from it).

    Raises:
      ValueError: from :func:`~dmuon.functional.spmd_mesh.spmd_slicing` /
        :func:`~dmuon.functional.spmd_mesh.spmd_types_kinds` (naming the param) or
        :func:`~dmuon.functional.spmd_mesh.plain_params_problem`; ``error``: as
        :func:`tp_layouts_of`.
    """
    why = plain_params_problem(tuple(plain), tuple(annotated), axes)
    if why is not None:
        raise ValueError(why)
    if axes is None:
        multi = sorted(n for n, p in dtensors.items() if p.device_mesh.ndim > 1)
        if multi:
            p = dtensors[multi[0]]
            raise ValueError(
                f"dedicate_params: {len(multi)} selected params (e.g. {multi[0]!r}) are DTensors "
                f"on a {p.device_mesh.ndim}-D mesh {tuple(p.device_mesh.mesh_dim_names or ())} "
                "(a full SPMD mesh, as fully_shard(..., dp_mesh_dims=...) takes), but "
                f"dedicate_params got no dp_mesh_dims to tell its data-parallel axes. {SPMD_FIX}.")
        return tp_layouts_of(dtensors, aliases, shard_type=shard_type, fix=fix, error=error), {}
    sliced: dict[str, Any] = {}
    views: dict[str, TPLayout] = {}
    for n, p in dtensors.items():
        mesh, pl = p.device_mesh, tuple(p.placements)
        names = tuple(mesh.mesh_dim_names or ())
        got = spmd_slicing(n, tuple(p.shape), names,
                           [placement_kind(x, shard_type, replicate_type) for x in pl], axes)
        if got is None:
            views[n] = TPLayout(mesh, pl, tuple(p.shape), tuple(p.stride()), 0, 1)
        else:
            sliced[n] = (_Typed(p, p.device_mesh, pl, tuple(p.shape), tuple(p.stride()), False),
                         mesh[got[0]], pl[names.index(got[0])])
    names = tuple(spmd_mesh.mesh_dim_names or ()) if typed else ()
    for n, (p, fields) in (typed or {}).items():
        kinds, full = spmd_types_kinds(n, SpmdTypes(*fields), names, axes)
        got = spmd_slicing(n, full, names, kinds, axes)
        if got is not None:  # a whole annotated matrix is a plain one: nothing to record
            pl = tuple(shard_type(d) if k == "S" else replicate_type() for k, d in kinds)
            sliced[n] = (_Typed(p, spmd_mesh, pl, full, _contiguous_stride(full), True),
                         spmd_mesh[got[0]], pl[names.index(got[0])])
    one_d = {n: _OnTPMesh(t, group, placement) for n, (t, group, placement) in sliced.items()}
    ties = {id(one_d[n]): aliases.get(id(sliced[n][0].param), ()) for n in one_d}
    layouts = tp_layouts_of(one_d, ties, shard_type=shard_type, fix=fix, error=error)
    return {n: TPLayout(sliced[n][0].device_mesh, sliced[n][0].placements, lay.shape,
                        lay.stride, lay.dim, lay.parts, lay.mesh, sliced[n][0].local)
            for n, lay in layouts.items()}, views


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(tuple(shape)):
        out.append(step)
        step *= int(d)
    return tuple(reversed(out))


class _Typed:
    """A sliced dedicated matrix on a full SPMD mesh: ``param`` (its ties are looked up by it),
    the mesh, the placements (a DTensor's, or those its spmd_types annotations mean), the full
    shape and stride, and whether the forward computes on the plain slice (``local``)."""

    def __init__(self, param: Any, device_mesh: Any, placements: tuple, shape: tuple,
                 stride: tuple, local: bool):
        self.param, self.device_mesh, self.placements = param, device_mesh, placements
        self.shape, self.stride, self.local = shape, stride, local


class _OnTPMesh:
    """A sliced matrix on a full SPMD mesh (:class:`_Typed`) seen as on its 1-D TP mesh (what
    :func:`tp_layouts_of` reads)."""

    def __init__(self, t: _Typed, group: Any, placement: Any):
        self.device_mesh, self.placements, self.shape = group, (placement,), t.shape
        self.stride = lambda: t.stride


def tp_decisions(decisions: Mapping[str, Decision], views: Mapping[str, Sliced], *,
                 data_parallel: str, on_meta: bool, fix: str,
                 error: Callable[[str], Exception]) -> dict[str, Decision]:
    """The policy's ``decisions`` with the :class:`~dmuon.functional.matrix_view.Sliced` view
    (``views``) of each TP-sliced matrix (:func:`~dmuon.functional.tp_plan.with_tp_views`).

    Raises:
      ``error``: TP-sliced matrices (``views`` not empty) with ``data_parallel="ddp"`` or on the
        meta device, which TP does not support yet (the message ends with ``fix``); a view
        :func:`~dmuon.functional.tp_plan.with_tp_views` refuses.
    """
    if views and (data_parallel != "fsdp" or on_meta):
        raise error(
            "dedicate_params: tensor-parallel dedicated matrices "
            + ("with data_parallel='ddp'" if data_parallel != "fsdp" else
               "on the meta device (meta-device init)")
            + " are not supported yet. Use data_parallel='fsdp' with a materialized model "
            f"(TP, then dedicate_params, then fully_shard). {fix}.")
    return with_tp_views(decisions, views, error=error)
