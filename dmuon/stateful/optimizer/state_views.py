"""torch-style ``optimizer.state`` of :class:`dmuon.Muon`: ``{param: {"momentum_buffer" (or a
variant's fields), "step"} | {"step", "exp_avg", "exp_avg_sq"}}`` views of the functional states
(read by ``state_dict()`` and torch's tools), rebuilt lazily after a step."""
from __future__ import annotations

from typing import Any

import torch

from dmuon.functional import state_dtype as sd
from dmuon.stateful.runtime.guards import make_marker

__all__ = ["StateViewsMixin"]


class StateViewsMixin:
    """``optimizer.state`` of :class:`dmuon.Muon`: views built by :meth:`refresh_state_views` when
    read after a change (the hot path only marks them stale)."""

    #: ``step()`` changed the functional states since ``self.state`` was last built.
    _state_views_stale = False

    @property
    def state(self) -> Any:
        """torch-style ``{param: {"momentum_buffer", "step"} | {"step", "exp_avg", "exp_avg_sq"}}``
        views of the functional states (read by ``state_dict()``), rebuilt lazily: ``step()`` only
        marks them stale, so the hot path never rebuilds them."""
        if self._state_views_stale:
            self.refresh_state_views()
        if getattr(self, "_storage", None) is not None:  # offload: the caller may write the
            self._storage.copies.staged.clear()  # host buffers: the step copies them again
        return self._state_views

    @state.setter
    def state(self, value: Any) -> None:  # torch.optim.Optimizer.__init__ assigns it
        self._state_views = value

    def invalidate_state_views(self) -> None:
        """Mark ``self.state`` stale (rebuilt when next read). With an 8-bit momentum its entries
        are decoded copies, not views: they are dropped now, so that a read (a checkpoint, torch's
        tools) does not keep a copy of every owned momentum alive for the rest of training (a bf16
        copy: 1.8 GiB on the H200's 1.1B model, held from construction before this)."""
        self._state_views_stale = True
        if getattr(self, "_storage", None) is not None and sd.is_scaled(self._storage.dtype):
            self._state_views.clear()

    def refresh_state_views(self) -> None:
        """Rebuild ``self.state[param]`` (torch-style views) from the functional states: the owned
        matrices' state by key, a marker that refuses math for a matrix held by its owner,
        AdamW's moments."""
        self._state_views_stale = False
        rt = self._rt
        self._storage.copies.synchronize()  # offload: the host buffers hold the last step's values
        views = self._state_views
        views.clear()
        owner = self._owner
        step_m = torch.tensor(float(owner.step_count if rt.owned_names else self.num_steps))
        own = {f.key: owner.value_of(f.key, rt.owned_masters(), view=True)  # the stored momentum:
               for f in owner.fields}  # its stored tensors (fp8: decoded, inference tensors)
        for n in rt.names:
            entry = {}
            for key, vals in own.items():
                buf = vals.get(n)
                if buf is None:  # held by its owner: a marker that refuses math (torch's tools
                    buf = self._momentum_markers.get((n, key))  # read the keys)
                    if buf is None:
                        buf = make_marker(rt.params[n], n, None, what="momentum"
                                          if key == "momentum_buffer" else key)
                        self._momentum_markers[(n, key)] = buf
                entry[key] = buf
            views[rt.params[n]] = dict(entry, step=step_m)
        if self.adamw_state is not None:
            step = torch.tensor(float(self.adamw_state.step))
            for n, p in self._adamw_named:
                views[p] = {"step": step, "exp_avg": self.adamw_state.mu[n],
                            "exp_avg_sq": self.adamw_state.nu[n]}
