"""RecurringGraphs' decisions without a GPU (the captures and replays themselves run in
``tests/test_ns_overlap_gpu.py``): eager until a key recurs; a key of ``None`` never captures; a
capture that fails leaves the slot eager for good, said once."""
import logging

import torch

from dmuon.kernels.graph_replay import RecurringGraphs


def test_eager_paths_and_failed_capture(caplog):
    g, calls = RecurringGraphs(), []

    def fn():
        calls.append(1)
        return torch.ones(2)

    run = lambda slot, key: g(slot, key, fn, lambda out: [out], set(), torch.device("cpu"))  # noqa: E731
    assert run("a", None)[1] is False and run("a", None)[1] is False  # never captured
    assert run("b", 1)[1] is False and run("b", 2)[1] is False  # keys that do not recur
    with caplog.at_level(logging.WARNING, logger="dmuon.kernels.graph_replay"):
        out, replayed = run("b", 2)  # recurs: the capture fails on CPU, eager instead
        assert replayed is False and torch.equal(out, torch.ones(2))
        assert [r for r in caplog.records if "eagerly from now on" in r.getMessage()]
        caplog.clear()
        assert run("b", 2)[1] is False and not caplog.records  # eager for good, said once
    assert len(calls) == 6 and g.captures == {"b": g.max_captures}
