"""Which dedicated params a model now names otherwise (pure): a model wrapped or renamed after
``dedicate_params`` (PEFT's ``get_peft_model`` is the usual cause) is found by comparing names
beyond the segments wrappers insert (:mod:`dmuon.stateful.runtime.state` explains it)."""
from __future__ import annotations

from typing import Hashable, Mapping, Sequence

__all__ = ["WRAPPER_SEGMENTS", "plain_name", "renamed", "renamed_message"]

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


def renamed_message(moved: Sequence[tuple[str, str]], what: str, inner: str = "") -> str:
    """The error of a model wrapped or renamed after ``dedicate_params`` (``moved``: from
    :func:`renamed`; ``inner``: where a wrapper holds the prepared model)."""
    eg = (f" (e.g. {moved[0][0]!r} is now {moved[0][1]!r}, {len(moved)} dedicated params "
          "renamed)") if moved else ""
    where = f" wraps the model dmuon.dedicate_params prepared (at {inner!r}) and" if inner else ""
    return (f"{what}: this model{where} had its modules wrapped or renamed after "
            f"dmuon.dedicate_params{eg}, as PEFT's get_peft_model (LoRA) does: dmuon's hooks, "
            "groups and state-dict names refer to the modules as they were. Apply PEFT "
            "(get_peft_model) before dmuon.dedicate_params: dmuon.dedicate_params(peft_model, "
            "mesh, predicate), then fully_shard (its frozen base weights are left out; the "
            "trainable ones are dedicated).")
