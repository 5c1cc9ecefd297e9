"""The checks of a meta-built dedicated model's init window (pure; the window itself:
:mod:`dmuon.stateful.modes.meta_init`)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["same_device", "init_window_problems"]


def same_device(want: Any, have: torch.device) -> bool:
    """Whether a ``to_empty(device=want)`` keeps a master on ``have`` (``None``: it does; an index
    left out on either side matches any)."""
    if want is None:
        return True
    want = torch.device(want)
    return want.type == have.type and (want.index is None or have.index is None
                                       or want.index == have.index)


def init_window_problems(unreached: Sequence[str], on_meta: Sequence[str]) -> list[str]:
    """A rank's reasons the init window cannot close: the dedicated params ``to_empty`` never
    reached (``unreached``), the params and buffers still on the meta device (``on_meta``)."""
    out = []
    if unreached:
        out.append(f"dedicated params never reached by model.to_empty(device=...): "
                   f"{list(unreached[:4])}{' ...' if len(unreached) > 4 else ''}")
    if on_meta:
        out.append(f"params / buffers still on the meta device: {list(on_meta[:4])}"
                   f"{' ...' if len(on_meta) > 4 else ''}")
    return out
