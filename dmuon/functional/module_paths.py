"""The module paths above a param name or state-dict key (pure string work): where a key's own
module and its ancestors sit in the module tree, for hooks that must visit them in order.
"""
from __future__ import annotations

__all__ = ["ancestors"]


def ancestors(name: str) -> list[str]:
    """The module paths above ``name`` (a param name, a state-dict key), the nearest first:
    ``"a.b.w"`` -> ``["a.b", "a"]``; the root module (``""``) is not listed."""
    parts = name.split(".")[:-1]
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]

