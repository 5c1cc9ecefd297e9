"""The forward bookkeeping's pure rules (:mod:`dmuon.functional.forward_log`), without any hook or
process group; the multi-process behaviour is ``tests/test_forward_methods.py``'s."""
from __future__ import annotations

from dmuon.functional.forward_log import ForwardLog


def test_a_group_called_twice_in_one_forward_is_reused_for_good():
    log = ForwardLog(["a", "b"])
    for key in ("a", "b", "a"):
        log.note(key)
    assert log.reused == {"a"}
    log.new_forward()
    log.note("b")
    assert log.reused == {"a"}  # once reused, always


def test_counts_start_again_at_each_forward():
    log = ForwardLog(["a", "b"])
    for _ in range(3):  # three forwards that bypass the model's hook, each ended (backward, step)
        log.note("a")
        log.note("b")
        log.new_forward()
    assert log.reused == set()


def test_the_listeners_first_group_once_per_forward():
    log = ForwardLog(["a", "b"])
    assert [log.first_group(), log.first_group()] == [True, False]
    log.new_forward()
    assert log.first_group()


def test_order_agreed_or_static_and_next_group():
    log = ForwardLog(["a", "b", "c"])
    log.note("c")
    log.note("a")
    assert log.proposal() == ("c", "a", "b")  # first forward's order, then the rest
    assert log.next_group("c") is None  # not agreed yet: no prefetch
    assert log.agree([("c", "a", "b")] * 2) and log.final
    assert (log.next_group("c"), log.next_group("c", backward=True)) == ("a", None)
    assert log.next_group("b") is None and log.next_group("x") is None
    log.note("b")  # after the agreement a forward no longer changes the order
    assert log.order == ["c", "a", "b"]
    other = ForwardLog(["a", "b", "c"])
    other.note("c")
    assert not other.agree([("c", "a", "b"), ("a", "b", "c")])  # ranks differ: static order
    assert other.order == ["a", "b", "c"] and other.next_group("a") == "b"
