"""``dmuon.release(model)``: free dmuon's part of a model the caller keeps (hooks, state, storage,
groups); a discarded model needs no call. Design notes: docs/design/setup.md, "`dmuon.release`"."""
from __future__ import annotations

import logging
from typing import Any

import torch.nn as nn

from dmuon.stateful.modes.deferred import clear_pending, find_pending
from dmuon.stateful.runtime.guards import DedicatedGradMarker
from dmuon.stateful.runtime.state import STATE_ATTR, find_state
from dmuon.compat.wrappers import unwrap_model

logger = logging.getLogger(__name__)

__all__ = ["release", "ReleasedState", "RELEASED"]

RELEASED = ("dmuon: this model was released by dmuon.release(model): dmuon's state for it (its "
            "dedicated matrices' values and gradients, its hooks) is gone, so it can no longer run "
            "forward, save, load or step. Build a new model (dedicate_params, fully_shard, "
            "dmuon.Muon) to train; to keep its values, save them before releasing it.")


class ReleasedState:
    """What a released model's (and its optimizer's) dmuon state becomes: any use raises."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy / pickle protocols ask for optional dunders
            raise AttributeError(name)
        raise RuntimeError(RELEASED)

    def __repr__(self) -> str:
        return "<dmuon state released by dmuon.release(model)>"


def _refuse(*_args: Any, **_kwargs: Any) -> None:
    raise RuntimeError(RELEASED)


def release(model: nn.Module) -> None:
    """Free what dmuon holds for ``model`` now (see the module docstring); local, idempotent.

    Args:
      model: a model prepared by ``dedicate_params`` (or its ``DistributedDataParallel``
        wrapper), or one whose dedication is deferred to ``dmuon.Muon(model)``.

    Raises:
      RuntimeError: ``model`` was never prepared by ``dedicate_params``.
    """
    model = unwrap_model(model)
    st = find_state(model)
    if isinstance(st, ReleasedState):
        return
    if st is None:
        if find_pending(model) is not None:  # a deferred dedication: nothing allocated yet
            clear_pending(model)
            return
        raise RuntimeError("dmuon.release(model): this model was not prepared by "
                           "dmuon.dedicate_params; there is nothing of dmuon's to release.")
    try:  # collectives in flight finish first (they were issued on every rank)
        st.drain()
        st.reshard_all()
    except Exception as e:  # noqa: BLE001 - a dead peer: release anyway, the buffers go with it
        logger.warning("dmuon.release: waiting for dmuon's collectives in flight failed (%s); "
                       "releasing anyway", e)
    for h in st.hook_handles:  # the group, DDP-mode, TP-forward and state-dict hooks
        h.remove()
    for p in st.params.values():
        if isinstance(p.grad, DedicatedGradMarker):
            p.grad = None
    model.__dict__.pop("_apply", None)  # guard_module_apply's guard
    # what is left raises, naming the release (not the placeholders' torch-op errors)
    model.register_forward_pre_hook(_refuse)
    model.register_state_dict_pre_hook(_refuse)
    model.register_load_state_dict_pre_hook(_refuse)
    st.__dict__.clear()
    st.__class__ = ReleasedState  # the optimizer holds the same object: its calls raise too
    setattr(model, STATE_ATTR, st)
