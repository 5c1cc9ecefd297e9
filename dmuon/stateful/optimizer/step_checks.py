"""The collective checks ``dmuon.Muon.step`` runs before anything changes, each raising on every
rank: hook groups that launched different collectives on different ranks since the last step, a
gradient of the last step never cleared, FSDP2 gradients on some ranks only (or on
none), non-finite gradients (the verdicts, and the checks that
need no collective, are :mod:`dmuon.functional.step_checks`')."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from dmuon.functional import step_checks as SC
from dmuon.functional.copy_log import unloaded_copies
from dmuon.functional.muon_options import unread_group_keys
from dmuon.functional.state_views import written_copies
from dmuon.stateful.runtime.agree import host_sum, rank_flags
from dmuon.stateful.runtime.state import DedicatedState, local_tensor

__all__ = ["agree_before_step", "check_finite"]


def agree_before_step(rt: DedicatedState, adamw_named: Sequence[tuple[str, Any]], groups: Any,
                      drop_batch: Callable[[], None], fixed: Any = (), views: Any = None) -> None:
    """One all-reduce of host values (none at world 1) for the verdicts every rank must reach
    before a step changes anything (:mod:`dmuon.functional.step_checks`): the hook groups launched
    the same collectives on every rank since the last step (``rt.launches``), and the param
    ``groups`` hold the same hyper-parameters (else ``drop_batch()``, the optimizer's
    ``zero_grad``, and every rank raises), and no state dict's copies were written but not
    loaded (:mod:`dmuon.functional.copy_log`); then (``pre_step_verdict``) a gradient of the last
    step never cleared (``GradLedger.uncleared``), and FSDP2's gradients (``rt.fsdp_usage``;
    ``None`` without FSDP2 params): those no rank used get ``None`` back. Also refused: the
    copies in ``views`` (``optimizer.state``) written in place, and a group key nothing reads
    (``fixed``: :func:`~dmuon.functional.muon_options.unread_group_keys`)."""
    uncleared, usage, h = rt.ledger.uncleared(), rt.fsdp_usage, rt.launches.take()
    used, none_before = usage.local_flags([p for _, p in adamw_named]) if usage else ([], [])
    world = dist.get_world_size()  # (at world 1 nothing to agree: no fingerprint)
    written, in_views = rt.state_dict_copies.written(settle=True), views.written() if views else []
    counts = [int(bool(uncleared))] + [int(f) for f in used + none_before] + [
        k := SC.hparams_fingerprint(groups) if world > 1 else 0, k * k, h, h * h, len(written),
        len(in_views)]
    if world > 1:
        counts = host_sum(counts, what="pre-step all-reduce", via=rt.mesh_groups, device=rt.device)
    views_written, unloaded = counts.pop(), counts.pop()
    if (differ := (unloaded and unloaded_copies(written, "dmuon.Muon.step")) or
            (views_written and written_copies(in_views, "dmuon.Muon.step")) or
            SC.launches_differ(counts[-2], counts[-1], world) or
            SC.hparams_differ(counts[-4], counts[-3], world, groups) or
            unread_group_keys(groups, fixed)) is not None:  # (the groups agree: on every rank)
        drop_batch()
        rt.reshard_all()
        raise RuntimeError(differ)
    gone = set(SC.pre_step_verdict(uncleared, [n for n, _ in adamw_named][:len(used)], counts[:-4],
                                world, zeros_sent=bool(usage and usage.zeros_sent)))
    for n, p in adamw_named:
        if n in gone:
            p.grad = None


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
    SC.check_finite_flags(flags, named)
    return synced
