"""``dmuon.Muon.state``: torch's ``optimizer.state`` as views of dmuon's own states (pure).

torch's tools and users read ``optimizer.state[p]`` (``"momentum_buffer"`` or a variant's fields,
``"exp_avg"``, ``"exp_avg_sq"``, ``"step"``). dmuon rebuilds that mapping from its functional
states when it is read, so writes that torch applies would change nothing here: replacing or
deleting entries (``state.clear()``, ``del state[p]``, ``state[p]["exp_avg"] = t``) raises at once
(:data:`REFUSED`; writing back the same values, as the "move optimizer state to the device" helpers
do, passes), and an in-place write into a copy (each ``"step"`` count is one) is found at
the next ``step()`` (:meth:`StateViews.written`), which then raises on every rank. In-place writes
into the other tensors (``state[p]["exp_avg"].zero_()``) write dmuon's state: they are views (an
8-bit momentum's entries are decoded copies made as inference tensors: torch refuses writes there).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["StateViews", "StateEntry", "REFUSED", "assign_refused", "written_copies"]

REFUSED = (
    "dmuon.Muon: optimizer.state is rebuilt from dmuon's own states whenever it is read, so "
    "replacing or deleting its entries with other values (state.clear(), del state[p], "
    "state[p]['exp_avg'] = t, pop, update) changes nothing. Write the tensors in place instead "
    "(state[p]['exp_avg'].zero_(): they are views of the state, but for an 8-bit momentum's "
    "decoded copies), load a state dict "
    "(optimizer.load_state_dict, dmuon.set_optimizer_state_dict), or build a new "
    "dmuon.Muon(model) to start from fresh state.")


def assign_refused() -> str:
    """``optimizer.state = ...`` after construction."""
    return REFUSED.replace("replacing or deleting its entries", "assigning optimizer.state or "
                           "replacing or deleting its entries", 1)


def _refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(REFUSED)


def _same_value(old: Any, new: Any) -> bool:
    """Whether writing ``new`` over ``old`` changes no value: the same object, or a tensor of
    the same shape, dtype and values (a move to another device or a copy, as the "move optimizer
    state to the device" helpers write back), or an entry of such values."""
    if old is new:
        return True
    try:
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            return (old.shape == new.shape and old.dtype == new.dtype
                    and bool(torch.equal(old, new.to(old.device))))
        if isinstance(old, dict) and isinstance(new, Mapping):
            return set(old) == set(new) and all(_same_value(old[k], new[k]) for k in old)
        return not isinstance(new, torch.Tensor) and bool(old == new)
    except Exception:  # noqa: BLE001 - a marker refuses math; anything uncomparable changes
        return False


class StateEntry(dict):
    """One param's state (field name -> tensor): read as a dict; a write that would change a
    value raises :data:`REFUSED` (writing back the same values, as a device move does, passes)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if not _same_value(dict.get(self, key, _MISSING), value):
            raise RuntimeError(REFUSED)

    __delitem__ = clear = pop = popitem = update = setdefault = __ior__ = _refuse

    def __reduce__(self) -> Any:  # copy / deepcopy / pickle: a plain dict
        return dict, (dict(self),)


_MISSING = object()


class StateViews(dict):
    """param -> :class:`StateEntry`, filled by the optimizer (:meth:`fill`); a param without state
    reads as an empty entry (torch's ``defaultdict``, nothing inserted)."""

    def __init__(self) -> None:
        super().__init__()
        self._copies: list[tuple[str, torch.Tensor, int]] = []

    def __setitem__(self, key: Any, value: Any) -> None:
        if not _same_value(dict.get(self, key, _MISSING), value):
            raise RuntimeError(REFUSED)

    __delitem__ = clear = pop = popitem = update = setdefault = __ior__ = _refuse

    def __missing__(self, key: Any) -> StateEntry:
        return StateEntry()

    def __reduce__(self) -> Any:
        return dict, ({k: dict(v) for k, v in self.items()},)

    def fill(self, entries: Mapping[Any, Mapping[str, Any]], names: Mapping[Any, str]) -> None:
        """Replace every entry with ``entries`` (param -> fields); each ``"step"`` tensor is a
        copy: its version is recorded (``names``: param -> its name, for :meth:`written`)."""
        dict.clear(self)
        dict.update(self, {p: StateEntry(e) for p, e in entries.items()})
        steps = [(f"{names[p]}['step']", e["step"]) for p, e in entries.items()
                 if isinstance(e.get("step"), torch.Tensor)]
        self._copies = [(label, t, t._version) for label, t in steps]

    def empty(self) -> None:
        """Drop every entry (and the copies' record)."""
        dict.clear(self)
        self._copies = []

    def written(self) -> list[str]:
        """The copies written in place since :meth:`fill` (reported once: rebased here)."""
        found = [label for label, t, v in self._copies if t._version != v]
        if found:
            self._copies = [(label, t, t._version) for label, t, _ in self._copies]
        return found


def written_copies(labels: list[str], where: str) -> str:
    """The error when copies in ``optimizer.state`` were written in place (``labels``:
    :meth:`StateViews.written`; empty: another rank's were), raised at ``where``."""
    what = (f"{len(labels)} entries of optimizer.state (first: {labels[0]}) were" if labels else
            "another rank found entries of optimizer.state")
    return (f"{where}: {what} written in place, but they are copies (the step counts "
            "dmuon.Muon.state shows), so the write changes nothing; the write was dropped, nothing "
            "was updated and this batch's gradients were dropped. To change the optimizer's state, "
            "load a state dict (optimizer.load_state_dict) or build a new dmuon.Muon(model)")
