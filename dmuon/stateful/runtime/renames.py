"""A dedicated model wrapped or renamed after ``dedicate_params`` (PEFT's ``get_peft_model`` is the
usual cause): found by :func:`renamed_params`, explained by :func:`renamed_error`
(``dmuon.Muon(model)`` through :func:`~dmuon.stateful.runtime.state.get_state`, and the first
forward)."""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from dmuon.functional.renames import renamed

__all__ = ["renamed_params", "renamed_error"]


def renamed_params(st: Any, root: nn.Module) -> list[tuple[str, str]]:
    """``(name at dedicate_params, name in root now)`` of the dedicated params that ``root`` now
    names otherwise (beyond compile / checkpoint / DDP wrapper segments), or does not hold."""
    now: dict[int, list[str]] = {}
    for n, p in root.named_parameters(remove_duplicate=False):
        now.setdefault(id(p), []).append(n)
    return renamed({n: id(p) for n, p in st.params.items()}, now)


def renamed_error(st: Any, root: nn.Module, what: str, inner: str = "") -> RuntimeError:
    """The error for a model wrapped or renamed after ``dedicate_params`` (PEFT's
    ``get_peft_model`` is the usual cause)."""
    moved = renamed_params(st, root)
    eg = (f" (e.g. {moved[0][0]!r} is now {moved[0][1]!r}, {len(moved)} dedicated params "
          "renamed)") if moved else ""
    where = f" wraps the model dmuon.dedicate_params prepared (at {inner!r}) and" if inner else ""
    return RuntimeError(
        f"{what}: this model{where} had its modules wrapped or renamed after "
        f"dmuon.dedicate_params{eg}, as PEFT's get_peft_model (LoRA) does: dmuon's hooks, groups "
        "and state-dict names refer to the modules as they were. Apply PEFT (get_peft_model) "
        "before dmuon.dedicate_params: dmuon.dedicate_params(peft_model, mesh, predicate), then "
        "fully_shard "
        "(its frozen base weights are left out; the trainable ones are dedicated).")
