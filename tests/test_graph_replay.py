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

    run = lambda slot, key: g(slot, key, fn, lambda out: [out], set, torch.device("cpu"))  # noqa: E731
    assert run("a", None)[1] is False and run("a", None)[1] is False  # never captured
    assert run("b", 1)[1] is False and run("b", 2)[1] is False  # keys that do not recur
    with caplog.at_level(logging.WARNING, logger="dmuon.kernels.graph_replay"):
        out, replayed = run("b", 2)  # recurs: the capture fails on CPU, eager instead
        assert replayed is False and torch.equal(out, torch.ones(2))
        assert [r for r in caplog.records if "eagerly from now on" in r.getMessage()]
        caplog.clear()
        assert run("b", 2)[1] is False and not caplog.records  # eager for good, said once
    assert len(calls) == 6 and g.captures == {"b": g.max_captures}


class _FakeGraph:
    """Stands for a captured CUDA graph: ``replay`` writes ``value`` into the result buffer."""

    def __init__(self, buf, value):
        self.buf, self.value, self.replays = buf, value, 0

    def replay(self):
        self.replays += 1
        self.buf.fill_(self.value)


def test_capture_checked_against_eager_then_replayed(monkeypatch, caplog):
    """The policy around a capture, with the capture faked (no GPU here): results in the caller's
    buffer; a first replay equal to the eager run keeps the graph (later calls replay it), one that
    differs leaves the slot eager for good, with a warning."""
    import dmuon.kernels.graph_replay as gr
    buf = torch.zeros(2)

    def fn():
        buf.fill_(1.0)
        return buf

    for faithful in (True, False):
        fakes = []
        monkeypatch.setattr(gr.torch.cuda, "graph_pool_handle", lambda: "pool")
        monkeypatch.setattr(gr, "side_stream", lambda device, role: None)
        monkeypatch.setattr(gr, "capture_graph", lambda f, pool, stream: (
            fakes.append(_FakeGraph(buf, 1.0 if faithful else 2.0)) or fakes[-1], buf))
        g = gr.RecurringGraphs()
        run = lambda: g("s", 7, fn, lambda out: [out], lambda: {buf.data_ptr()}, torch.device("cpu"))  # noqa: E731
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dmuon.kernels.graph_replay"):
            assert run()[1] is False  # eager (first sight)
            out, replayed = run()  # captured, replayed once, checked against the eager run
            assert replayed is False and torch.equal(out, torch.ones(2)) and fakes[0].replays == 1
            later = [run()[1] for _ in range(2)]
        if faithful:
            assert later == [True, True] and fakes[0].replays == 3 and not caplog.records
        else:
            assert later == [False, False] and fakes[0].replays == 1 and len(fakes) == 1
            assert ["differed" in r.getMessage() for r in caplog.records] == [True]
            assert torch.equal(buf, torch.ones(2))
    # results that lie in the graphs' pool (not the caller's buffers): never kept
    g = gr.RecurringGraphs()
    run = lambda: g("p", 7, fn, lambda out: [out], set, torch.device("cpu"))  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="dmuon.kernels.graph_replay"):
        caplog.clear()
        assert [run()[1] for _ in range(4)] == [False] * 4
        assert ["pool" in r.getMessage() for r in caplog.records] == [True]
