"""The gradient ledger (:class:`GradLedger`): one record per dedicated matrix on this rank, in one
explicit state (:class:`Held`), and the ``.grad`` markers that keep torch's semantics (zeroing a
marker zeroes the held gradient, replacing it drops it). The owner's accounting (accumulate,
presence) is the pure phases' (:mod:`dmuon.functional.phases`).

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.ledger".
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import torch
import torch.nn as nn

from dmuon.functional.phases import OwnerGrad, ReducedGrad, accumulate, resolve
from dmuon.stateful.runtime.guard_base import plain_access
from dmuon.stateful.runtime.guards import DedicatedGradMarker, make_marker

__all__ = ["Held", "GradRecord", "GradLedger"]


class Held(enum.Enum):
    """Where a matrix's gradient is on this rank (the table in the design notes)."""

    NONE = "none"
    LOCAL = "local"
    SENT = "sent"
    REDUCED = "reduced"
    CONSUMED = "consumed"


@dataclass(eq=False)
class GradRecord:
    """One matrix's gradient on this rank.

    Attributes:
      state: :class:`Held`.  local: the local gradient not sent yet (any state).
      reduced: the owner's sum of averaged gradients and their presence (``REDUCED``;
        :class:`~dmuon.functional.phases.OwnerGrad`).
      marker: the reused marker object.  shown: the marker is ``.grad`` now.
      zeroed: a shown consumed marker was zeroed.  zero_next: the next step steps with a zero
        gradient when none arrives.  uncleared: a consumed marker came off still ``.grad``, never
        replaced nor zeroed (torch would add to that gradient, which no rank keeps)."""

    state: Held = Held.NONE
    local: Optional[torch.Tensor] = None
    reduced: Optional[OwnerGrad] = None
    marker: Optional[DedicatedGradMarker] = None
    shown: bool = False
    zeroed: bool = False
    zero_next: bool = False
    uncleared: bool = False

    def forget(self) -> None:
        """Hold nothing (the consumed-marker record stays); nothing uncleared."""
        self.state = Held.NONE
        self.local = self.reduced = None
        self.uncleared = False


class GradLedger:
    """The gradient records of one model's dedicated matrices on this rank.

    Args:
      params: ``{name: param}``.  owned: the names this rank owns.
      is_placeholder: ``name -> bool`` (:meth:`show_markers`, :meth:`consume`).
      collect: waits for the in-flight reduces and feeds :meth:`add_reduced` (a reduce still in
        flight counts as held).
    """

    def __init__(self, params: Mapping[str, nn.Parameter], owned: Iterable[str],
                 is_placeholder: Callable[[str], bool], collect: Callable[[], None]):
        self.params = dict(params)
        self.owned = frozenset(owned)
        self.records = {n: GradRecord() for n in self.params}
        self._owned_order = tuple(n for n in self.params if n in self.owned)
        self._is_placeholder = is_placeholder
        self._collect = collect
        self._resolved: Optional[dict[str, Optional[torch.Tensor]]] = None
        #: a synced backward ran since the last step or clear
        self.fresh = False
        #: ``Muon(check_finite=True)``: whether a local gradient this rank sent was non-finite
        self.track_finite = False
        self.nonfinite: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ backward
    def add_local(self, name: str, grad: torch.Tensor) -> None:
        """A local gradient arrived (accumulated onto one not sent yet)."""
        rec = self.records[name]
        if rec.state is Held.CONSUMED:  # (its marker came off at the gather before this use)
            self._take_off([name], held=False)
        rec.local = grad if rec.local is None else rec.local.add_(grad)
        if rec.state is Held.NONE:
            rec.state = Held.LOCAL

    def send(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """A reduce of ``names`` is launched: hand over the local gradients (``{name: grad}``
        of those that have one); the owner holds the average from now on, the others hold what
        they sent."""
        out: dict[str, torch.Tensor] = {}
        for n in names:
            rec = self.records[n]
            if rec.local is not None:
                out[n], rec.local = rec.local, None
            if n in self.owned:
                rec.state = Held.REDUCED
            elif n in out:
                rec.state = Held.SENT
        if self.track_finite and out:
            bad = (~torch.isfinite(torch.stack(torch._foreach_norm(list(out.values()))).float())).any()
            self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad
        self._resolved = None
        return out

    def add_reduced(self, rg: ReducedGrad, scale: Optional[float] = None) -> None:
        """The owner's averaged gradient of one waited reduce (summed over several, in place;
        ``scale``: FSDP2's divide factor, :func:`dmuon.functional.phases.accumulate`)."""
        rec = self.records[rg.name]
        rec.reduced = accumulate(rec.reduced, rg, scale, donate=True)
        self._resolved = None

    # ------------------------------------------------------------------ step
    def resolve(self) -> dict[str, Optional[torch.Tensor]]:
        """``{owned name: averaged gradient, or None}`` (``None``: no rank had one since the last
        clear, or no reduce ran); one batched host read of the presence elements where needed.
        The caller collects the reduces first."""
        if self._resolved is None:
            self._resolved = resolve({n: r.reduced for n, r in self.records.items()},
                                     self._owned_order)
        return self._resolved

    def take_zero_next(self) -> set[str]:
        """At a step: take the consumed markers off; the matrices that step with a zero gradient
        when none arrived (their consumed marker was zeroed and not replaced), then forget that."""
        self._take_off(list(self.records), held=False)
        zero = {n for n, r in self.records.items() if r.zero_next}
        for n in zero:
            self.records[n].zero_next = False
        return zero

    def clear(self) -> None:
        """Drop every held gradient and held marker (``zero_grad``, ``step``); consumed markers
        stay (torch's ``.grad`` of a stepped param lives until it is zeroed)."""
        self._collect()
        self._take_off(self.held_markers())
        for rec in self.records.values():
            if rec.state is not Held.CONSUMED:
                rec.forget()
        self.fresh = False
        self.nonfinite = None
        self._resolved = None

    @plain_access
    def consume(self, stepped: Iterable[str]) -> None:
        """After a step: each stepped placeholder shows a consumed marker."""
        for n in filter(self._is_placeholder, stepped):
            rec = self.records[n]
            rec.forget()
            rec.state = Held.CONSUMED
            self._show(n, rec)

    # ------------------------------------------------------------------ markers
    def _show(self, name: str, rec: GradRecord) -> None:  # (callers: plain_access)
        p, old = self.params[name], rec.marker
        if old is None or (old.dtype, old.device, old.shape) != (p.dtype, p.device, p.shape):
            # C++ holds a marker (``.grad``): a weak reference, or ledger and model never die
            ref = weakref.WeakMethod(self._on_zero)
            rec.marker = make_marker(p, name, lambda n=name: (m := ref()) is not None and m(n),
                                     shape=p.shape)
        p.grad = rec.marker
        rec.shown = True

    @plain_access
    def show_markers(self, names: Iterable[str], gathered: bool = True) -> None:
        """After a backward: each param whose gradient this rank holds shows a held marker, also a
        gathered one (kept across ``no_sync``; not ``gathered``: a ``create_graph`` graph's)."""
        for n in names:
            rec = self.records[n]
            if rec.shown or not (gathered or self._is_placeholder(n)):
                continue
            if rec.local is not None or rec.state in (Held.SENT, Held.REDUCED):
                self._show(n, rec)

    def take_markers(self, names: Iterable[str], *, remove: bool = True,
                     gather: bool = False) -> None:
        """Before a gather, a reduce, a clip or a step: a held marker the user replaced drops the
        gradient; ``remove``: take the others off too (no zero-size ``.grad`` into a backward's
        accumulation). Consumed markers come off, keeping what they say, except at a ``gather``
        those still ``.grad`` (a clear may follow the forward; the grad hook takes them off
        before torch adds)."""
        for n in self._take_off(names, remove, keep_consumed=gather):  # replaced by the user
            self.drop(n)

    @plain_access
    def uncleared(self) -> list[str]:
        """The matrices whose last step's gradient was never replaced nor zeroed (now or when a
        new one arrived): torch would add to it, or step with it again."""
        return [n for n, r in self.records.items() if r.uncleared or (r.state is Held.CONSUMED
                and r.shown and not r.zeroed and self.params[n].grad is r.marker)]

    def held_markers(self) -> list[str]:
        """The names showing a held (not consumed) marker now."""
        return [n for n, r in self.records.items() if r.shown and r.state is not Held.CONSUMED]

    @plain_access
    def _take_off(self, names: Iterable[str], remove: bool = True, held: bool = True,
                  keep_consumed: bool = False) -> list[str]:
        """Take the consumed markers of ``names`` off (a zeroed one still ``.grad``: the next step
        steps with zeros; one never cleared: ``uncleared``) unless ``keep_consumed``, and
        (``held``) the held ones the user replaced, or (``remove``) still show; returns those the
        user replaced."""
        replaced = []
        for n in names:
            rec, p = self.records[n], self.params[n]
            if not rec.shown or not held and rec.state is not Held.CONSUMED:
                continue
            mine = p.grad is rec.marker
            if keep_consumed and mine and rec.state is Held.CONSUMED:
                continue  # still .grad: a clear may follow (a replaced one comes off now)
            if rec.state is Held.CONSUMED:
                rec.zero_next = rec.zeroed if mine else rec.zero_next
                rec.uncleared = rec.uncleared or (mine and not rec.zeroed)
                rec.zeroed, rec.state = False, Held.NONE
            elif not mine:
                replaced.append(n)
            elif not remove:
                continue
            rec.shown = False
            if mine:
                p.grad = None
        return replaced

    def _on_zero(self, name: str) -> None:
        """A shown marker was zeroed (``zero_grad(set_to_none=False)``)."""
        rec = self.records[name]
        if rec.state is Held.CONSUMED:
            rec.zeroed = True
        else:
            self.zero(name)

    def zero(self, name: str) -> None:
        """Zero every gradient held for ``name``, keeping it present (torch's
        ``zero_grad(set_to_none=False)``: stepped with zeros unless a later backward adds)."""
        self._collect()
        rec = self.records[name]
        rec.uncleared = False  # zeroed: the last step's gradient with it
        for held in (rec.local, None if rec.reduced is None else rec.reduced.grad):
            if held is not None:
                held.zero_()

    def drop(self, name: str) -> None:
        """Forget every gradient held for ``name`` (torch's ``zero_grad()``)."""
        self._collect()
        self.records[name].forget()
        self._resolved = None
