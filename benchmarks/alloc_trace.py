"""Where the steady-state device mallocs / frees of a training step come from (issue 24).

Builds one configuration of ``step_world1.py`` (same model, same optimizer settings), runs
``--warmup`` steps, then records the CUDA caching allocator's history
(``torch.cuda.memory._record_memory_history``, Python stacks) over ``--steps`` steps and groups
every ``segment_alloc`` / ``segment_free`` (a ``cudaMalloc`` / ``cudaFree``) by the innermost
frames of its Python stack. Also writes the per-step ``memory_stats`` counters.

    python benchmarks/alloc_trace.py --config dmuon --out benchmarks/results/alloc_trace_h200.json
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_world1 as sw  # noqa: E402


def _where(frames: list, depth: int) -> str:
    """The innermost ``depth`` frames outside torch's own allocator wrappers, as one string."""
    keep = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames
            if "torch/cuda/memory" not in f["filename"]]
    return " < ".join(keep[:depth])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="dmuon")
    ap.add_argument("--model", choices=sorted(sw.MODEL), default="llama")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cfg = sw.Cfg()
    device = torch.device("cuda", 0)
    mesh = sw.init_world1(device)
    model, opt = sw.build(cfg, a.config, device, mesh, a.model)
    batches = sw.make_batches(cfg, device)

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss, _ = sw.lm_loss(model, batches[i % len(batches)], cfg.vocab)
        loss.backward()
        opt.step()

    per_step = []
    for i in range(a.warmup):
        c0 = sw.device_alloc_counts()
        step(i)
        torch.cuda.synchronize()
        c1 = sw.device_alloc_counts()
        per_step.append(dict(step=i, mallocs=c1[0] - c0[0], frees=c1[1] - c0[1],
                             reserved_gib=torch.cuda.memory_reserved() / 2**30))
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    for i in range(a.warmup, a.warmup + a.steps):
        c0 = sw.device_alloc_counts()
        step(i)
        torch.cuda.synchronize()
        c1 = sw.device_alloc_counts()
        per_step.append(dict(step=i, mallocs=c1[0] - c0[0], frees=c1[1] - c0[1],
                             reserved_gib=torch.cuda.memory_reserved() / 2**30))
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    groups: dict = collections.defaultdict(lambda: [0, 0])
    actions = collections.Counter()
    for ev in snap["device_traces"][0]:
        actions[ev["action"]] += 1
        if ev["action"] in ("segment_alloc", "segment_free", "oom"):
            k = f"{ev['action']} @ {_where(ev.get('frames', []), a.depth)}"
            groups[k][0] += 1
            groups[k][1] += ev["size"]
    rows = sorted(({"where": k, "count": v[0], "gib": v[1] / 2**30} for k, v in groups.items()),
                  key=lambda r: -r["count"])
    doc = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               gpu=torch.cuda.get_device_name(0), torch=torch.__version__, config=a.config,
               model=a.model, per_step=per_step, actions=dict(actions), segments=rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for r in per_step:
        print(r)
    for r in rows[:25]:
        print(f"{r['count']:5d} {r['gib']:8.2f} GiB  {r['where']}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
