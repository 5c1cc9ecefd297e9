"""Projected step with one collective per owner bucket against one per hook group (issue 35).

Usage: ``python benchmarks/collective_style_projection.py [--out
results/collective_style_projection.json] [--machine h200]``

Grid: Llama-3.1-8B and Llama-3.1-70B on 8, 64, 512 and 1024 GPUs, mesh ``G = min(64, N)``, ``R =
N / G`` (the README's projection grid), and a second mesh with the shard group inside a node
(``G = 8``, ``R = N / 8``) for 64, 512 and 1024 GPUs; micro-batch 1 x 4096 tokens per GPU, so the
global batch is ``N x 4096`` tokens; FSDP2 and dmuon Z3, fp32 gradient reduction, whole-matrix NS
(``max_split=1``). For each row: FSDP2 + AdamW, then dmuon with ``collectives="per_owner"``
(one broadcast / reduce per owner bucket), ``"per_bucket"`` (one all-gather / reduce-scatter of
``G`` padded parts per layer) and ``"auto"`` (per layer, the cheaper by the machine's collective
times): step, overhead over AdamW, exposed communication per lane, the dedicated shard-axis
collectives per step and which style ``auto`` chose. Mixtral-8x7B (24 expert matrices per layer)
is added at ``G = 8`` as the case where the per-bucket style pays.

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

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dmuon.tools.machine import MACHINES  # noqa: E402
from dmuon.tools.presets import get_preset  # noqa: E402
from dmuon.tools.projection import StepProjection, StepSetup, project_step  # noqa: E402
from dmuon.tools.projection_report import machine_summary  # noqa: E402

log = logging.getLogger("collective_style_projection")

STYLES = ("per_owner", "per_bucket", "auto")
GRID = [(m, n, min(64, n)) for m in ("llama-3.1-8b", "llama-3.1-70b") for n in (8, 64, 512, 1024)]
GRID += [(m, n, 8) for m in ("llama-3.1-8b", "llama-3.1-70b") for n in (64, 512, 1024)]
GRID += [("mixtral-8x7b", n, 8) for n in (8, 64, 512)]


def _design(p: StepProjection, base: StepProjection) -> dict:
    return {"step_ms": p.step * 1e3, "overhead_vs_adamw": p.step / base.step - 1.0,
            "forward_ms": p.forward * 1e3, "backward_ms": p.backward * 1e3,
            "optimizer_ms": p.optimizer * 1e3,
            "exposed_ms": {k: v * 1e3 for k, v in p.exposed.items() if v},
            "exposed_dmuon_ms": sum(v for k, v in p.exposed.items()
                                    if k in ("unshard", "reduce", "replicate")) * 1e3,
            "exposed_total_ms": sum(p.exposed.values()) * 1e3,
            "dedicated_shard_collectives": sum(1 for o in p.timeline
                                               if o.lane in ("unshard", "reduce")),
            "dedicated_shard_gb_sent_per_rank": p.shard_bytes_per_rank / 1e9,
            "hook_groups_per_style": dict(p.collective_styles)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results",
                                                  "collective_style_projection.json"))
    ap.add_argument("--machine", choices=sorted(MACHINES), default="h200")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    machine = MACHINES[args.machine]
    rows = []
    for model, n, g in GRID:
        setup = StepSetup(get_preset(model), g, n // g, micro_batch=1, seq=4096, max_split=1)
        base = project_step(setup, machine, "adamw")
        row = {"model": model, "gpus": n, "shard": g, "replicate": n // g,
               "global_batch_tokens": setup.global_batch_tokens,
               "adamw": {"step_ms": base.step * 1e3,
                         "exposed_ms": {k: v * 1e3 for k, v in base.exposed.items() if v},
                         "exposed_total_ms": sum(base.exposed.values()) * 1e3}}
        for style in STYLES:
            st = StepSetup(get_preset(model), g, n // g, micro_batch=1, seq=4096, max_split=1,
                           collectives=style)
            row[style] = _design(project_step(st, machine, "dmuon"), base)
        rows.append(row)
        log.info("%-14s %5d GPUs G=%-3d adamw %8.1f ms | per_owner %+7.2f %% (exposed dmuon %6.1f "
                 "ms, %4d coll) | per_bucket %+8.2f %% (%7.1f ms, %3d) | auto %+7.2f %% %s",
                 model, n, g, base.step * 1e3, row["per_owner"]["overhead_vs_adamw"] * 100,
                 row["per_owner"]["exposed_dmuon_ms"],
                 row["per_owner"]["dedicated_shard_collectives"],
                 row["per_bucket"]["overhead_vs_adamw"] * 100,
                 row["per_bucket"]["exposed_dmuon_ms"],
                 row["per_bucket"]["dedicated_shard_collectives"],
                 row["auto"]["overhead_vs_adamw"] * 100, row["auto"]["hook_groups_per_style"])
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine_run_on": {"platform": platform.platform(),
                              "processor": platform.processor() or platform.machine()},
           "python": sys.version.split()[0], "torch": torch.__version__,
           "setup": {"micro_batch": 1, "seq": 4096, "global_batch": "gpus x 4096 tokens",
                     "fsdp": "Z3", "dmuon": "Z3", "reduce_dtype": "fp32", "max_split": 1},
           "machine_model": machine_summary(machine), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
