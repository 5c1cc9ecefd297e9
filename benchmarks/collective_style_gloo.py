"""Measured on CPU gloo: one hook group's gather and reduce, per owner against per bucket.

Usage: ``python benchmarks/collective_style_gloo.py [--ranks 4] [--iters 100] [--out
results/collective_style_gloo.json]``

Four groups of ``ranks`` matrices (fp32) moved through the runtime's executor
(:func:`dmuon.stateful.runtime.executor.mesh_executor`) on ``ranks`` gloo processes: ``small``
(one 32 x 32 matrix per column: latency-bound), ``large`` (one 512 x 512 per column: balanced
parts), ``unbalanced`` (one 512 x 512 on column 0, 32 x 32 elsewhere: padding-bound) and
``one_owner`` (a single 512 x 512 matrix: the other parts are all padding). Per group and style:
the median wall time of the unshard (``launch(...).wait()``) and of the reduce over ``iters``
runs, the collectives and the bytes the executor counted per rank (``op_bytes``), and what
``"auto"``'s default cost model chooses. A CPU gloo run measures host-side latency and memory
copies, not a GPU interconnect: it tests the direction of the cost model's choice, not the H200
numbers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dmuon.launch import run_local_ranks  # noqa: E402

log = logging.getLogger("collective_style_gloo")

CASES = {"small": lambda s: (32, 32), "large": lambda s: (512, 512),
         "unbalanced": lambda s: (512, 512) if s == 0 else (32, 32)}


def _shapes(case: str, G: int) -> tuple[dict, dict]:
    if case == "one_owner":
        return {"layers.0.m0": (0, 0)}, {"layers.0.m0": (512, 512)}
    owners = {f"layers.0.m{s}": (s, 0) for s in range(G)}
    return owners, {n: CASES[case](o[0]) for n, o in owners.items()}


def _worker(rank: int, world: int, iters: int) -> dict:
    import torch.distributed as dist

    from dmuon.functional.program import step_program
    from dmuon.functional.simulate import zeros_like_layout
    from dmuon.stateful.runtime.executor import mesh_executor

    ex = mesh_executor(world)
    out: dict = {}
    for case in ("small", "large", "unbalanced", "one_owner"):
        owners, shapes = _shapes(case, world)
        dts = {n: "torch.float32" for n in owners}
        row = {}
        for style in ("per_owner", "per_bucket", "auto"):
            prog = step_program(owners, shapes, dts, shard_size=world, collectives=style,
                                reshard_after_forward=False)
            g = prog.groups["layers.0"]
            ub = zeros_like_layout(prog.unshard_layout, 1)[0]
            rb = zeros_like_layout(prog.reduce_layout, 1)[0]
            for b in rb.values():
                b.fill_(1.0)
            times: dict = {"unshard": [], "reduce": []}
            for i in range(iters + 5):
                for phase, sched, bufs in (("unshard", g.unshard, ub), ("reduce", g.reduce, rb)):
                    dist.barrier()
                    t = time.perf_counter()
                    ex.launch(sched, bufs).wait()
                    if i >= 5:
                        times[phase].append(time.perf_counter() - t)
            ex.reset_counters()
            ex.launch(g.unshard, ub).wait()
            ex.launch(g.reduce, rb).wait()
            c = ex.counters()
            row[style] = {"style": g.collectives, "reason": g.collectives_reason,
                          "unshard_us": statistics.median(times["unshard"]) * 1e6,
                          "reduce_us": statistics.median(times["reduce"]) * 1e6,
                          "counters": {k: c[k] for k in ("unshard", "reduce")}}
        out[case] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "collective_style_gloo.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results, errors = run_local_ranks(_worker, args.ranks, (args.iters,), {}, backend="gloo",
                                      timeout_s=120.0, grace_s=5.0, deadline_s=600.0)
    if errors:
        log.error("failed: %s", errors)
        return 1
    r0 = results[0]
    for case, row in r0.items():
        log.info("%-10s " + " | ".join(
            f"{st}: unshard {row[st]['unshard_us']:7.0f} us, reduce {row[st]['reduce_us']:7.0f} us"
            f" ({row[st]['counters']['unshard']['collectives']} + "
            f"{row[st]['counters']['reduce']['collectives']} coll, "
            f"{row[st]['counters']['unshard']['sent_bytes'] + row[st]['counters']['reduce']['sent_bytes']} B)"
            for st in ("per_owner", "per_bucket")) + f" | auto -> {row['auto']['style']}", case)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine_run_on": {"platform": platform.platform(),
                              "processor": platform.processor() or platform.machine(),
                              "cpus": os.cpu_count()},
           "python": sys.version.split()[0], "torch": torch.__version__,
           "ranks": args.ranks, "iters": args.iters,
           "note": "CPU gloo, 2-core machine shared with other work: host latency and copies, "
                   "not a GPU interconnect; rank 0's medians",
           "cases": r0, "per_rank": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
