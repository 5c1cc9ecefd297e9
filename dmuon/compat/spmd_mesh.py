"""torch's side of a full SPMD mesh (``fully_shard(..., dp_mesh_dims=...)``): the shard and
replicate sub-meshes that ``dp_mesh_dims`` names, and the ``spmd_types`` annotations that
torchtitan 0.3's default backend puts on plain params. The decisions are
:mod:`dmuon.functional.spmd_mesh`'s (its ``spmd_meshes`` slices with :func:`axes_mesh`)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["axes_mesh", "spmd_annotated"]


def axes_mesh(mesh: Any, names: Sequence[str]) -> Any:
    """The 1-D mesh over the axes ``names`` of ``mesh`` (several: flattened, as FSDP2 does)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[tuple(names)]._flatten("_".join(names))


def spmd_annotated(p: torch.Tensor) -> bool:
    """Whether ``p`` carries ``spmd_types`` annotations (False where spmd_types is absent)."""
    try:
        from spmd_types.runtime import has_local_type
    except ImportError:
        return False
    try:
        return bool(has_local_type(p))
    except Exception:  # noqa: BLE001 - an older spmd_types: no annotation dmuon can read
        return False
