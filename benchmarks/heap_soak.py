"""Python-heap soak on CPU gloo: does a long training loop grow the interpreter's heap per step?

Usage: ``python benchmarks/heap_soak.py [--steps 1000] [--warmup 200] [--ranks 2] [--layers 2]
[--features clip,stats,eval,hsdp,z2] [--trace] [--out results/heap_soak_<date>.json]``

Trains the same small Llama-shaped model (embedding, ``layers`` blocks of three projections and an
RMSNorm, a head) on ``ranks`` gloo processes, twice: dmuon (``dedicate_params`` + FSDP2 +
``dmuon.Muon``) and plain FSDP2 + ``torch.optim.AdamW``, both with an ``LambdaLR`` schedule (a
float lr that changes every step). At heap points (after step 1, after ``warmup``, then at four
even steps up to ``steps``) each rank runs ``gc.collect()`` and reads ``sys.getallocatedblocks()``
(the allocator's live blocks) and ``len(gc.get_objects())`` (objects the collector tracks, with a
count per type). Reported per run and rank: blocks/step and gc objects/step from ``warmup`` to
``steps`` (the steady state) and from step 1 (a warm-up spread over the run), the points, and the
types whose count changed. ``--trace`` takes ``tracemalloc`` snapshots (rank 0) at ``warmup``, half
way and at the end and lists the tracebacks whose live blocks grew in both halves (and the largest
total growths); the trace slows the steps several-fold and adds its own blocks, so compare
blocks/step without it. Results: ``benchmarks/results/heap_soak_<date>.json`` (date, machine,
torch version).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import logging
import os
import platform
import sys
import tracemalloc
from typing import Any, Optional

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dmuon.launch import run_local_ranks  # noqa: E402

log = logging.getLogger("heap_soak")


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)
        self.mix = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.mix(self.down(torch.relu(self.up(h))))


class SoakModel(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           ids[:, 1:].reshape(-1))


def _is_matrix(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and name.startswith("layers.")


#: what a run can add to the plain loop (``--features``): ``hsdp`` (every rank a replica: R =
#: ranks, G = 1, the post-step publish), ``z2`` (no reshard after forward), ``clip`` (gradient
#: clipping each step), ``stats`` (``last_step_stats()`` read each step, dmuon only), ``eval`` (a
#: ``no_grad`` forward every 10 steps).
FEATURES = ("hsdp", "z2", "clip", "stats", "eval")


def build(kind: str, world: int, layers: int, features: tuple[str, ...] = ()
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of one run: ``kind`` is ``"dmuon"`` or ``"fsdp2"``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = SoakModel(layers=layers)
    z3 = "z2" not in features
    if "hsdp" in features:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    if kind == "dmuon":
        import dmuon
        dmuon.dedicate_params(model, mesh, _is_matrix, reshard_after_forward=z3)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=mesh, reshard_after_forward=z3)
    if kind == "dmuon":
        import dmuon
        return model, dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def heap_point(with_types: bool = False) -> tuple[int, int, Optional[dict[str, int]]]:
    """``(allocated blocks, gc-tracked objects, {type name: count} or None)`` after a full
    collection; both counts are read before the type counts are built."""
    gc.collect()
    blocks = sys.getallocatedblocks()
    objs = gc.get_objects()
    n = len(objs)
    types = dict(collections.Counter(type(o).__qualname__ for o in objs)) if with_types else None
    del objs
    return blocks, n, types


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int, rank: int,
          world: int, start: int = 0, features: tuple[str, ...] = ()) -> None:
    clip = None
    if "clip" in features:
        import dmuon
        clip = dmuon.clip_grad_norm_ if hasattr(opt, "last_step_stats") \
            else torch.nn.utils.clip_grad_norm_
    g = torch.Generator().manual_seed(1)
    for step in range(start, start + steps):
        ids = torch.randint(0, 32, (2 * world, 8), generator=g).chunk(world)[rank]
        opt.zero_grad()
        model(ids).backward()
        if clip is not None:
            clip(model, 1.0) if clip is not torch.nn.utils.clip_grad_norm_ \
                else clip(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if "stats" in features and hasattr(opt, "last_step_stats"):
            opt.last_step_stats()
        if "eval" in features and step % 10 == 0:
            with torch.no_grad():
                model(ids)


def type_growth(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """``{type name: count change}`` between two :func:`heap_point` type counts (changes only)."""
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)}


def growing_tracebacks(snaps: list, top: int) -> list[dict[str, Any]]:
    """The tracebacks whose live block count grew between every pair of consecutive ``snaps``
    (tracemalloc snapshots), largest total growth first: per-step growth, not a free list's
    reuse or the last step's temporaries."""
    flt = [tracemalloc.Filter(False, tracemalloc.__file__)]
    snaps = [s.filter_traces(flt) for s in snaps]
    halves = [{tuple(st.traceback): st for st in b.compare_to(a, "traceback")}
              for a, b in zip(snaps, snaps[1:])]
    rows = []
    for tb, st in halves[-1].items():
        diffs = [h[tb].count_diff if tb in h else 0 for h in halves]
        if all(d > 0 for d in diffs):
            rows.append({"count_diffs": diffs, "size_diff": sum(h[tb].size_diff for h in halves),
                         "traceback": [f"{f.filename}:{f.lineno}" for f in tb][-10:]})
    return sorted(rows, key=lambda r: -sum(r["count_diffs"]))[:top]


def soak_rank(rank: int, world: int, kind: str, steps: int, warmup: int, layers: int = 2,
              trace: bool = False, features: tuple[str, ...] = (), top: int = 15,
              intervals: int = 4) -> dict[str, Any]:
    """One rank's soak (run through :func:`dmuon.launch.run_local_ranks`).

    Heap points (``[step, blocks, gc objects]``) after step 1 (the first step's lazily made state
    exists), after ``warmup`` and at ``intervals`` even steps up to ``steps``. ``blocks_per_step``
    and ``gc_objects_per_step``: from ``warmup`` to ``steps``; ``*_since_first``: from step 1
    (what a soak that starts counting at the beginning sees: the warm-up spread over the steps).
    """
    model, opt = build(kind, world, layers, features)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 1e-3 * s))
    train(model, opt, sched, 1, rank, world, features=features)
    first = heap_point()
    train(model, opt, sched, warmup - 1, rank, world, start=1, features=features)
    if trace and rank == 0:
        tracemalloc.start(25)
    b0, n0, t0 = heap_point(with_types=True)
    own = sys.getallocatedblocks() - b0  # t0's own blocks, alive at every later point
    span = steps - warmup
    snaps = []
    points = [(1, first[0], first[1]), (warmup, b0, n0)]  # (step, blocks, gc objects)
    if tracemalloc.is_tracing():  # three points: what grows in both halves grows per step
        snaps.append(tracemalloc.take_snapshot())
        train(model, opt, sched, span // 2, rank, world, start=warmup, features=features)
        snaps.append(tracemalloc.take_snapshot())
        train(model, opt, sched, span - span // 2, rank, world, start=warmup + span // 2,
              features=features)
        snaps.append(tracemalloc.take_snapshot())
        tracemalloc.stop()
    else:  # even intervals: a bounded warm-up growth shows as increments that stop
        for k in range(intervals):
            a, b = warmup + span * k // intervals, warmup + span * (k + 1) // intervals
            train(model, opt, sched, b - a, rank, world, start=a, features=features)
            bk, nk, _ = heap_point()
            points.append((b, bk - own, nk))
    b1, n1, _ = heap_point()
    b1 -= own
    t1 = heap_point(with_types=True)[2]
    out: dict[str, Any] = {
        "blocks_per_step": (b1 - b0) / span, "gc_objects_per_step": (n1 - n0) / span,
        "blocks_per_step_since_first": (b1 - first[0]) / (steps - 1),
        "gc_objects_per_step_since_first": (n1 - first[1]) / (steps - 1),
        "points": points,
        "type_growth": type_growth(t0, t1)}
    if snaps:
        out["trace_top"] = growing_tracebacks(snaps, top)
        flt = [tracemalloc.Filter(False, tracemalloc.__file__)]
        total = snaps[-1].filter_traces(flt).compare_to(snaps[0].filter_traces(flt), "traceback")
        out["trace_total"] = [{"count_diff": st.count_diff, "size_diff": st.size_diff,
                               "traceback": [f"{f.filename}:{f.lineno}" for f in st.traceback][-10:]}
                              for st in sorted(total, key=lambda st: -st.count_diff)[:top]]
    return out


def soak(kind: str, steps: int, warmup: int, ranks: int = 2, layers: int = 2,
         trace: bool = False, features: tuple[str, ...] = (), timeout_s: float = 600.0
         ) -> list[dict[str, Any]]:
    """Every rank's :func:`soak_rank` result for one run; raises if a rank failed."""
    results, errors = run_local_ranks(soak_rank, ranks,
                                      (kind, steps, warmup, layers, trace, tuple(features)),
                                      timeout_s=timeout_s, deadline_s=timeout_s + 60)
    if errors:
        raise RuntimeError(f"heap soak {kind} failed: {errors}")
    return [results[r] for r in range(ranks)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--trace", action="store_true", help="tracemalloc diff on rank 0 (slow)")
    ap.add_argument("--features", default="", help=f"comma-separated, of {FEATURES}")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    features = tuple(f for f in a.features.split(",") if f)
    bad = [f for f in features if f not in FEATURES]
    if bad:
        ap.error(f"unknown --features {bad}; choose from {FEATURES}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runs = {}
    for kind in ("fsdp2", "dmuon"):
        runs[kind] = soak(kind, a.steps, a.warmup, a.ranks, a.layers, a.trace, features)
        log.info("%s: blocks/step %s (from step 1: %s), gc objects/step %s (from step 1: %s)",
                 kind, *([round(r[m], 3) for r in runs[kind]] for m in (
                     "blocks_per_step", "blocks_per_step_since_first", "gc_objects_per_step",
                     "gc_objects_per_step_since_first")))
    now = datetime.datetime.now(datetime.timezone.utc)
    res = {"date": now.isoformat(timespec="seconds"), "machine": platform.node(),
           "platform": platform.platform(), "python": platform.python_version(),
           "torch": torch.__version__, "cpu_count": os.cpu_count(),
           "steps": a.steps, "warmup": a.warmup, "ranks": a.ranks, "layers": a.layers,
           "trace": a.trace, "features": list(features), "runs": runs,
           "summary": {k: {m: max(r[m] for r in v) for m in (
               "blocks_per_step", "gc_objects_per_step", "blocks_per_step_since_first",
               "gc_objects_per_step_since_first")} for k, v in runs.items()}}
    out = a.out or os.path.join(HERE, "results", f"heap_soak_{now.date().isoformat()}.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    log.info("summary %s -> %s", res["summary"], out)
    return res


if __name__ == "__main__":
    main()
