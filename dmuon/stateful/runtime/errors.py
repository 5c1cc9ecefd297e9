"""Exceptions the stateful layer raises where torch code meets a dedicated param."""
from __future__ import annotations

__all__ = ["DedicatedParamError"]


class DedicatedParamError(RuntimeError):
    """A torch operation touched the values of a dedicated param (or of its gradient) where they
    are not: they live whole on the owner rank, in dmuon's storage."""
