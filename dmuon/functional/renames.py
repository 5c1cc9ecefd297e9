"""Which dedicated params a model now names otherwise (pure): a model wrapped or renamed after
``dedicate_params`` (PEFT's ``get_peft_model`` is the usual cause) is found by comparing names
beyond the segments wrappers insert (:mod:`dmuon.stateful.runtime.state` explains it)."""
from __future__ import annotations

from typing import Hashable, Mapping, Sequence

__all__ = ["WRAPPER_SEGMENTS", "plain_name", "renamed"]

#: module names wrappers insert that do not change what a param is (torch.compile, activation
#: checkpointing, FSDP1 / DDP wrappers)
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module",
                              "module"})


def plain_name(name: str) -> str:
    """``name`` without :data:`WRAPPER_SEGMENTS`."""
    return ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)


def renamed(dedicated: Mapping[str, Hashable],
            now: Mapping[Hashable, Sequence[str]]) -> list[tuple[str, str]]:
    """``(name at dedicate_params, name now)`` of the dedicated params (``{name: identity}``) that
    the model's names now (``{identity: every name of it}``) give otherwise beyond
    :data:`WRAPPER_SEGMENTS`, or not at all (``"<gone>"``)."""
    out = []
    for n, key in dedicated.items():
        names = now.get(key, ())
        if not any(plain_name(a).endswith(plain_name(n)) for a in names):
            out.append((n, names[0] if names else "<gone>"))
    return out
