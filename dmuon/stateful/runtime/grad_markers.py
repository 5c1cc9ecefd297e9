"""The ``.grad`` markers of dedicated params, as the part of
:class:`~dmuon.stateful.runtime.state.DedicatedState` they are (see :mod:`dmuon.stateful.runtime.guards` for the
marker itself).

After a synced backward, each placeholder whose gradient this rank holds (a local gradient it sent,
or, on the owner, the reduced gradient of a matrix it owns in a launched reduce) shows a zero-size
marker as ``.grad``: torch's tools then raise instead of seeing nothing, zeroing the marker zeroes
dmuon's gradient (the matrix is stepped with zeros unless a later backward adds to it), and dropping
it (``model.zero_grad()``, ``p.grad = None``) drops the gradient, exactly as torch would treat a
local one. Markers are checked and taken off before the param is gathered, its gradient sent, or a
clip or step reads it.
"""
from __future__ import annotations

from dmuon.stateful.runtime.guards import make_marker

__all__ = ["GradMarkersMixin"]


class GradMarkersMixin:
    """The marker methods of :class:`~dmuon.stateful.runtime.state.DedicatedState` (it provides
    ``params``, ``storage``, ``local_grads``, ``consumed`` and the reduce bookkeeping:
    ``_markers``, ``_marked``, ``_sent``, ``_reduced``, ``_present_here``, ``_flags``,
    ``_resolved``, ``_collect``)."""

    def _attach_markers(self, names) -> None:
        """After a backward: every freed param whose gradient dmuon holds shows a marker as
        ``.grad`` (torch's tools then raise instead of seeing nothing; zeroing it zeroes
        dmuon's gradient, dropping it drops it, see :mod:`dmuon.stateful.runtime.guards`)."""
        for n in names:
            p = self.params[n]
            if not self.storage.is_placeholder(n) or n in self._marked:
                continue
            if n not in self.local_grads and n not in self._sent:
                continue
            m = self._markers.get(n)
            if m is None or m.dtype != p.dtype:
                m = make_marker(p, n, lambda n=n: self.zero_held_grad(n))
                self._markers[n] = m
            p.grad = m
            self._marked.add(n)

    def _take_markers(self, names, *, remove: bool = True) -> None:
        """Before a param is gathered (or its gradient sent or used): a marker the user dropped
        (``model.zero_grad()``, ``p.grad = None``) drops dmuon's gradient; ``remove``: take the
        others off too (a gathered param must not carry a zero-size ``.grad``). The consumed
        markers of the last step come off as well (:mod:`dmuon.stateful.runtime.consumed_grads`)."""
        self.consumed.take(self.params, names)
        for n in [n for n in names if n in self._marked]:
            p = self.params[n]
            if p.grad is not self._markers[n]:
                self._marked.discard(n)
                self.drop_grad(n)
            elif remove:
                self._marked.discard(n)
                p.grad = None

    def zero_held_grad(self, name: str) -> None:
        """Zero every gradient dmuon holds for ``name`` on this rank, keeping it present (torch's
        ``zero_grad(set_to_none=False)``: the param is stepped with a zero gradient unless a later
        backward adds to it)."""
        self._collect()  # a reduce still in flight counts as held
        for held in (self.local_grads.get(name), self._reduced.get(name)):
            if held is not None:
                held.zero_()

    def drop_grad(self, name: str) -> None:
        """Forget every gradient dmuon holds for ``name`` on this rank (as torch's zero_grad)."""
        self.local_grads.pop(name, None)
        self._collect()  # a reduce still in flight counts as held
        self._reduced.pop(name, None)
        self._present_here.discard(name)
        self._flags.pop(name, None)
        self._resolved = None
