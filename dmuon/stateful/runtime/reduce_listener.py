"""The callbacks the runtime offers an optimizer (:class:`ReduceListenerMixin`): a hook group's
gradient reduce was issued in backward (:meth:`~ReduceListenerMixin.on_reduce_issued`), and a
forward reached its first hook group (:meth:`~ReduceListenerMixin.on_group_forward`).
``dmuon.Muon`` with ``offload_state=True`` starts that group's momentum copy to the device at the
first, and the copies back to the host that its last step deferred at the second
(:func:`dmuon.stateful.optimizer.state_storage.follow_reduces`); the runtime never imports the
optimizer."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

__all__ = ["ReduceListenerMixin"]


class ReduceListenerMixin:
    """Part of :class:`~dmuon.stateful.runtime.state.DedicatedState`: one listener of issued
    reduces, one of the first hook group's forward."""

    _reduce_listener: Optional[Callable[[Sequence[str]], Any]] = None
    _forward_listener: Optional[Callable[[], Any]] = None
    _group_forward_seen = False  # a hook group's forward ran since the model's forward began

    def on_reduce_issued(self, callback: Optional[Callable[[Sequence[str]], Any]]) -> None:
        """Call ``callback(names)`` (the group's matrices) whenever a hook group's gradient reduce
        is issued: in backward, in the fixed reduce order, the rest at the end of the backward;
        never inside ``no_sync``. One listener: a later call replaces it (``None``: none)."""
        self._reduce_listener = callback

    def on_group_forward(self, callback: Optional[Callable[[], Any]]) -> None:
        """Call ``callback()`` when a forward of the model reaches its first hook group (after the
        model's own code before its first block, e.g. an HF model's mask), once per forward, not
        in an activation-checkpoint recomputation. One listener: a later call replaces it, and
        calls the replaced one once first (a superseded optimizer starts what it deferred)."""
        old, self._forward_listener = self._forward_listener, callback
        if old is not None:
            old()

    def _reduce_issued(self, names: Sequence[str]) -> None:
        if self._reduce_listener is not None:
            self._reduce_listener(names)

    def notify_group_forward(self) -> None:
        """A hook group's forward starts (the hooks call it): the first of a forward calls the
        listener."""
        if not self._group_forward_seen:
            self._group_forward_seen = True
            if self._forward_listener is not None:
                self._forward_listener()
