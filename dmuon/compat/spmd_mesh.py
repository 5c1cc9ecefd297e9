"""torch's side of a full SPMD mesh (``fully_shard(..., dp_mesh_dims=...)``): the shard and
replicate sub-meshes that ``dp_mesh_dims`` names, and the ``spmd_types`` annotations that
torchtitan 0.3's default backend puts on plain params. The decisions are
:mod:`dmuon.functional.spmd_mesh`'s (its ``spmd_meshes`` slices with :func:`axes_mesh`)."""
from __future__ import annotations

import functools

from typing import Any, Mapping, Optional, Sequence

import torch

#: ``(axes, spec, shape)``: the fields of :class:`dmuon.functional.spmd_mesh.SpmdTypes`
SpmdFields = tuple

__all__ = ["axes_mesh", "spmd_annotated", "spmd_types_of", "keep_spmd_types", "kept_spmd_types",
           "spmd_typed"]

#: a module's ``{param leaf: (local type, PartitionSpec)}``, kept by :func:`keep_spmd_types`
KEPT_ATTR = "_dmuon_spmd_types"


def axes_mesh(mesh: Any, names: Sequence[str]) -> Any:
    """The 1-D mesh over the axes ``names`` of ``mesh`` (several: flattened, as FSDP2 does)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[tuple(names)]._flatten("_".join(names))


@functools.lru_cache(maxsize=None)
def _has_local_type() -> Optional[Any]:
    """spmd_types' ``has_local_type`` (``None`` where spmd_types is absent; looked up once)."""
    try:
        from spmd_types.runtime import has_local_type
    except ImportError:
        return None
    return has_local_type


def spmd_annotated(p: torch.Tensor) -> bool:
    """Whether ``p`` carries ``spmd_types`` annotations (False where spmd_types is absent)."""
    has_local_type = _has_local_type()
    if has_local_type is None:
        return False
    try:
        return bool(has_local_type(p))
    except Exception:  # noqa: BLE001 - an older spmd_types: no annotation dmuon can read
        return False


def keep_spmd_types(module: Any, leaf: str, p: Any) -> None:
    """Keep the ``spmd_types`` annotations of ``module``'s param ``leaf`` (``p``) on the module.
    ``fully_shard`` (dmuon's patch: :mod:`dmuon.compat.fsdp_patch`) calls it for a deferred
    dedication's params: torchtitan's ``parallelize`` annotated them just before, and a later
    ``model.to_empty`` makes new param objects without them."""
    if not spmd_annotated(p):
        return
    from spmd_types.runtime import get_local_type, get_partition_spec
    module.__dict__.setdefault(KEPT_ATTR, {})[leaf] = (dict(get_local_type(p) or {}),
                                                       get_partition_spec(p))


def kept_spmd_types(model: Any, name: str) -> Optional[tuple]:
    """The annotations :func:`keep_spmd_types` kept for param ``name`` of ``model`` (or ``None``)."""
    mod_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(mod_name) if mod_name else model
    return module.__dict__.get(KEPT_ATTR, {}).get(leaf)


def spmd_types_of(p: torch.Tensor, mesh: Any, kept: Optional[tuple] = None
                  ) -> Optional[SpmdFields]:
    """``p``'s ``spmd_types`` annotations (else ``kept``: :func:`kept_spmd_types`) as plain
    descriptions (the fields of :class:`dmuon.functional.spmd_mesh.SpmdTypes`, which this file
    does not import; ``None`` without any): each
    annotated axis with its local type's letter, the dim of ``mesh`` (a full SPMD ``DeviceMesh``
    with named dims) that is the same axis (the same ranks with the same strides), and its size;
    the ``PartitionSpec`` as axis labels."""
    if spmd_annotated(p):
        from spmd_types.runtime import get_local_type, get_partition_spec
        kept = (dict(get_local_type(p) or {}), get_partition_spec(p))
    if kept is None:
        return None
    from spmd_types.types import normalize_axis

    local_type, spec = kept
    by_axis = {}
    for name in mesh.mesh_dim_names or ():
        by_axis.setdefault(normalize_axis(mesh.get_group(name)), str(name))
    axes = tuple((repr(a), str(getattr(t, "name", t)), by_axis.get(normalize_axis(a)),
                  int(normalize_axis(a).size()))
                 for a, t in local_type.items())
    entries = None if spec is None else tuple(
        () if e is None else tuple(repr(x) for x in (e if isinstance(e, tuple) else (e,)))
        for e in spec)
    return axes, entries, tuple(p.shape)


def spmd_typed(model: Any, plain: Mapping[str, torch.Tensor], mesh: Any, *, read: bool
               ) -> tuple[list[str], dict[str, tuple[torch.Tensor, SpmdFields]]]:
    """``(annotated, typed)`` of the selected plain params ``plain`` of ``model``: the names with
    ``spmd_types`` annotations (on the param, or kept by :func:`keep_spmd_types`), and with
    ``read`` ``{name: (param, spmd_types_of's fields)}`` of them on the full SPMD ``mesh``
    (:func:`spmd_types_of`), else ``{}``."""
    kept = {n: kept_spmd_types(model, n) for n in plain}
    annotated = [n for n, p in plain.items() if kept[n] is not None or spmd_annotated(p)]
    return annotated, ({n: (plain[n], spmd_types_of(plain[n], mesh, kept[n])) for n in annotated}
                       if read else {})
