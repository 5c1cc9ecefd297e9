"""The module paths above a param name or state-dict key (pure string work): where a key's own
module and its ancestors sit in the module tree, for hooks that must visit them in order.
"""
from __future__ import annotations

from typing import Iterable

__all__ = ["ancestors", "modules_above"]


def ancestors(name: str) -> list[str]:
    """The module paths above ``name`` (a param name, a state-dict key), the nearest first:
    ``"a.b.w"`` -> ``["a.b", "a"]``; the root module (``""``) is not listed."""
    parts = name.split(".")[:-1]
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def modules_above(keys: Iterable[str]) -> list[str]:
    """The module paths above any of ``keys``, each once, parents before children (within one
    depth in the order the keys first reach them)."""
    seen = dict.fromkeys(path for k in keys for path in reversed(ancestors(k)))
    return sorted(seen, key=lambda path: path.count("."))
