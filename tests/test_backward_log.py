"""The backward bookkeeping's pure rules (:mod:`dmuon.functional.backward_log`), without any hook or
process group; the multi-process behaviour is the reduce-order and exception suites'
(``tests/test_exception_in_backward.py``, ``tests/test_stateful_equality.py``)."""
from __future__ import annotations

import pytest

from dmuon.functional.backward_log import BackwardLog, GradState
from dmuon.functional.step_checks import LaunchLog, combine_launches, fold_launch


def _log() -> BackwardLog:
    log = BackwardLog({"a": ("a.w", "a.v"), "b": ("b.w",), "": ("head",)})
    log.set_order(("b", "a", ""))
    return log


def _launch_due(log: BackwardLog, every: bool = False) -> list[str]:
    out = []
    while (key := log.next_due(every)) is not None:
        out.append(key)
        log.launched(key)
    return out


def test_reduces_launch_in_the_fixed_order_whatever_the_arrival_order():
    log = _log()
    log.arrive("a", "a.w")
    log.arrive("a", "a.v")
    assert log.state["a"] is GradState.COMPLETE
    assert _launch_due(log) == []  # "b" comes first in the order and is not complete
    log.arrive("b", "b.w")
    assert _launch_due(log) == ["b", "a"]
    assert log.state["a"] is GradState.REDUCED
    assert _launch_due(log, every=True) == [""]  # the backward's end: complete or not


def test_a_reused_group_waits_for_the_backwards_end():
    log = _log()
    log.arrive("b", "b.w", defer=True)
    assert log.state["b"] is GradState.ACCUMULATING
    assert _launch_due(log) == []
    assert _launch_due(log, every=True) == ["b", "a", ""]


def test_a_gradient_after_its_groups_reduce_raises_naming_the_cause():
    log = _log()
    log.arrive("b", "b.w")
    assert _launch_due(log) == ["b"]
    with pytest.raises(RuntimeError, match="arrived after the reduce of its hook group 'b'"):
        log.arrive("b", "b.w")


def test_the_backwards_end_starts_every_group_again():
    log = _log()
    log.arrive("b", "b.w")
    _launch_due(log)
    log.end()
    assert set(log.state.values()) == {GradState.IDLE}
    log.arrive("b", "b.w")  # no longer "after its reduce"
    assert _launch_due(log) == ["b"]


def test_launched_out_of_order_and_a_partial_order_are_refused():
    log = _log()
    with pytest.raises(ValueError, match="out of the reduce order"):
        log.launched("a")
    with pytest.raises(ValueError, match="every hook group once"):
        log.set_order(("a", "b"))
    assert BackwardLog({"a": ("x",)}).next_due(every=True) is None  # no order before the program


def test_launch_log_folds_each_kind_and_starts_again():
    log = LaunchLog()
    log.note("unshard", "gather:a")
    log.note("reduce", "a")
    log.note("unshard", "gather:b")
    want = combine_launches({"unshard": fold_launch(fold_launch(1, "gather:a"), "gather:b"),
                             "reduce": fold_launch(1, "a")})
    assert log.take() == want
    assert log.take() == combine_launches({})
