"""The measured rows each machine model was calibrated on, projected again with the constants in
use: what ``dmuon project`` prints under "calibration" (measured / projected / error).

The constants of :mod:`dmuon.tools.machine` were fitted on FSDP2 + AdamW step times only
(``benchmarks/validate_projection.py``; every dmuon row there is a prediction):

* H200: the world-1 AdamW row of ``benchmarks/results/step_world1_h200.json`` (HF Llama 1.1B-ish,
  micro-batch 4 x 2048, fp32 reduce): forward + backward and optimizer.
* A800: the reference implementation's four published 8 x A800 FSDP2 + AdamW rows (issue 25; bf16,
  seq 2048, micro-batch 2, FSDP2 Z3, bf16 reduce): forward, backward, optimizer and total.

A ``--set`` override that moves a fitted constant shows here as a calibration error.

:func:`fit_idle_points` derives the idle shares of NS overlapped with the backward
(:attr:`~dmuon.tools.machine.Machine.ns_overlap_idle`) from the issue-47 measurements.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from dmuon.tools.machine import Machine
from dmuon.tools.ns_overlap import MEASURED
from dmuon.tools.presets import ModelPreset, get_preset
from dmuon.tools.projection import StepSetup, project_step

__all__ = ["calibration_rows", "calibration_table", "fit_idle_points", "H200_ROWS", "A800_ROWS"]

#: ``step_world1_h200.json``: its config and AdamW row (fwd_bwd_ms, opt_ms, step_ms).
H200_W1 = ModelPreset("w1-1.1b", hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
                      vocab=32000)
H200_ROWS = {"step_world1_h200.json AdamW (W=1, 4 x 2048)":
             {"fwd_bwd": 124.01664352416992, "optimizer": 9.106783866882324,
              "step": 133.11286163330078}}
#: Issue 25: the reference's 8 x A800 FSDP2 + AdamW rows, forward / backward / optimizer / total ms.
A800_ROWS = {"qwen2.5-1.5b": (109.9, 200.5, 17.3, 327.6), "llama-3.2-3b": (197.5, 374.9, 26.5, 598.9),
             "qwen2.5-7b": (356.0, 698.8, 53.1, 1107.9), "llama-3.1-8b": (378.8, 753.4, 55.5, 1187.7)}


def _row(run: str, phase: str, measured: float, projected: float) -> dict[str, Any]:
    return {"run": run, "phase": phase, "measured_ms": measured, "projected_ms": projected,
            "error": projected / measured - 1.0}


def calibration_rows(machine: Machine) -> list[dict[str, Any]]:
    """The calibration rows of ``machine`` (by its name: ``"h200"`` or ``"a800"``; ``[]`` for
    another), each ``{run, phase, measured_ms, projected_ms, error}`` (``phase`` ``"step"`` is the
    whole step), projected with ``machine``'s constants as given."""
    out: list[dict[str, Any]] = []
    if machine.name.lower().startswith("h200"):
        setup = StepSetup(H200_W1, 1, 1, micro_batch=4, seq=2048, reduce_bytes=4)
        p = project_step(setup, machine, "adamw")
        for run, m in H200_ROWS.items():
            out += [_row(run, "fwd_bwd", m["fwd_bwd"], (p.forward + p.backward) * 1e3),
                    _row(run, "optimizer", m["optimizer"], p.optimizer * 1e3),
                    _row(run, "step", m["step"], p.step * 1e3)]
    elif machine.name.lower().startswith("a800"):
        for name, meas in A800_ROWS.items():
            preset = get_preset(name)
            if name == "llama-3.2-3b":  # the reference's benchmark builds it with an untied head
                preset = dataclasses.replace(preset, tie_embeddings=False)
            setup = StepSetup(preset, 8, 1, micro_batch=2, seq=2048, fsdp_reshard=True,
                              dmuon_reshard=False, reduce_bytes=2)
            p = project_step(setup, machine, "adamw")
            run = f"reference 8xA800 {name} AdamW"
            for phase, m, v in zip(("forward", "backward", "optimizer", "step"), meas,
                                   (p.forward, p.backward, p.optimizer, p.step)):
                out.append(_row(run, phase, m, v * 1e3))
    return out


def calibration_table(rows: list[dict[str, Any]]) -> str:
    """The rows as text (measured / projected ms and the error)."""
    if not rows:
        return "calibration: none recorded for this machine"
    lines = ["calibration (the measured rows the machine constants were fitted on, projected now):"]
    for r in rows:
        lines.append(f"  {r['run']:<48} {r['phase']:<9} {r['measured_ms']:9.1f} / "
                     f"{r['projected_ms']:9.1f} ms ({r['error'] * 100:+.1f} %)")
    return "\n".join(lines)


def _saved_share(machine: Machine, m: dict, idle: float) -> tuple[float, float]:
    """The share of the W=1 step ``m``'s setup saves with overlap on at a constant ``idle``, and
    one layer's projected backward seconds."""
    const = tuple((key, ((1.0, idle),)) for key, _ in machine.ns_overlap_idle)
    at = dataclasses.replace(machine, ns_overlap_idle=const)
    model = ModelPreset("w1-measured", **m["model"]) if "model" in m else H200_W1
    kw = dict(micro_batch=m["micro_batch"], seq=m["seq"], max_split=1)
    off = project_step(StepSetup(model, 1, 1, **kw), at, "dmuon")
    on = project_step(StepSetup(model, 1, 1, ns_overlap=True, **kw), at, "dmuon")
    layer = next(o for o in off.timeline if o.phase == "backward" and o.name.startswith("B L"))
    return 1.0 - on.step / off.step, layer.end - layer.start


def fit_idle_points(machine: Machine) -> dict[str, tuple[tuple[float, float], ...]]:
    """The idle shares that reproduce :data:`~dmuon.tools.ns_overlap.MEASURED` on ``machine``
    (the fit of :mod:`dmuon.tools.ns_overlap`): per measured setup, the idle share at which the
    projector's W=1 step with overlap saves the measured share, found by bisection in [0, 1]
    (clamped: a measured loss fits 0, the model's backward is never slowed). ``{key name: ((key,
    idle), ...)}`` for both keys, sorted by key. What
    :attr:`~dmuon.tools.machine.Machine.ns_overlap_idle` holds."""
    tok, lay = [], []
    for m in MEASURED:
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _saved_share(machine, m, mid)[0] < m["saved_share"] else (lo, mid)
        idle = round((lo + hi) / 2, 6)
        tok.append((float(m["micro_batch"] * m["seq"]), idle))
        lay.append((_saved_share(machine, m, idle)[1], idle))
    return {"tokens": tuple(sorted(tok)), "layer_backward_s": tuple(sorted(lay))}
