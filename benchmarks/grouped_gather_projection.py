"""Projected forward gather of dmuon per collective style against FSDP2's all-gather (issue 47).

Usage: ``python benchmarks/grouped_gather_projection.py [--out
results/grouped_gather_projection.json] [--machine h200]``

Grid: every preset of :mod:`dmuon.tools.presets` on 8 and 64 GPUs (mesh ``G = N``, ``R = 1``),
micro-batch 1 at sequence 1024 and 4096 tokens; FSDP2 and dmuon Z3, fp32 gradient reduction,
whole-matrix NS (``max_split=1``). For each row: FSDP2 + AdamW, then dmuon with
``collectives="per_owner"``, ``"per_bucket"``, ``"grouped"`` and ``"auto"``. Reported per style:

* ``exposed_gather_ms``: what the compute waits for gathers in the step (forward and Z3 backward):
  dmuon's own lane (``"unshard"``) plus FSDP2's all-gathers of the params it still manages; FSDP2 +
  AdamW's is its ``"fsdp_all_gather"`` exposure; ``gather_vs_fsdp2`` is their ratio;
* ``forward_gather_link_ms``: the shard link's busy time for gathers in the forward (dmuon's
  broadcasts / all-gathers and FSDP2's all-gathers; FSDP2 + AdamW: its all-gathers) — the
  unhidden and hidden time together;
* step, overhead over FSDP2 + AdamW, dmuon's shard-axis launches per step, the GB a rank sends
  in them (``StepProjection.shard_bytes_per_rank``: padding included) and, for ``auto``, the
  style chosen per hook group.

Writes JSON with date, machine, torch version, the machine constants and every row.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dmuon.tools.machine import MACHINES  # noqa: E402
from dmuon.tools.presets import PRESETS, get_preset  # noqa: E402
from dmuon.tools.projection import StepProjection, StepSetup, project_step  # noqa: E402
from dmuon.tools.projection_report import machine_summary  # noqa: E402

log = logging.getLogger("grouped_gather_projection")

STYLES = ("per_owner", "per_bucket", "grouped", "auto")
GATHER_LANES = ("unshard", "fsdp_all_gather")
GPUS = (8, 64)
SEQS = (1024, 4096)


def _gather(p: StepProjection) -> dict:
    link = sum(o.end - o.start for o in p.timeline
               if o.lane in GATHER_LANES and o.phase == "forward")
    return {"exposed_gather_ms": sum(p.exposed.get(k, 0.0) for k in GATHER_LANES) * 1e3,
            "forward_gather_link_ms": link * 1e3}


def _design(p: StepProjection, base: StepProjection, base_gather: dict) -> dict:
    g = _gather(p)
    ref = base_gather["exposed_gather_ms"]
    return {**g, "gather_vs_fsdp2": g["exposed_gather_ms"] / ref if ref > 0 else None,
            "step_ms": p.step * 1e3, "overhead_vs_adamw": p.step / base.step - 1.0,
            "exposed_ms": {k: v * 1e3 for k, v in p.exposed.items() if v},
            "dedicated_shard_launches": sum(1 for o in p.timeline
                                            if o.lane in ("unshard", "reduce")),
            "dedicated_shard_gb_sent_per_rank": p.shard_bytes_per_rank / 1e9,
            "hook_groups_per_style": dict(p.collective_styles)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results",
                                                  "grouped_gather_projection.json"))
    ap.add_argument("--machine", choices=sorted(MACHINES), default="h200")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    machine = MACHINES[args.machine]
    rows = []
    t0 = time.perf_counter()
    for model in PRESETS:
        for n in GPUS:
            for seq in SEQS:
                kw = dict(micro_batch=1, seq=seq, max_split=1)
                base = project_step(StepSetup(get_preset(model), n, 1, **kw), machine, "adamw")
                bg = _gather(base)
                row = {"model": model, "gpus": n, "shard": n, "replicate": 1, "seq": seq,
                       "adamw": {**bg, "step_ms": base.step * 1e3}}
                for style in STYLES:
                    st = StepSetup(get_preset(model), n, 1, collectives=style, **kw)
                    row[style] = _design(project_step(st, machine, "dmuon"), base, bg)
                rows.append(row)
                log.info("%-14s %3d GPUs seq %4d | FSDP2 gather exposed %6.2f ms | " +
                         " | ".join(f"{s} %6.2f ms (x%.2f) %+6.2f %%" for s in STYLES) +
                         " | auto %s", model, n, seq, bg["exposed_gather_ms"],
                         *[v for s in STYLES for v in (row[s]["exposed_gather_ms"],
                                                       row[s]["gather_vs_fsdp2"] or 0.0,
                                                       row[s]["overhead_vs_adamw"] * 100)],
                         row["auto"]["hook_groups_per_style"])
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine_run_on": {"platform": platform.platform(),
                              "processor": platform.processor() or platform.machine()},
           "python": sys.version.split()[0], "torch": torch.__version__,
           "seconds": round(time.perf_counter() - t0, 1),
           "setup": {"micro_batch": 1, "seqs": list(SEQS), "gpus": list(GPUS),
                     "mesh": "G = gpus, R = 1", "fsdp": "Z3", "dmuon": "Z3",
                     "reduce_dtype": "fp32", "max_split": 1, "styles": list(STYLES)},
           "machine_model": machine_summary(machine), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
