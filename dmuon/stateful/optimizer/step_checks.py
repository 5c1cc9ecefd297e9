"""The collective checks ``dmuon.Muon.step`` runs before anything changes, each raising on every
rank: a gradient of the last step never cleared, FSDP2 gradients on some ranks only (or on
none), non-finite gradients (the verdicts, and the checks that
need no collective, are :mod:`dmuon.functional.step_checks`')."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from dmuon.functional.step_checks import (check_cleared, check_finite_flags,
                                          check_grads_on_all_ranks, unused_everywhere)
from dmuon.stateful.runtime.agree import host_sum, rank_flags
from dmuon.stateful.runtime.state import DedicatedState, local_tensor

__all__ = ["agree_before_step", "check_finite"]


def agree_before_step(rt: DedicatedState, adamw_named: Sequence[tuple[str, Any]], usage: Any,
                      check_usage: bool) -> list[str]:
    """What every rank must know before a step changes anything, in one all-reduce of host flags
    (none at world 1): whether a rank's matrices hold a gradient of the last step that was never
    cleared (``GradLedger.uncleared``: raise on every rank), and the FSDP2 params' gradients.
    ``usage`` (:class:`dmuon.compat.fsdp_info.FSDPGradUsage`, torch whose FSDP2 sends a zero for a
    param unused on a rank): put ``None`` back as ``.grad`` of every FSDP2 param of
    ``adamw_named`` no rank used since its gradient was last cleared, as a single-device optimizer
    sees it (AdamW skips it: no moment decay, no weight decay); returns their names.
    ``check_usage`` (torch without that switch): raise on every rank if an FSDP2 param has a
    gradient on some ranks only."""
    uncleared = rt.ledger.uncleared()
    params = [p for _, p in adamw_named] if usage is not None or check_usage else []
    used, none_before = usage.local_flags(params) if usage is not None else \
        ([p.grad is not None for p in params], [])
    world = dist.get_world_size()
    counts = [int(bool(uncleared))] + [int(f) for f in used + none_before]
    if world > 1:
        counts = host_sum(counts, what="pre-step all-reduce", via=rt.mesh_groups,
                          device=rt.device)
    check_cleared(uncleared, counts[0])
    names, k = [n for n, _ in adamw_named][:len(params)], len(params)
    if usage is None:
        if check_usage:
            check_grads_on_all_ranks(names, counts[1:1 + k], world)
        return []
    dropped = unused_everywhere(names, counts[1:1 + k], counts[1 + k:], world)
    gone = set(dropped)
    for n, p in adamw_named:
        if n in gone:
            p.grad = None
    return dropped


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
