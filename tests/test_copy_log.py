"""The state-dict copy log's rules (:mod:`dmuon.functional.copy_log`), without a model: a copy
written in place counts until a load of its kind; the log never keeps a copy alive."""
from __future__ import annotations

import gc

import pytest
import torch

from dmuon.functional.copy_log import MODEL, OPTIMIZER, CopyLog, unloaded_copies


def test_a_copy_written_in_place_counts_until_a_load_of_its_kind():
    log = CopyLog()
    a, b, m = torch.zeros(3), torch.zeros(2), torch.zeros(4)
    log.handed_out(MODEL, [("w.a", a), ("w.b", b)])
    log.handed_out(OPTIMIZER, [("w.a.momentum_buffer", m)])
    assert log.written() == {}
    a.copy_(torch.ones(3))            # what dcp.load does
    b[:1].fill_(2.0)                  # a write through a view counts too
    m.add_(1.0)
    assert log.written() == {MODEL: ["w.a", "w.b"], OPTIMIZER: ["w.a.momentum_buffer"]}
    assert log.written([MODEL]) == {MODEL: ["w.a", "w.b"]}
    log.loaded(OPTIMIZER)             # the optimizer's load: its copies count as loaded
    assert log.written() == {MODEL: ["w.a", "w.b"]}
    log.loaded(None)                  # a step's masters_changed: no load
    assert log.written([MODEL]) == {MODEL: ["w.a", "w.b"]}
    log.loaded(MODEL)
    assert log.written() == {}
    a.mul_(3.0)                       # written again after the load
    assert log.written() == {MODEL: ["w.a"]}


def test_copies_are_held_until_settled_and_a_written_one_stays_written_when_gone():
    """A state dict built inline (``dcp.load({"model": model.state_dict()})``) dies as the load
    returns: the log holds its copies until the runtime's next hook (:meth:`CopyLog.settle`), and a
    copy found written stays written after it is gone, until a load of its kind."""
    import weakref
    log = CopyLog()
    t, u = torch.zeros(1000), torch.zeros(10)
    log.handed_out(MODEL, [("w", t), ("v", u)])
    gone, kept = weakref.ref(t), weakref.ref(u)
    t.add_(1.0)                       # written ...
    del t, u                          # ... and the dict dropped before any hook ran
    gc.collect()
    assert gone() is not None         # held until settled
    assert log.written() == {MODEL: ["w"]}   # a state-dict call's check: still held
    gc.collect()
    assert gone() is not None
    assert log.written(settle=True) == {MODEL: ["w"]}   # a hook's: settles
    gc.collect()
    assert gone() is None and kept() is None  # let go: the log keeps no copy alive
    assert log.written() == {MODEL: ["w"]}   # still written: the model is half-loaded
    assert log.written([MODEL], keys=["v"]) == {}
    log.loaded(OPTIMIZER)
    assert log.written() == {MODEL: ["w"]}
    log.loaded(MODEL)
    assert log.written() == {} and log._copies == {} and log._held == []


def test_check_raises_naming_the_call_and_the_first_key():
    log = CopyLog()
    t = torch.zeros(2)
    log.handed_out(MODEL, [("layers.0.q.weight", t)])
    log.check([MODEL], "dmuon (forward)")  # nothing written: no error
    t.fill_(1.0)
    with pytest.raises(RuntimeError, match=r"dmuon \(forward\): 1 entries of an earlier "
                       r"model.state_dict\(\) \(first: 'layers.0.q.weight'\)"):
        log.check([MODEL], "dmuon (forward)")
    log.check([OPTIMIZER], "dmuon.Muon.step")  # other kinds only: no error
    msg = unloaded_copies({OPTIMIZER: ["w.step"]}, "dmuon.Muon.step")
    assert "optimizer.load_state_dict(sd)" in msg and "'w.step'" in msg
    assert "another rank" in unloaded_copies({}, "dmuon.Muon.step")


def test_a_hook_group_reads_only_its_own_keys():
    log = CopyLog()
    a, b = torch.zeros(2), torch.zeros(2)
    log.handed_out(MODEL, [("layers.0.q", a), ("layers.1.q", b)])
    b.add_(1.0)
    assert log.written([MODEL], keys=["layers.0.q"]) == {}
    log.check([MODEL], "dmuon (forward)", ["layers.0.q", "layers.0.k"])  # not its copy: no error
    with pytest.raises(RuntimeError, match="'layers.1.q'"):
        log.check([MODEL], "dmuon (forward)", ["layers.1.q"])


def test_a_write_through_the_entry_or_through_its_local_tensor_counts():
    """A DTensor entry and its local tensor keep their own version counters: ``sd[k].copy_(v)``
    bumps the entry's, ``dcp.load`` (through ``to_local()``) the local tensor's. Before (a
    review, session 16): only the local tensor was watched, and a hand-written ``copy_`` into a
    DTensor entry was neither loaded nor reported."""
    log = CopyLog()
    entry, local = torch.zeros(2), torch.zeros(2)   # stand-ins for a DTensor and its local
    entry2, local2 = torch.zeros(2), torch.zeros(2)
    locals_ = {id(entry): local, id(entry2): local2}
    log.handed_out(MODEL, [("a", entry), ("b", entry2)], lambda t: locals_[id(t)])
    entry.fill_(1.0)
    local2.fill_(1.0)
    assert log.written() == {MODEL: ["a", "b"]}


def test_a_copy_refreshed_with_the_current_values_is_not_a_load():
    """torchtitan's checkpointer keeps one state dict and copies each new ``state_dict()`` into
    it: the old copies are written with the current values, which loads nothing. Before (session
    16, torchtitan's integration test): every export after its save raised."""
    log = CopyLog()
    cached = torch.zeros(3)
    log.handed_out(MODEL, [("w", cached)])
    log.settle()                      # a hook: only a weak reference now
    fresh = torch.full((3,), 2.0)     # the model's values now (a new state_dict())
    log.handed_out(MODEL, [("w", fresh)])
    cached.copy_(fresh)               # the refresh
    del fresh
    assert log.written() == {}
    other = torch.full((3,), 2.0)
    log.handed_out(MODEL, [("w", other)])
    cached.copy_(torch.full((3,), 5.0))  # values of no copy handed out since: a load
    del other
    assert log.written() == {MODEL: ["w"]}


def test_a_weakly_held_copy_found_written_stays_written_once_gone():
    log = CopyLog()
    t = torch.zeros(2)
    log.handed_out(MODEL, [("w", t)])
    log.settle()
    t.fill_(1.0)
    assert log.written() == {MODEL: ["w"]}
    del t
    gc.collect()
    assert log.written() == {MODEL: ["w"]}


def _refreshed_after_a_hook():
    """A cached copy, a fresh one of the same key, an eval forward's hook, then the refresh."""
    log = CopyLog()
    cached, fresh = torch.zeros(3), torch.full((3,), 2.0)
    log.handed_out(MODEL, [("w", cached)])
    log.handed_out(MODEL, [("w", fresh)])
    log.settle()
    cached.copy_(fresh)
    return log, cached, fresh


def test_a_refresh_from_a_copy_handed_out_at_this_epoch_is_not_a_load():
    """A refresh from a dict taken before an eval forward (a hook settled it: only weakly held
    since) is still a refresh while no step or load ran; after one, the same values are stale.
    Before (a review, session 16): the refresh after the forward raised."""
    log, cached, fresh = _refreshed_after_a_hook()
    assert log.written() == {}
    log.loaded(None)                  # a step: the model moved on, `fresh` is stale now
    cached.copy_(fresh + 1.0)
    fresh.add_(1.0)                   # (written itself: it cannot vouch for anything)
    assert log.written() == {MODEL: ["w"]}


def test_a_partial_load_takes_over_only_its_keys():
    """``model.load_state_dict(part, strict=False)`` after ``dcp.load`` wrote the whole dict: the
    keys it did not load stay written. Before (a review, session 16): every key was cleared."""
    log = CopyLog()
    a, b = torch.zeros(2), torch.zeros(2)
    log.handed_out(MODEL, [("a", a), ("b", b)])
    a.fill_(1.0)
    b.fill_(1.0)
    log.loaded(MODEL, keys=["a"])
    assert log.written() == {MODEL: ["b"]}


def test_a_refresh_stays_one_across_a_load_of_the_other_kind():
    """A refresh judged only after a later load had moved the epoch came out a load. Before (a
    review, session 16): a model refresh followed by an optimizer load raised."""
    log, _, _ = _refreshed_after_a_hook()
    log.loaded(OPTIMIZER)             # ... then an optimizer load, before any other check
    assert log.written() == {}
