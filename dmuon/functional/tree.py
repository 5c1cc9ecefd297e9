"""Small pytree helpers (over ``optree``) shared by the functional optimizers.

Params, grads and optimizer state are arbitrary optree pytrees; flat ``{name: tensor}`` dicts are the
common case. These helpers flatten a tree, flatten a second tree *up to* the first one's structure (so a
grads tree may hold ``None`` where a param got no gradient), name leaves by their path, and expand a
per-leaf option given as a scalar, a matching pytree, or a mapping keyed by leaf path.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, TypeVar

import optree
import torch
from torch import Tensor

PyTree = Any
T = TypeVar("T")

__all__ = [
    "PyTree",
    "flatten",
    "flatten_like",
    "leaf_paths",
    "get_path",
    "replace_path",
    "path_name",
    "per_leaf_option",
    "check_tensor_leaves",
    "zeros_like_tree",
]


def flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into ``(leaves, treedef)`` with optree's default rules.

    ``None`` is an empty node (not a leaf), dict keys are visited in sorted order and
    ``treedef.unflatten`` restores the original container types and key order.
    """
    leaves, treedef = optree.tree_flatten(tree)
    return leaves, treedef


def flatten_like(treedef: optree.PyTreeSpec, tree: PyTree, what: str) -> list[Any]:
    """Leaves of ``tree`` taken at the leaf positions of ``treedef``.

    A leaf position of ``treedef`` may hold any subtree in ``tree`` (notably ``None``), which is
    returned as is. Raises ``ValueError`` naming ``what`` when the structures do not match.
    """
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{what} must have the same pytree structure as params ({treedef}); optree says: {err}"
        ) from err


def path_name(path: tuple[Any, ...]) -> str:
    """A leaf path as a dotted name: ``("layers", 0, "w")`` -> ``"layers.0.w"``."""
    return ".".join(str(k) for k in path)


def leaf_paths(tree: PyTree) -> list[str]:
    """Dotted path names of the leaves of ``tree``, in ``flatten`` order."""
    paths, _, _ = optree.tree_flatten_with_path(tree)
    return [path_name(p) for p in paths]


def per_leaf_option(
    option: Any,
    params: PyTree,
    treedef: optree.PyTreeSpec,
    *,
    default: T,
    what: str,
    is_value: Callable[[Any], bool],
) -> list[T]:
    """Expand a per-leaf option to one value per param leaf (in ``flatten`` order).

    ``option`` may be: ``None`` (``default`` everywhere); a single value (``is_value(option)``) used for
    every leaf; a pytree with the params' structure (``None`` entries mean ``default``); or a mapping from
    dotted leaf path (see :func:`leaf_paths`; for a flat dict the path is the key) to value, where
    missing leaves get ``default``. Unknown mapping keys raise ``ValueError`` listing the valid names.
    """
    n = treedef.num_leaves
    if option is None:
        return [default] * n
    if is_value(option):
        return [option] * n
    try:
        values = treedef.flatten_up_to(option)
    except (ValueError, TypeError):
        values = None
    if values is not None:
        return [default if v is None else v for v in values]
    if isinstance(option, Mapping):
        names = leaf_paths(params)
        index = {name: i for i, name in enumerate(names)}
        unknown = [k for k in option if k not in index]
        if unknown:
            raise ValueError(
                f"{what}: unknown param name(s) {unknown}; valid names are {names}"
            )
        out: list[T] = [default] * n
        for k, v in option.items():
            out[index[k]] = default if v is None else v
        return out
    raise ValueError(
        f"{what} must be None, a single value, a pytree with the params' structure, or a mapping "
        f"from param path name to value; got {type(option).__name__}"
    )


def check_tensor_leaves(leaves: list[Any], names: list[str], what: str) -> None:
    """Raise ``TypeError`` when a leaf is not a ``torch.Tensor``."""
    for leaf, name in zip(leaves, names):
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{what} leaf {name!r} must be a torch.Tensor, got {type(leaf).__name__}")


def zeros_like_tree(leaves: list[Tensor], treedef: optree.PyTreeSpec) -> PyTree:
    """A tree of fresh zero tensors shaped, typed and placed like ``leaves``."""
    return treedef.unflatten(
        [torch.zeros_like(x, memory_format=torch.preserve_format) for x in leaves]
    )


def get_path(state: Any, path: tuple) -> Any:
    """The node of ``state`` at ``path``: a ``str`` step is a (NamedTuple) attribute, an ``int``
    step an index."""
    for p in path:
        state = getattr(state, p) if isinstance(p, str) else state[p]
    return state


def replace_path(state: Any, path: tuple, value: Any) -> Any:
    """``state`` with the node at ``path`` (as :func:`get_path` walks it) replaced by ``value``:
    new NamedTuples / tuples along the path, nothing written."""
    if not path:
        return value
    p, rest = path[0], path[1:]
    if isinstance(p, str):
        return state._replace(**{p: replace_path(getattr(state, p), rest, value)})
    items = list(state)
    items[p] = replace_path(state[p], rest, value)
    return tuple(items)
