"""The one callback the runtime offers an optimizer in backward: a hook group's gradient reduce
was issued (:meth:`ReduceListenerMixin.on_reduce_issued`). ``dmuon.Muon`` with
``offload_state=True`` starts that group's momentum copy to the device there
(:func:`dmuon.stateful.optimizer.state_storage.follow_reduces`); the runtime never imports the
optimizer."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

__all__ = ["ReduceListenerMixin"]


class ReduceListenerMixin:
    """Part of :class:`~dmuon.stateful.runtime.state.DedicatedState`: one listener of issued
    reduces."""

    _reduce_listener: Optional[Callable[[Sequence[str]], Any]] = None

    def on_reduce_issued(self, callback: Optional[Callable[[Sequence[str]], Any]]) -> None:
        """Call ``callback(names)`` (the group's matrices) whenever a hook group's gradient reduce
        is issued: in backward, in the fixed reduce order, the rest at the end of the backward;
        never inside ``no_sync``. One listener: a later call replaces it (``None``: none)."""
        self._reduce_listener = callback

    def _reduce_issued(self, names: Sequence[str]) -> None:
        if self._reduce_listener is not None:
            self._reduce_listener(names)
