"""The collective checks ``dmuon.Muon.step`` runs before anything changes, each raising on every
rank: FSDP2 gradients on some ranks only (or on none), non-finite gradients (the verdicts, and the checks that
need no collective, are :mod:`dmuon.functional.step_checks`')."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from dmuon.functional.step_checks import (check_finite_flags, check_grads_on_all_ranks,
                                          unused_everywhere)
from dmuon.stateful.runtime.agree import host_sum, rank_flags
from dmuon.stateful.runtime.state import DedicatedState, local_tensor

__all__ = ["check_same_fsdp_grads", "drop_unused_fsdp_grads", "check_finite"]


def check_same_fsdp_grads(adamw_named: Sequence[tuple[str, Any]], rt: DedicatedState) -> None:
    """Torch without FSDP2's ``set_reduce_scatter_unused_params``: raise on every rank if an
    FSDP2 param has a gradient on some ranks only (one all-reduce of a has-grad count)."""
    flags = [p.grad is not None for _, p in adamw_named]
    counts = host_sum(flags, what="FSDP2 gradient-usage all-reduce", via=rt.mesh_groups,
                      device=rt.device)
    check_grads_on_all_ranks([n for n, _ in adamw_named], counts, dist.get_world_size())


def drop_unused_fsdp_grads(adamw_named: Sequence[tuple[str, Any]], rt: DedicatedState,
                           usage: Any) -> list[str]:
    """Torch whose FSDP2 sends a zero gradient for a param unused on a rank (dmuon turns on
    ``set_reduce_scatter_unused_params``): put ``None`` back as ``.grad`` of every FSDP2 param no
    rank used since its gradient was last cleared, as a single-device optimizer would see it (so
    AdamW skips it: no moment decay, no weight decay, no step count). ``usage``:
    :class:`dmuon.compat.fsdp_info.FSDPGradUsage`. One all-reduce of two flags per param over
    the mesh when it has several ranks. Returns the names dropped."""
    used, none_before = usage.local_flags([p for _, p in adamw_named])
    world = dist.get_world_size()
    counts = [int(f) for f in used + none_before]
    if world > 1:
        counts = host_sum(counts, what="FSDP2 gradient-usage all-reduce", via=rt.mesh_groups,
                          device=rt.device)
    k = len(adamw_named)
    names = unused_everywhere([n for n, _ in adamw_named], counts[:k], counts[k:], world)
    dropped = set(names)
    for n, p in adamw_named:
        if n in dropped:
            p.grad = None
    return names


def check_finite(adamw_named: Sequence[tuple[str, Any]], rt: DedicatedState,
                 grads: dict[str, Optional[torch.Tensor]]) -> bool:
    """Raise on every rank, before anything changes, if any gradient is non-finite, naming the
    ranks whose own backward produced it (the dedicated matrices' local gradients, checked as
    they were sent) and the ranks holding non-finite reduced values (FSDP2's shards, which
    FSDP2 reduced already, and the owners' averages: a finite input can overflow there)."""
    named = [(n, g) for n, g in grads.items() if g is not None]
    named += [(n, local_tensor(p.grad)) for n, p in adamw_named if p.grad is not None]
    named = [(n, g) for n, g in named if g.numel() > 0]
    mine = torch.zeros(2, dtype=torch.float32, device=rt.device)
    if rt.ledger.nonfinite is not None:
        mine[0] = rt.ledger.nonfinite.float()
    if named:
        norms = torch._foreach_norm([g for _, g in named])
        mine[1] = (~torch.isfinite(torch.stack(norms).float())).any().float()
    flags = rank_flags(mine, what="check_finite all-reduce", via=rt.mesh_groups)
    synced = flags.is_cuda  # the verdict below waits for the device
    check_finite_flags(flags, named)
    return synced
