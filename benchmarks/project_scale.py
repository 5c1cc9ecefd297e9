"""Projected step time at 8 - 1024 GPUs: FSDP2 + AdamW against FSDP2 + dmuon (whole and split NS).

Usage: ``python benchmarks/project_scale.py [--out results/projection_scale.json]
[--png-dir results] [--machine h200]``

Grid: Llama-3.1-8B, Llama-3.1-70B, Llama-3.1-405B and Mixtral-8x7B (MoE) on 8, 64, 512 and 1024
GPUs; mesh ``G = min(64, N)`` (shard over up to 8 nodes of 8), ``R = N / G``; micro-batch 1 x
4096 tokens per GPU (global batch ``N x 4096`` tokens); FSDP2 and dmuon both Z3, fp32 gradient
reduction (the README's recipe). Designs: ``adamw``; ``dmuon`` (whole matrices,
``max_split=1``); ``dmuon_split`` (``max_split=8``, kept only where it shortens the projected
step). A second pass repeats the AdamW and whole-matrix rows with the IB per-hop latency that the
reference's 128 x A800 Llama-8B rows imply (``results/projection_validation.json``), as a
sensitivity check, and Llama-3.1-8B / Mixtral on 512 and 1024 GPUs with ``G = 8`` (shard groups
inside a node) under both latencies. Timeline PNGs for the 512-GPU rows go to ``--png-dir``.

Writes JSON with date, machine, torch version, the machine constants and every row.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dmuon.tools.machine import MACHINES  # noqa: E402
from dmuon.tools.presets import get_preset  # noqa: E402
from dmuon.tools.projection import StepSetup, project_step  # noqa: E402
from dmuon.tools.projection_report import machine_summary, projection_summary  # noqa: E402
from dmuon.tools.projection_plot import write_timeline_png  # noqa: E402

MODELS = ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "mixtral-8x7b")
GPUS = (8, 64, 512, 1024)


def _setup(model: str, n: int, max_split: int) -> StepSetup:
    g = min(64, n)
    return StepSetup(get_preset(model), g, n // g, micro_batch=1, seq=4096, max_split=max_split)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "projection_scale.json"))
    ap.add_argument("--png-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--machine", choices=sorted(MACHINES), default="h200")
    args = ap.parse_args()
    machine = MACHINES[args.machine]
    with open(os.path.join(HERE, "results", "projection_validation.json")) as f:
        hop = next(r["implied_ib_alpha_hop_s"] for r in json.load(f)["a800"]["a800_128"]
                   if r["model"] == "llama-3.1-8b")
    slow_ib = machine.with_values(ib_alpha_hop=hop)
    rows, sens = [], []
    for model in MODELS:
        for n in GPUS:
            whole, split = _setup(model, n, 1), _setup(model, n, 8)
            a = project_step(whole, machine, "adamw")
            d = project_step(whole, machine, "dmuon")
            s = dataclasses.replace(project_step(split, machine, "dmuon"), design="dmuon_split")
            summ = projection_summary(split, machine, [a, d, s])
            rows.append(summ)
            print(f"{model:>15} {n:>5} GPUs: adamw {a.step * 1e3:9.1f} ms, dmuon "
                  f"{(d.step / a.step - 1) * 100:+6.2f} %, split {(s.step / a.step - 1) * 100:+6.2f} % "
                  f"(owners {d.ns.seconds * 1e3:.1f} -> {s.ns.seconds * 1e3:.1f} ms, "
                  f"NS max/mean {d.ns.imbalance:.2f} -> {s.ns.imbalance:.2f})", flush=True)
            if n == 512:
                write_timeline_png(os.path.join(args.png_dir, f"timeline_{model}_{n}.png"),
                                   [a, d, s], title=f"{model} {n} {machine.name} ({whole.shard}X"
                                                    f"{whole.replicate})")
            a2, d2 = (project_step(whole, slow_ib, x) for x in ("adamw", "dmuon"))
            sens.append({"model": model, "gpus": n, "ib_alpha_hop_s": hop,
                         "adamw_step_ms": a2.step * 1e3, "dmuon_step_ms": d2.step * 1e3,
                         "overhead_vs_adamw": d2.step / a2.step - 1.0})
    intra = []          # shard groups inside one node (G = 8): the shard-axis collectives use NVLink only
    for model in ("llama-3.1-8b", "mixtral-8x7b"):
        for n in (512, 1024):
            st = StepSetup(get_preset(model), 8, n // 8, micro_batch=1, seq=4096, max_split=1)
            for label, m in (("default", machine), ("implied_ib_alpha_hop", slow_ib)):
                a, d = (project_step(st, m, x) for x in ("adamw", "dmuon"))
                intra.append({"model": model, "gpus": n, "shard": 8, "replicate": n // 8, "ib": label,
                              "adamw_step_ms": a.step * 1e3, "dmuon_step_ms": d.step * 1e3,
                              "overhead_vs_adamw": d.step / a.step - 1.0,
                              "model_state_gb_adamw": a.memory_bytes / 1e9,
                              "model_state_gb_dmuon": d.memory_bytes / 1e9})
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine_run_on": {"platform": platform.platform(),
                              "processor": platform.processor() or platform.machine()},
           "python": sys.version.split()[0], "torch": torch.__version__,
           "machine_model": machine_summary(machine), "rows": rows,
           "sensitivity_ib_alpha_hop": sens, "shard_in_node": intra}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
