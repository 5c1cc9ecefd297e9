"""Issue 39: a discarded model is freed — the rebuild loop's memory, groups, threads and fds.

One process builds a model (``dedicate_params`` + ``fully_shard`` + ``dmuon.Muon``, or plain FSDP2
+ AdamW as the control), runs a few steps, drops it (``del model, opt``; ``gc.collect()``), and
does that ``--rebuilds`` times, as a sweep, an eval model or a restart loop does. After each
rebuild: how many of the models built so far are alive (weak references), the device memory
still allocated / reserved (CUDA), the process RSS (after ``malloc_trim``), fds, threads and
process groups. ``release`` also calls ``dmuon.release(model)`` before dropping it.

Before the fix (2026-12-01, H200): every dmuon model stayed alive, ~1 GiB of a 0.5 B model per
rebuild; plain FSDP2 freed everything.

    python benchmarks/rebuild_loop.py --out benchmarks/results/rebuild_loop_h200.json   # H200
    python benchmarks/rebuild_loop.py --tiny --out /tmp/r.json                         # CPU, gloo

The model is step_world1.py's Llama (default here: 12 layers, hidden 1536, intermediate 4096,
vocab 32k: 0.44 B params, fp32 params, bf16 compute), batch 2 x 512 tokens.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import sys
import weakref
from dataclasses import asdict

import torch
import torch.distributed as dist

from step_world1 import Cfg, build, init_world1, lm_loss, make_batches

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import write_json  # noqa: E402

MIB = 2 ** 20
BIG = Cfg(vocab=32000, layers=12, hidden=1536, inter=4096, heads=12, kv_heads=4, batch=2, seq=512)
TINY = Cfg(vocab=128, layers=2, hidden=64, inter=128, heads=4, kv_heads=2, batch=2, seq=16)


def _rss_mib() -> float:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / MIB


def measure(device: torch.device) -> dict:
    from torch.distributed import distributed_c10d as c10d
    gc.collect()
    row = dict(rss_mib=_rss_mib(), fds=len(os.listdir("/proc/self/fd")),
               threads=len(os.listdir("/proc/self/task")), groups=len(c10d._world.pg_map))
    if device.type == "cuda":
        torch.cuda.synchronize()
        row.update(allocated_mib=torch.cuda.memory_allocated() / MIB,
                   reserved_mib=torch.cuda.memory_reserved() / MIB)
    return row


def run(cfg: Cfg, kind: str, device: torch.device, mesh, rebuilds: int, steps: int) -> dict:
    """``kind``: ``dmuon`` / ``release`` (dmuon, ``dmuon.release`` before ``del``) / ``adamw``."""
    import dmuon
    batches = make_batches(cfg, device, steps)
    rows, refs = [], []
    start = measure(device)
    for _ in range(rebuilds):
        model, opt = build(cfg, "adamw" if kind == "adamw" else "dmuon", device, mesh)
        for ids in batches:
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model, ids, cfg.vocab)[0]  # (the logits would hold the graph)
            loss.backward()
            opt.step()
        del loss
        refs.append((weakref.ref(model), weakref.ref(opt)))
        if kind == "release":
            dmuon.release(model)
        del model, opt
        rows.append(dict(measure(device), alive_models=sum(m() is not None for m, _ in refs),
                         alive_optimizers=sum(o() is not None for _, o in refs)))
        print(kind, rows[-1], flush=True)
    span = max(1, len(rows) - 2)

    def per_rebuild(key: str):  # from the second rebuild on (the first warms caches up)
        return (rows[-1][key] - rows[1][key]) / span if key in rows[0] and len(rows) > 2 else None

    summary = {f"{k}_per_rebuild": per_rebuild(k)
               for k in ("rss_mib", "allocated_mib", "reserved_mib", "fds", "threads", "groups")}
    summary.update(alive_after_last=rows[-1]["alive_models"],
                   allocated_after_last_mib=rows[-1].get("allocated_mib"),
                   allocated_before_first_mib=start.get("allocated_mib"))
    return {"kind": kind, "start": start, "rows": rows, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/rebuild_loop_h200.json")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (gloo)")
    ap.add_argument("--kinds", default="adamw,dmuon,release")
    ap.add_argument("--rebuilds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    cfg = TINY if a.tiny else BIG
    device = torch.device("cuda", 0) if (torch.cuda.is_available() and not a.tiny) \
        else torch.device("cpu")
    mesh = init_world1(device)
    results = [run(cfg, kind, device, mesh, a.rebuilds, a.steps) for kind in a.kinds.split(",")]
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"},
        "torch": torch.__version__, "config": asdict(cfg), "rebuilds": a.rebuilds,
        "steps": a.steps, "results": results,
        "summary": {r["kind"]: r["summary"] for r in results},
    }
    print(json.dumps(doc["summary"], indent=1))
    write_json(a.out, doc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
