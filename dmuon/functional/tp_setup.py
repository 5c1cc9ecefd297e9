"""Tensor parallelism's decisions at ``dedicate_params`` (pure): the layouts of the TP-sliced
dedicated matrices, the modes they combine with, and their decided matrix views
(:mod:`dmuon.stateful.setup.dedicate`; the TP part of the plan: :mod:`dmuon.functional.tp_plan`)."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from dmuon.functional.matrix_view import Sliced
from dmuon.functional.policy import Decision
from dmuon.functional.tp_plan import TPLayout, tp_slicing_problem, with_tp_views

__all__ = ["tp_layouts_of", "tp_mesh_ranks", "tp_decisions"]


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
        return tuple(int(x) for x in lay.mesh.mesh.flatten().tolist())
    return None


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
