"""The module a user's wrapper holds: ``DistributedDataParallel`` wraps the module
``dedicate_params`` prepared, and dmuon's public functions take either."""
from __future__ import annotations

from typing import Any

__all__ = ["unwrap_model", "unwrapping_model"]


def unwrap_model(model: Any) -> Any:
    """The module ``dedicate_params`` prepared, inside a ``DistributedDataParallel`` wrapper
    (``model`` itself when it is not such a wrapper)."""
    from torch.nn.parallel import DistributedDataParallel
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def unwrapping_model(fn: Any) -> Any:
    """Decorator of a public dmuon function taking ``model``: a ``DistributedDataParallel``
    wrapper is replaced by the module it wraps (single-device names)."""
    import functools
    import inspect

    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind_partial(*args, **kwargs)
        if "model" in bound.arguments:
            bound.arguments["model"] = unwrap_model(bound.arguments["model"])
        return fn(*bound.args, **bound.kwargs)

    return wrapper
