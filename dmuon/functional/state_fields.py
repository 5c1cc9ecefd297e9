"""The per-param fields of a chain state, by name (pure): what a distributed optimizer saves,
restores and shows for each matrix.

A stage state (a NamedTuple) names its per-param pytrees in ``per_param`` (and their layouts in
``layouts``). :func:`state_fields` walks a chain state and names each such field: a
:class:`~dmuon.functional.transforms.MomentumState`'s buffers are ``"momentum_buffer"`` (torch's
name, the same for Muon and every variant), any other field its own name; a name met twice gets
``".1"``, ``".2"``... :func:`scalar_leaves` lists what is not per param (step counts).

Layouts: ``"param"`` (the param's shape), ``"rows"`` / ``"matrices"`` (1-D, one value per row /
per matrix of the param's view, no larger than the param). :func:`tp_concat_dim`: how the fields
of a tensor-parallel slice make the full param's.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

__all__ = ["Field", "LAYOUTS", "state_fields", "scalar_leaves", "number_leaves", "check_counts",
           "tp_concat_dim"]

#: per-param state layouts: the param's shape; one value per row / per matrix of its view (1-D)
LAYOUTS = ("param", "rows", "matrices")


class Field(NamedTuple):
    """One per-param field of a chain state: its state-dict ``key``, its ``path`` in the state
    (tuple indices and field names), its ``layout`` (:data:`LAYOUTS`)."""

    key: str
    path: tuple
    layout: str


def state_fields(state: Any) -> list[Field]:
    """The per-param fields of ``state``, in walk order (see the module docstring)."""
    from dmuon.functional.stages.momentum import MomentumState

    found: list[tuple[str, tuple, str]] = []

    def walk(s: Any, path: tuple) -> None:
        if isinstance(s, tuple) and hasattr(s, "_fields"):
            per = getattr(type(s), "per_param", ())
            lay = getattr(type(s), "layouts", {})
            for name in s._fields:
                if name in per:
                    key = "momentum_buffer" if isinstance(s, MomentumState) else name
                    found.append((key, path + (name,), lay.get(name, "param")))
                else:
                    walk(getattr(s, name), path + (name,))
        elif type(s) is tuple:
            for j, x in enumerate(s):
                walk(x, path + (j,))
        elif isinstance(s, dict) and not any(isinstance(v, torch.Tensor) for v in s.values()):
            for k in sorted(s):
                walk(s[k], path + (k,))

    walk(state, ())
    seen: dict[str, int] = {}
    out = []
    for key, path, lay in found:
        j = seen.get(key, 0)
        seen[key] = j + 1
        out.append(Field(key if j == 0 else f"{key}.{j}", path, lay))
    return out


def _state_leaves(state: Any, skip: frozenset = frozenset()) -> list[tuple[tuple, Any]]:
    """``(path, leaf)`` of every leaf of ``state`` (named tuples by field name, tuples and lists by
    index, dicts by sorted key), in walk order, not entering the paths in ``skip``."""
    out: list[tuple[tuple, Any]] = []

    def walk(s: Any, path: tuple) -> None:
        if path in skip:
            return
        if isinstance(s, tuple) and hasattr(s, "_fields"):
            for name in s._fields:
                walk(getattr(s, name), path + (name,))
        elif isinstance(s, (tuple, list)):
            for j, x in enumerate(s):
                walk(x, path + (j,))
        elif isinstance(s, dict):
            for k in sorted(s, key=str):
                walk(s[k], path + (k,))
        else:
            out.append((path, s))

    walk(state, ())
    return out


def scalar_leaves(state: Any, fields: list[Field]) -> list[torch.Tensor]:
    """The tensors of ``state`` outside its per-param ``fields`` (step counts), in walk order."""
    return [x for _, x in _state_leaves(state, frozenset(f.path for f in fields))
            if isinstance(x, torch.Tensor)]


def number_leaves(state: Any) -> list[str]:
    """The paths (``".count"``, ``".1"``) of the Python numbers in ``state``: counts a stage keeps as
    ``int`` / ``float`` rather than as 0-d tensors."""
    return ["".join(f".{k}" for k in path) or "(the state itself)"
            for path, x in _state_leaves(state)
            if isinstance(x, (int, float)) and not isinstance(x, bool)]


def check_counts(state: Any, what: str) -> None:
    """Raise ``TypeError`` when the chain state ``state`` holds Python numbers: an optimizer's
    checkpoint saves and restores a chain's counts as its 0-d tensors (:func:`scalar_leaves`), so
    a count kept as an ``int`` would restart from its initial value after every resume."""
    found = number_leaves(state)
    if found:
        raise TypeError(
            f"{what}: the chain's state holds Python numbers at {found[:4]}: dmuon checkpoints a "
            "chain's counts as 0-d tensors, so these would be lost on every resume. Keep them as "
            "tensors in the stage's init and update, e.g. count = torch.zeros((), "
            "dtype=torch.int64) and count + 1")


def tp_concat_dim(layout: str, sliced_dim: Optional[int]) -> Optional[int]:
    """The dim along which the TP slices' values of a field of ``layout`` concatenate into the
    full param's field (the param sliced along ``sliced_dim``; ``None``: not sliced), or ``None``
    where every TP rank holds the full field (a per-matrix value, or the rows of a column
    slice)."""
    if sliced_dim is None or layout == "matrices" or (layout == "rows" and sliced_dim == 1):
        return None
    return sliced_dim if layout == "param" else 0
