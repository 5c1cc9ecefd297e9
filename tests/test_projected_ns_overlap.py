"""Owner NS overlapped with the backward, in the projector (issue 47): the model on hand-checked
numbers, the calibration as data re-fitted from its measurements, the projection with overlap
(never longer; the exact sequential result when off), and the refusal with split units."""
from __future__ import annotations


import pytest


def test_overlapped_work_runs_at_the_idle_share_in_the_backward_and_fully_in_its_gaps():
    from dmuon.tools.ns_overlap import overlapped_finish
    busy = [(0.0, 10.0), (12.0, 20.0)]
    # lands at 0: 10 s at 0.25 -> 2.5 done, the gap 10..12 -> 2 more, 12..20 -> 2 more: 6.5 of 8
    # by 20, then 1.5 s at full rate
    assert overlapped_finish({0.0: 8.0}, busy, 0.25) == pytest.approx(21.5)
    # first come, first served: the later group waits for the earlier one
    assert overlapped_finish({0.0: 2.0, 11.0: 1.0}, busy, 0.25) == pytest.approx(12.0)
    # idle 0: nothing progresses inside the backward; the gap 10..12 does 2, the last 1 after 20
    assert overlapped_finish({1.0: 3.0}, busy, 0.0) == pytest.approx(21.0)
    # after the backward: the full rate
    assert overlapped_finish({25.0: 1.0}, busy, 0.5) == pytest.approx(26.0)


def test_the_calibration_is_the_fit_of_its_measurements():
    """The idle shares the machine model holds are what fit_idle_points derives from the issue-47
    measurements on it (so data and source agree), and the projector with overlap on each
    measured world-1 setup saves the measured share (a measured loss: nothing, the model never
    slows the backward)."""
    from dmuon.tools.calibration import H200_W1
    from dmuon.tools.machine import H200
    from dmuon.tools.calibration import fit_idle_points
    from dmuon.tools.ns_overlap import MEASURED
    from dmuon.tools.projection import StepSetup, project_step
    fit = fit_idle_points(H200)
    held = dict(H200.ns_overlap_idle)
    for key, pts in fit.items():
        assert [x for x, _ in held[key]] == pytest.approx([x for x, _ in pts], rel=1e-5)
        assert [y for _, y in held[key]] == pytest.approx([y for _, y in pts], rel=1e-5, abs=1e-9)
    shares = [m["saved_share"] for m in MEASURED]
    assert min(shares) < 0 < max(shares)  # a loss (fits 0) and a gain
    from dmuon.tools.presets import ModelPreset
    for m in MEASURED:
        model = ModelPreset("measured", **m["model"]) if "model" in m else H200_W1
        kw = dict(micro_batch=m["micro_batch"], seq=m["seq"], max_split=1)
        seq = project_step(StepSetup(model, 1, 1, **kw), H200, "dmuon")
        ov = project_step(StepSetup(model, 1, 1, ns_overlap=True, **kw), H200, "dmuon")
        share = 1 - ov.step / seq.step
        assert share == pytest.approx(max(m["saved_share"], 0.0), abs=1e-4), (m, share)


def test_overlap_shortens_the_step_by_what_it_hides_and_off_is_the_sequential_step():
    from dmuon.tools.machine import H200
    from dmuon.tools.presets import get_preset
    from dmuon.tools.projection import StepSetup, project_step
    preset = get_preset("llama-3.2-1b")
    for G, R in ((8, 1), (4, 2)):
        off = project_step(StepSetup(preset, G, R, max_split=1), H200, "dmuon")
        same = project_step(StepSetup(preset, G, R, max_split=1, ns_overlap=False), H200, "dmuon")
        assert same.step == off.step and same.ns_hidden == 0.0
        on = project_step(StepSetup(preset, G, R, max_split=1, ns_overlap=True), H200, "dmuon")
        assert 0 < on.ns_hidden <= off.ns.seconds
        assert on.step == pytest.approx(off.step - on.ns_hidden)
        assert (on.forward, on.backward) == (off.forward, off.backward)
    # the fitted shares never rise with either key (a busier backward leaves no more idle GPU)
    for _, pts in H200.ns_overlap_idle:
        shares = [y for _, y in sorted(pts)]
        assert shares == sorted(shares, reverse=True) and shares[0] > shares[-1], pts
    with pytest.raises(ValueError, match="max_split=1"):
        project_step(StepSetup(preset, 8, 1, max_split=8, ns_overlap=True), H200, "dmuon")
