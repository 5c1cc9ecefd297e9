"""The post-step publish of new masters (HSDP replicas; DDP mode's replicas), as the part of
:class:`~dmuon.stateful.runtime.state.DedicatedState` it is: each owner broadcasts its new masters to the
other ranks of its shard column, one launch per hook group in the static group order (the same on
every rank), waited by that group's next gather."""
from __future__ import annotations

from typing import Optional

__all__ = ["PublishMixin"]


class PublishMixin:
    """The publish methods of :class:`~dmuon.stateful.runtime.state.DedicatedState` (it provides ``R``,
    ``groups``, ``hook_groups`` and ``storage``)."""

    @property
    def pending_publish(self) -> list[str]:
        """Hook groups whose post-step publish has not been waited yet."""
        return [k for k, g in self.groups.items() if g.inflight_publish is not None]

    def publish(self, *, replicate_async: bool = True) -> None:
        """HSDP: broadcast each new master from its global owner ``(s, r_o)`` to the other ranks of
        column ``s`` (the forward broadcast sources of the other replicas). No-op when R == 1.

        ``replicate_async=True``: one launch per hook group, in the static group order (the same
        on every rank), left pending; the group's next gather waits it first; publishes of groups
        no forward used are waited at the end of the next backward; :meth:`wait_publish`
        (``dmuon.wait_all_replicate_broadcasts``) waits them all. ``False``: wait here.

        Raises:
          RuntimeError: a publish of an earlier step is still pending (see
            :meth:`check_publish_consumed`).
        """
        if self.R == 1:
            return
        self.check_publish_consumed()
        for key in self.hook_groups.order:
            self.groups[key].launch_publish(self.storage.master_buffers)
        if not replicate_async:
            self.wait_publish()

    def check_publish_consumed(self, what: str = "optimizer.step()") -> None:
        """Raise if a publish is still pending: the owners would overwrite masters that are still
        being broadcast, and the replicas would miss a step. Deterministic (the same decision on
        every rank): "pending" means not yet waited, never "not yet finished"."""
        groups = [k or "<root>" for k in self.pending_publish]
        if not groups:
            return
        raise RuntimeError(
            f"dmuon: {what} would publish new HSDP weights while the previous step's publish is "
            f"still pending for hook groups {groups[:6]}{' ...' if len(groups) > 6 else ''} (no "
            "forward/backward ran since that step). Nothing was updated. Run a forward and "
            "backward before the next step, or call dmuon.wait_all_replicate_broadcasts(model) "
            "first (or build the optimizer with dmuon.Muon(..., replicate_async=False)).")

    def wait_publish(self, key: Optional[str] = None) -> None:
        """Wait for the pending HSDP publish of group ``key`` (``None``: of every group; this is
        ``dmuon.wait_all_replicate_broadcasts``). Idempotent, local (no new collective)."""
        for g in (self.groups.values() if key is None else (self.groups[key],)):
            g.wait_publish()
