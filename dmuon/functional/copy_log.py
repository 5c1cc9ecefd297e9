"""The copies that state dicts hand out, and which of them were written in place since (pure
bookkeeping: the runtime records and asks, as with :mod:`~dmuon.functional.forward_log`).

FSDP2's ``model.state_dict()`` entries are views of its params, and a torch optimizer's
``state_dict()`` holds its live state tensors: ``torch.distributed.checkpoint.load(sd)``, which
writes into a state dict's tensors in place, loads them even when ``load_state_dict(sd)`` is never
called (``dcp.load({"model": model.state_dict(), ...})`` as one line). On a dmuon model a dedicated
matrix's entry is a copy of its rows, and ``Muon.state_dict()`` gives its momentum rows and step
counts as copies: written in place, they load nothing until the ``load_state_dict`` of their kind.

The log holds each copy handed out until the runtime's next hook or step (:meth:`CopyLog.settle`;
a state dict built inline dies as ``dcp.load`` returns), then only a weak reference (a dict the
user keeps may be written later); a copy found written stays written after it is gone, until a
load of its kind (:meth:`CopyLog.loaded`): by then ``dcp.load`` has written FSDP2's params in place,
so dropping the dict leaves a half-loaded model. :meth:`CopyLog.written` names them, so that the
runtime raises before a forward (the model's) or a step (both kinds) would read the old values.
Not seen: a dict kept past a hook (then held weakly) that is written and dropped before the next
hook or step, and writes through ``.data`` or ``.detach()`` (they bump no version counter).
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable, Optional

import torch

__all__ = ["CopyLog", "MODEL", "OPTIMIZER", "unloaded_copies"]

MODEL, OPTIMIZER = "model", "optimizer"


class _Copy:
    """One copy handed out: weak references to the entry and to the tensor it holds (a DTensor's
    own local tensor; the entry itself for a plain tensor), their version counters, and the
    log's epoch then. A write through the DTensor (``sd[k].copy_(v)``) bumps the entry's counter
    only; one through its ``to_local()`` view (what ``dcp.load`` does) the local tensor's only."""

    __slots__ = ("kind", "key", "refs", "versions", "epoch")

    def __init__(self, kind: str, key: str, entry: torch.Tensor, local: torch.Tensor,
                 epoch: int) -> None:
        self.kind, self.key, self.epoch = kind, key, epoch
        self.refs = (weakref.ref(entry), weakref.ref(local))
        self.versions = (entry._version, local._version)

    def tensors(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The entry and its local tensor, or ``None`` once either is gone."""
        entry, local = self.refs[0](), self.refs[1]()
        return None if entry is None or local is None else (entry, local)

    def now(self, tensors: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
        return tensors[0]._version, tensors[1]._version


class CopyLog:
    """The copies state dicts handed out, by key: held until :meth:`settle`, then weakly; the
    keys found written and not loaded since."""

    def __init__(self) -> None:
        self._copies: dict[str, list[_Copy]] = {}
        self._held: list[tuple[_Copy, tuple[torch.Tensor, torch.Tensor]]] = []
        self._unloaded: dict[str, dict[str, None]] = {}  # kind: keys found written (ordered)
        self._epoch = 0  # bumped whenever the model's or optimizer's state changes

    def handed_out(self, kind: str, copies: Iterable[tuple[str, torch.Tensor]],
                   local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        """``copies`` (``(key, entry)``: the state dict's tensors, not inference tensors) were
        handed out in a state dict of ``kind``; ``local(entry)``: the tensor a write through
        ``to_local()`` lands in (a DTensor's own local tensor)."""
        self._prune()
        for key, entry in copies:
            c = _Copy(kind, key, entry, local(entry), self._epoch)
            self._copies.setdefault(key, []).append(c)
            self._held.append((c, (entry, local(entry))))

    def _written(self, c: _Copy) -> bool:
        """Whether ``c`` was written since handed out (or last loaded), other than refreshed: a
        write with the values of another copy of its key handed out at this epoch, itself
        unwritten, holds the current values and loads nothing (torchtitan's checkpointer keeps
        one dict and copies each new ``state_dict()`` into it); then ``c`` is rebased."""
        e, loc = c.refs[0](), c.refs[1]()  # (the hot path: every hook group's forward)
        if e is None or loc is None or (e._version, loc._version) == c.versions:
            return False
        t = (e, loc)
        for o in self._copies.get(c.key, ()):
            u = o.tensors() if o is not c and o.kind == c.kind and o.epoch == self._epoch else None
            if u is not None and o.now(u) == o.versions and u[1].shape == t[1].shape and \
                    u[1].dtype == t[1].dtype and bool(torch.equal(u[1], t[1])):
                c.versions = c.now(t)
                return False
        self._unloaded.setdefault(c.kind, {})[c.key] = None  # written: so even once it is gone
        return True

    def settle(self, judge: bool = False) -> None:
        """At the runtime's next hook or step: judge every copy written since (:meth:`_written`,
        while the held ones can still serve as the current values; ``judge``: even when none is
        held, as before the epoch moves), then let the held ones go (only weak references
        stay)."""
        if self._held or judge:
            for cs in list(self._copies.values()):
                for c in cs:
                    self._written(c)
            self._held = []

    def loaded(self, kind: Optional[str], keys: Optional[Iterable[str]] = None) -> None:
        """The model's or optimizer's state changed: a load of ``kind`` (``None``: a step), of
        ``keys`` (default all): what those copies hold counts as loaded."""
        # a refresh from this epoch's copies is one only until now: a load judges every copy (a
        # step's pre-step check has just judged them, and no user code ran since)
        self.settle(judge=kind is not None)
        self._epoch += 1
        if kind is None:
            return
        keys = None if keys is None else set(keys)
        found = self._unloaded.get(kind, {})
        for key in list(found) if keys is None else [k for k in found if k in keys]:
            del found[key]
        for key, cs in self._copies.items():
            for c in cs:
                if c.kind == kind and (keys is None or key in keys) and (
                        t := c.tensors()) is not None:
                    c.versions = c.now(t)
        self._prune()

    def written(self, kinds: Iterable[str] = (MODEL, OPTIMIZER),
                keys: Optional[Iterable[str]] = None, settle: bool = False) -> dict[str, list[str]]:
        """``{kind: [key, ...]}`` of the copies of ``kinds`` (and ``keys``; default all) written
        in place since they were handed out (or last loaded), gone or not; ``settle``: a hook or
        step asks (:meth:`settle` first; a state-dict call in between must not let the copies of
        one being built go)."""
        if not (self._copies or self._unloaded):
            return {}
        if settle:
            self.settle()
        kinds = tuple(kinds)
        for key in self._copies if keys is None else keys:
            for c in self._copies.get(key, ()):
                if c.kind in kinds:
                    self._written(c)
        out: dict[str, list[str]] = {}
        for kind, found in self._unloaded.items():
            if kind in kinds:
                got = [k for k in (found if keys is None else keys) if k in found]
                if got:
                    out[kind] = got
        return out

    def check(self, kinds: Iterable[str], where: str,
              keys: Optional[Iterable[str]] = None) -> None:
        """Raise ``RuntimeError`` (:func:`unloaded_copies`) if copies of ``kinds`` (and ``keys``)
        were written but not loaded (this rank's view: a forward hook, which agrees nothing)."""
        if written := self.written(kinds, keys, settle=True):
            raise RuntimeError(unloaded_copies(written, where))

    def _prune(self) -> None:
        """Forget the weak references to copies no one holds any more."""
        if any(c.tensors() is None for cs in self._copies.values() for c in cs):
            live = {key: [c for c in cs if c.tensors() is not None]
                    for key, cs in self._copies.items()}
            self._copies = {key: cs for key, cs in live.items() if cs}


def unloaded_copies(written: dict[str, list[str]], where: str) -> str:
    """The error when state-dict copies were written in place (``written``: :meth:`CopyLog.
    written`; empty: another rank's were) but never loaded, raised at ``where``."""
    if not written:
        return (f"{where}: another rank found entries of an earlier model.state_dict() or "
                "Muon.state_dict() written in place (torch.distributed.checkpoint.load does that) "
                "but never loaded; load them (model / optimizer .load_state_dict) on every rank")
    lines = []
    for kind, keys in written.items():
        call, what = (("model.load_state_dict(sd)", "model.state_dict()") if kind == MODEL else
                      ("optimizer.load_state_dict(sd)", "Muon.state_dict()"))
        lines.append(f"{len(keys)} entries of an earlier {what} (first: {keys[0]!r}) were "
                     f"written in place but never loaded: call {call} with that dict")
    return (f"{where}: " + "; ".join(lines) + ". torch.distributed.checkpoint.load(sd) (or code "
            "that writes into a state dict's tensors, such as an EMA kept in them: use clones) "
            "writes them in place; on plain FSDP2 those are views of the params, but on a dmuon "
            "model a dedicated matrix's entry, its momentum and the step counts are copies: the "
            "model is half-loaded (dcp.load wrote FSDP2's params and AdamW's moments, not these). "
            "Load the dict after dcp.load (as torch's set_state_dict and Stateful "
            "checkpointers do): sd = {'model': model.state_dict(), 'optim': "
            "optimizer.state_dict()}; dcp.load(sd, ...); model.load_state_dict(sd['model']); "
            "optimizer.load_state_dict(sd['optim']); if dcp.load itself failed, or the dict is "
            "gone, load a checkpoint the same way into a new dict")
