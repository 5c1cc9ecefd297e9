"""The owners' stepped gradients after ``step()``: what torch's ``.grad`` would still say.

torch's ``optimizer.step()`` leaves every ``.grad`` in place until the user zeroes it. Then
``model.zero_grad(set_to_none=False)`` (or the optimizer's) turns it into zeros, so a param that gets
no gradient in the next step is still stepped, with a zero gradient (momentum and weight decay still
act), while ``model.zero_grad()`` (``set_to_none=True``) drops it and the param is skipped.

dmuon's ``step()`` consumes the owners' gradients (they are donated to the update), so nothing of
them is left to zero. Instead, after each step, every matrix this rank owns and stepped carries a
zero-size *consumed* marker (:func:`dmuon.stateful.runtime.guards.make_marker`) as ``.grad`` on its
placeholder:

* zeroing it (``model.zero_grad(set_to_none=False)``, ``Muon.zero_grad(set_to_none=False)``) records
  "zero gradient" for the matrix;
* replacing it (``model.zero_grad()``, ``p.grad = None``) leaves no record.

The marker comes off when the matrix is next gathered (:meth:`ConsumedGrads.take`, before the
forward that uses it) or at the next ``step()`` (:meth:`ConsumedGrads.resolve`), whichever is first,
and what it says then is kept for that step: a matrix that gets no gradient in the step is stepped
with zeros exactly when its marker was zeroed and still in place. Only the owner decides, and the
owner is the rank that holds the marker.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch.nn as nn

from dmuon.stateful.runtime.guards import DedicatedGradMarker, make_marker

__all__ = ["ConsumedGrads"]


class ConsumedGrads:
    """Consumed markers of one rank's stepped matrices, and the records they left (module doc)."""

    def __init__(self) -> None:
        self._cache: dict[str, DedicatedGradMarker] = {}    # one marker object per matrix, reused
        self._markers: dict[str, DedicatedGradMarker] = {}  # attached now
        self._zeroed: set[str] = set()   # markers zeroed while attached
        self._zero: set[str] = set()     # taken off zeroed: the next step sees a zero gradient

    def attach(self, params: Mapping[str, nn.Parameter], names: Iterable[str]) -> None:
        """After a step: a consumed marker as ``.grad`` of each of ``names`` (placeholders)."""
        for n in names:
            p = params[n]
            m = self._cache.get(n)
            if m is None or m.dtype != p.dtype or m.device != p.device:
                m = self._cache[n] = make_marker(p, n, lambda n=n: self._zeroed.add(n))
            p.grad = m
            self._markers[n] = m

    def take(self, params: Mapping[str, nn.Parameter], names: Iterable[str]) -> None:
        """Take the markers of ``names`` off (a gather is about to fill the params), keeping what
        each says for the next step."""
        for n in names:
            m = self._markers.pop(n, None)
            if m is None:
                continue
            p = params[n]
            if p.grad is m:
                p.grad = None
                if n in self._zeroed:
                    self._zero.add(n)
            self._zeroed.discard(n)

    def resolve(self, params: Mapping[str, nn.Parameter]) -> set[str]:
        """At a step: take every remaining marker off; return the matrices whose gradient is a
        zero tensor in torch's terms (their marker was zeroed and not replaced), and forget."""
        self.take(params, list(self._markers))
        zero, self._zero = self._zero, set()
        return zero
