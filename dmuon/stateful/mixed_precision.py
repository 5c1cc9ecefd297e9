"""Find the ``MixedPrecisionPolicy`` FSDP2 applies around a module (dmuon casts dedicated params
itself: FSDP2 does not cast ignored params)."""
from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn


def _fsdp_state(module: nn.Module) -> Any:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:  # pragma: no cover
        return None
    return _get_module_fsdp_state(module)


def has_fsdp_state(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that already carry FSDP2 (``fully_shard``) state."""
    return [name or "<root>" for name, m in model.named_modules() if _fsdp_state(m) is not None]


def find_mp_policy(model: Optional[nn.Module], module: nn.Module) -> Any:
    """The ``MixedPrecisionPolicy`` of the nearest ``fully_shard``-ed module among ``module`` and
    its ancestors inside ``model``; ``None`` when no FSDP2 state covers it."""
    if model is None:
        st = _fsdp_state(module)
        return getattr(st, "_mp_policy", None) if st is not None else None
    path = None
    for name, m in model.named_modules():
        if m is module:
            path = name
            break
    chain = [model]
    if path:
        parts = path.split(".")
        for i in range(len(parts)):
            chain.append(model.get_submodule(".".join(parts[: i + 1])))
    for m in reversed(chain):
        st = _fsdp_state(m)
        if st is not None:
            return getattr(st, "_mp_policy", None)
    return None
