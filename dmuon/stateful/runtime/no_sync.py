"""Gradient accumulation without communication, and draining async HSDP publishes.

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.no_sync".
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from dmuon.stateful.runtime.state import get_state
from dmuon.compat.wrappers import unwrapping_model


@contextlib.contextmanager
@unwrapping_model
def no_sync(model: nn.Module) -> Iterator[None]:
    """Context manager: backward passes inside issue no collectives.

    Dedicated matrices accumulate their local gradients on every rank; FSDP2 modules get
    ``set_requires_gradient_sync(False)``. The next backward outside the context reduces the
    accumulated sum (dedicated: averaged over ranks to the owner; FSDP2: its own reduce-scatter).

    Example::

        for i, batch in enumerate(loader):
            ctx = dmuon.no_sync(model) if (i + 1) % accum != 0 else contextlib.nullcontext()
            with ctx:
                (model(batch).loss / accum).backward()
            if (i + 1) % accum == 0:
                optimizer.step(); optimizer.zero_grad()
    """
    from torch.distributed.fsdp import FSDPModule  # torch >= 2.11 (pyproject) has FSDP2
    rt = get_state(model, "dmuon.no_sync(model)")
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    prev = rt.require_grad_sync
    rt.require_grad_sync = False
    for m in fsdp:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        rt.require_grad_sync = prev
        for m in fsdp:
            m.set_requires_gradient_sync(prev, recurse=False)


def wait_all_replicate_broadcasts(model: nn.Module) -> None:
    """Wait for every pending asynchronous post-step HSDP publish of ``model`` (no-op without HSDP;
    ``step()`` leaves one per hook group with ``replicate_async=True``, the default). Afterwards
    every rank of a shard column holds bit-identical masters.

    Call it before reading weights outside dmuon (e.g. torchtitan's DCP save), or before a second
    ``step()`` with no forward/backward in between (which otherwise raises); dmuon's state-dict
    functions call it themselves. Local (ranks may call it at different times); idempotent.

    Args:
      model: a model prepared by ``dmuon.dedicate_params``.

    Raises:
      RuntimeError: ``model`` has no dedicated params.
    """
    get_state(model, "dmuon.wait_all_replicate_broadcasts(model)").wait_publish()
