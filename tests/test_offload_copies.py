"""``dmuon.stateful.optimizer.offload_copies`` (issue 38): the copies back's byte budget (pure)
and the order of deferred copies back on CPU (every copy back waits for a flush there)."""
from __future__ import annotations


def test_copies_back_budget():
    """``next_out_budget`` (pure): copies that ran past the step's end are held back next step;
    when held-back copies exist and the copies ended early, the room is given back; else as is."""
    from dmuon.stateful.optimizer.offload_copies import next_out_budget
    gib = 1 << 30
    # 3.62 GiB in 71 ms, ending 19 ms after the step: next step starts what 52 ms move
    b = next_out_budget(None, int(3.62 * gib), False, 71.0, 19.0)
    assert abs(b - 3.62 * gib * 52 / 71) < 1e-3 * gib
    assert next_out_budget(b, b, True, 52.0, 0.0) == b  # on the end exactly: unchanged
    assert next_out_budget(b, b, True, 52.0, -5.2) == int(b * 1.1)  # 5.2 ms early: 10 % more
    assert next_out_budget(None, gib, False, 20.0, -30.0) is None  # fits: no limit
    assert next_out_budget(123, 0, False, 0.0, 0.0) == 123  # nothing measured
    assert next_out_budget(None, gib, False, 10.0, 50.0) == 0  # all of it past the end


def test_a_copy_in_starts_only_the_copies_back_it_needs():
    """``OffloadCopies`` on CPU (every copy back waits): copying ``a`` in starts the deferred
    copies back up to ``a``'s (in order) and leaves ``b``'s deferred; ``synchronize`` starts the
    rest; the staged copy of ``a`` holds its stepped value."""
    import torch
    from dmuon.stateful.optimizer.offload_copies import OffloadCopies
    c = OffloadCopies(torch.device("cpu"))
    host = {n: torch.zeros(3) for n in "abc"}
    c.copy_out(["a"], [host["a"]], [torch.full((3,), 1.0)])
    c.copy_out(["b"], [host["b"]], [torch.full((3,), 2.0)])
    assert all(float(h.sum()) == 0.0 for h in host.values())  # deferred
    c.copy_in({"a": host["a"]})
    assert float(host["a"].sum()) == 3.0 and float(host["b"].sum()) == 0.0
    assert torch.equal(c.wait(["a"])[0], torch.full((3,), 1.0))
    c.copy_in({"c": host["c"]})  # nothing deferred holds c: b stays deferred
    assert float(host["b"].sum()) == 0.0
    c.synchronize()
    assert float(host["b"].sum()) == 6.0 and c.copies_out == 2 and c.copies_in == 2
