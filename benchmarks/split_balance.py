"""Balance of the owner plan that the optimizer executes with split Newton–Schulz.

Usage: ``python benchmarks/split_balance.py [--out results/split_balance.json]``

For each case, the plan ``dedicate_params(..., split_ns=k)`` builds (``plan_owners(specs, G, R,
max_split=k)``, node size 8: the same call) and, from it, what every rank executes
(:func:`dmuon.functional.split_plan.runtime_owners`: a split matrix lives whole on its block 0's
rank, which scatters the NS input and gathers the result): per-rank plan cost (NS flops + bytes
held + the split's communication, :func:`dmuon.functional.split_plan.split_unit_cost`) and per-rank
NS flops alone, and the projector's owners' phase of that plan on H200s
(:func:`dmuon.tools.ns_phase.ns_phase`, the scatter / gather included). Writes JSON ``{"date", "python", "torch", "cases": [{model, G, R, max_split,
max_over_mean, ns_flops_max_over_mean, split_units, k, planning_seconds, target, meets_target}]}``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import time

import torch

from dmuon.functional.plan import plan_owners
from dmuon.functional.split_plan import runtime_owners
from dmuon.tools.machine import H200
from dmuon.tools.ns_phase import ns_phase
from dmuon.tools.presets import preset_specs

log = logging.getLogger("split_balance")

#: (model, G, R, max_split, target max/mean or None); issue 35: 70B on 64x8 <= 1.2 executed
CASES = (("llama-3.1-70b", 64, 8, 1, None), ("llama-3.1-70b", 64, 8, 8, 1.2),
         ("llama-3.1-70b", 64, 16, 1, None), ("llama-3.1-70b", 64, 16, 8, None),
         ("llama-3.1-405b", 64, 16, 1, None), ("llama-3.1-405b", 64, 16, 8, None))


def run_case(model: str, g: int, r: int, max_split: int, target) -> dict:
    specs = preset_specs(model)
    t0 = time.perf_counter()
    plan = plan_owners(specs, g, r, max_split=max_split)
    secs = time.perf_counter() - t0
    owners = runtime_owners(plan)            # what dedicate_params places: every matrix whole
    assert sorted(owners) == sorted(s.name for s in specs if s.route == "muon")
    flops = [0] * plan.num_slots
    for u, slot in zip(plan.units, plan.unit_slots):
        flops[slot] += u.flops
    mean = sum(flops) / len(flops)
    phase = ns_phase(plan, specs, H200)      # the projector's owners' phase of this plan, as executed
    return {"projected_ns_phase_ms": phase.seconds * 1e3, "projected_ns_max_over_mean": phase.imbalance,
            "model": model, "G": g, "R": r, "max_split": max_split,
            "max_over_mean": plan.imbalance, "ns_flops_max_over_mean": max(flops) / mean,
            "split_units": len(plan.splits), "k": sorted({sp.k for sp in plan.splits}),
            "planning_seconds": secs, "target": target,
            "meets_target": None if target is None else plan.imbalance <= target,
            "fingerprint": plan.fingerprint}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "split_balance.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cases = [run_case(*c) for c in CASES]
    for c in cases:
        log.info("%-15s %3dx%-3d split<=%d  max/mean %.3f  NS flops max/mean %.3f  %d split (k %s)"
                 "  %.2f s  projected owners' phase %.1f ms (max/mean %.2f)", c["model"], c["G"],
                 c["R"], c["max_split"], c["max_over_mean"], c["ns_flops_max_over_mean"],
                 c["split_units"], c["k"], c["planning_seconds"], c["projected_ns_phase_ms"],
                 c["projected_ns_max_over_mean"])
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "python": platform.python_version(), "torch": torch.__version__, "cases": cases}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
