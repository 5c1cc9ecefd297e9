"""Projected step per collective style, with and without NS overlapped with the backward, and
the exposed forward gather against FSDP2's all-gather (issues 35 and 47).

Usage: ``python benchmarks/collective_projection.py [--grid styles|gather|all] [--out PATH]
[--machine h200]`` (``--out`` with one grid; ``all``, the default, writes both default files).

``--grid styles`` (``results/collective_style_projection.json``): Llama-3.1-8B and Llama-3.1-70B
on 8, 64, 512 and 1024 GPUs, mesh ``G = min(64, N)``, ``R = N / G`` (the README's projection
grid), and a second mesh with the shard group inside a node (``G = 8``, ``R = N / 8``) for 64, 512
and 1024 GPUs; Mixtral-8x7B (24 expert matrices per layer) at ``G = 8`` on 8, 64 and 512 GPUs, the
case where the per-bucket style pays. Micro-batch 1 x 4096 tokens per GPU (global batch ``N x
4096`` tokens); FSDP2 and dmuon Z3, fp32 gradient reduction, whole-matrix NS (``max_split=1``).
Per row: FSDP2 + AdamW, then dmuon with ``collectives="per_owner"``, ``"per_bucket"``,
``"grouped"`` and ``"auto"``: step, overhead over AdamW, exposed communication per lane, the
dedicated shard-axis launches per step, the GB a rank sends in them and which style ``auto``
chose per hook group; and under ``ns_overlap`` the same style with the owners' NS overlapped
with the backward (:mod:`dmuon.tools.ns_overlap`), once per idle-share key
(``"layer_backward_s"``: the machine's default; ``"tokens"``: the optimistic one): step,
overhead and the owners' phase hidden.

``--grid gather`` (``results/grouped_gather_projection.json``): every preset of
:mod:`dmuon.tools.presets` on 8 and 64 GPUs (``G = N``, ``R = 1``), micro-batch 1 at sequence
1024 and 4096; the same settings. Per style: ``exposed_gather_ms`` (what the compute waits for
gathers, forward and Z3 backward: dmuon's ``"unshard"`` lane plus FSDP2's all-gathers of the
params it still manages; for FSDP2 + AdamW its ``"fsdp_all_gather"``), ``gather_vs_fsdp2``
(their ratio), ``forward_gather_link_ms`` (the shard link's busy time for gathers in the
forward, hidden or not), step, overhead, launches, GB sent and ``auto``'s choice.

Each file: :func:`bench_util.run_header` (date, machine run on, python, torch), the setup, the
machine model's constants with their sources, every row.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench_util import run_header  # noqa: E402
from dmuon.tools.machine import MACHINES, Machine  # noqa: E402
from dmuon.tools.presets import PRESETS, get_preset  # noqa: E402
from dmuon.tools.projection import StepProjection, StepSetup, project_step  # noqa: E402
from dmuon.tools.projection_report import machine_summary  # noqa: E402

log = logging.getLogger("collective_projection")

STYLES = ("per_owner", "per_bucket", "grouped", "sharded", "sharded_behind_ns", "auto")
#: a style label's StepSetup fields ("sharded_behind_ns": projected only, see StepSetup)
STYLE_SETUP = {"sharded_behind_ns": {"collectives": "sharded", "sharded_refresh": "behind_ns"}}
OVERLAP_KEYS = ("layer_backward_s", "tokens")
STYLE_GRID = [(m, n, min(64, n)) for m in ("llama-3.1-8b", "llama-3.1-70b")
              for n in (8, 64, 512, 1024)]
STYLE_GRID += [(m, n, 8) for m in ("llama-3.1-8b", "llama-3.1-70b") for n in (64, 512, 1024)]
STYLE_GRID += [("mixtral-8x7b", n, 8) for n in (8, 64, 512)]
GATHER_LANES = ("unshard", "fsdp_all_gather")
GATHER_GPUS = (8, 64)
GATHER_SEQS = (1024, 4096)
SETTINGS = {"fsdp": "Z3", "dmuon": "Z3", "reduce_dtype": "fp32", "max_split": 1,
            "styles": list(STYLES)}


def _common(p: StepProjection, base: StepProjection) -> dict:
    return {"step_ms": p.step * 1e3, "overhead_vs_adamw": p.step / base.step - 1.0,
            "exposed_ms": {k: v * 1e3 for k, v in p.exposed.items() if v},
            "dedicated_shard_collectives": sum(1 for o in p.timeline
                                               if o.lane in ("unshard", "reduce")),
            "dedicated_shard_gb_sent_per_rank": p.shard_bytes_per_rank / 1e9,
            "hook_groups_per_style": dict(p.collective_styles)}


def _style_row(model: str, n: int, g: int, machine: Machine) -> dict:
    setup = StepSetup(get_preset(model), g, n // g, micro_batch=1, seq=4096, max_split=1)
    base = project_step(setup, machine, "adamw")
    row = {"model": model, "gpus": n, "shard": g, "replicate": n // g,
           "global_batch_tokens": setup.global_batch_tokens,
           "adamw": {"step_ms": base.step * 1e3,
                     "exposed_ms": {k: v * 1e3 for k, v in base.exposed.items() if v},
                     "exposed_total_ms": sum(base.exposed.values()) * 1e3}}
    for style in STYLES:
        st = dataclasses.replace(setup, **STYLE_SETUP.get(style, {"collectives": style}))
        p = project_step(st, machine, "dmuon")
        d = {**_common(p, base), "forward_ms": p.forward * 1e3, "backward_ms": p.backward * 1e3,
             "optimizer_ms": p.optimizer * 1e3, "owners_phase_ms": p.ns.seconds * 1e3,
             "exposed_dmuon_ms": sum(v for k, v in p.exposed.items()
                                     if k in ("unshard", "reduce", "replicate")) * 1e3,
             "exposed_total_ms": sum(p.exposed.values()) * 1e3, "ns_overlap": {}}
        for key in OVERLAP_KEYS:
            q = project_step(dataclasses.replace(st, ns_overlap=True),
                             dataclasses.replace(machine, ns_overlap_key=key), "dmuon")
            d["ns_overlap"][key] = {"step_ms": q.step * 1e3,
                                    "overhead_vs_adamw": q.step / base.step - 1.0,
                                    "optimizer_ms": q.optimizer * 1e3,
                                    "owners_phase_hidden_ms": q.ns_hidden * 1e3,
                                    "hook_groups_per_style": dict(q.collective_styles)}
        row[style] = d
    log.info("%-14s %5d GPUs G=%-3d adamw %8.1f ms | " + " | ".join(
        f"{s} %+7.2f %% (overlap %+7.2f / %+7.2f)" for s in STYLES) + " | auto %s",
        model, n, g, base.step * 1e3,
        *[v for s in STYLES for v in (row[s]["overhead_vs_adamw"] * 100,
                                      *(row[s]["ns_overlap"][k]["overhead_vs_adamw"] * 100
                                        for k in OVERLAP_KEYS))],
        row["auto"]["hook_groups_per_style"])
    return row


def _gather(p: StepProjection) -> dict:
    link = sum(o.end - o.start for o in p.timeline
               if o.lane in GATHER_LANES and o.phase == "forward")
    return {"exposed_gather_ms": sum(p.exposed.get(k, 0.0) for k in GATHER_LANES) * 1e3,
            "forward_gather_link_ms": link * 1e3}


def _gather_row(model: str, n: int, seq: int, machine: Machine) -> dict:
    setup = StepSetup(get_preset(model), n, 1, micro_batch=1, seq=seq, max_split=1)
    base = project_step(setup, machine, "adamw")
    bg = _gather(base)
    row = {"model": model, "gpus": n, "shard": n, "replicate": 1, "seq": seq,
           "adamw": {**bg, "step_ms": base.step * 1e3}}
    for style in STYLES:
        p = project_step(dataclasses.replace(setup, **STYLE_SETUP.get(style, {
            "collectives": style})), machine, "dmuon")
        g, ref = _gather(p), bg["exposed_gather_ms"]
        c = _common(p, base)
        c["dedicated_shard_launches"] = c.pop("dedicated_shard_collectives")
        row[style] = {**g, "gather_vs_fsdp2": g["exposed_gather_ms"] / ref if ref > 0 else None,
                      **c}
    log.info("%-14s %3d GPUs seq %4d | FSDP2 gather exposed %6.2f ms | " +
             " | ".join(f"{s} %6.2f ms (x%.2f) %+6.2f %%" for s in STYLES) + " | auto %s",
             model, n, seq, bg["exposed_gather_ms"],
             *[v for s in STYLES for v in (row[s]["exposed_gather_ms"],
                                           row[s]["gather_vs_fsdp2"] or 0.0,
                                           row[s]["overhead_vs_adamw"] * 100)],
             row["auto"]["hook_groups_per_style"])
    return row


def run_grid(grid: str, machine: Machine) -> dict:
    """The results document of one grid (module docstring)."""
    t0 = time.perf_counter()
    if grid == "styles":
        rows = [_style_row(m, n, g, machine) for m, n, g in STYLE_GRID]
        setup = {"micro_batch": 1, "seq": 4096, "global_batch": "gpus x 4096 tokens",
                 **SETTINGS, "ns_overlap_keys": list(OVERLAP_KEYS)}
    else:
        rows = [_gather_row(m, n, s, machine) for m in PRESETS for n in GATHER_GPUS
                for s in GATHER_SEQS]
        setup = {"micro_batch": 1, "seqs": list(GATHER_SEQS), "gpus": list(GATHER_GPUS),
                 "mesh": "G = gpus, R = 1", **SETTINGS}
    return {**run_header(), "seconds": round(time.perf_counter() - t0, 1), "setup": setup,
            "machine_model": machine_summary(machine), "rows": rows}


DEFAULT_OUT = {"styles": "collective_style_projection.json",
               "gather": "grouped_gather_projection.json"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", choices=("styles", "gather", "all"), default="all")
    ap.add_argument("--out", help="output JSON (one grid only; default results/<grid's file>)")
    ap.add_argument("--machine", choices=sorted(MACHINES), default="h200")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    grids = ("styles", "gather") if args.grid == "all" else (args.grid,)
    if args.out and len(grids) > 1:
        ap.error("--out names one file: pass --grid styles or --grid gather with it")
    for grid in grids:
        out = args.out or os.path.join(HERE, "results", DEFAULT_OUT[grid])
        doc = run_grid(grid, MACHINES[args.machine])
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
        log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
