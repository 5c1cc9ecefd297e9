"""DDP mode's gradient-sync decision (pure): how the dedicated matrices follow the wrapping
``DistributedDataParallel``'s ``no_sync`` (:mod:`dmuon.stateful.modes.ddp`)."""
from __future__ import annotations

__all__ = ["follow_ddp_sync"]


def follow_ddp_sync(ddp_syncs: bool, sync: bool, paused_by_ddp: bool) -> tuple[bool, bool]:
    """The new ``(sync, paused_by_ddp)`` at a forward: DDP's ``no_sync`` (``ddp_syncs`` False)
    pauses dmuon's gradient sync (``sync``) if it is on, and DDP syncing again resumes it only if
    DDP paused it (a pause of ``dmuon.no_sync`` stays)."""
    if not ddp_syncs and sync:
        return False, True
    if ddp_syncs and paused_by_ddp:
        return True, False
    return sync, paused_by_ddp
