"""Where the NS overlap's time goes at world size 1: host and GPU time of the forward, backward
and step with the overlap off and on, the host time spent inside the early-update hook
(``NSOverlap.reduce_issued``) per step, and, from one profiled step per mode, the GPU's busy time
per stream and in all (the union of kernel intervals) against the step's span.

The model and loop are ``step_world1.py``'s (HF ``LlamaForCausalLM`` ~1.1B, FSDP2 bf16, one GPU);
per batch shape 2 rounds x 2 modes x 6 steps (the last 4 of each kept; medians). Writes JSON
(date, machine, torch version). It diagnoses; ``ns_overlap_world1.py`` gives the step times to
report.

    python benchmarks/ns_overlap_host.py --out benchmarks/results/ns_overlap_host.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import release, run_header, write_json  # noqa: E402
from step_world1 import Cfg, build, init_world1, lm_loss, make_batches  # noqa: E402


def _union_ms(intervals: list) -> float:
    total, cur = 0.0, None
    for a, c in sorted(intervals):
        if cur is None or a > cur[1]:
            total += 0.0 if cur is None else cur[1] - cur[0]
            cur = [a, c]
        else:
            cur[1] = max(cur[1], c)
    return (total + (0.0 if cur is None else cur[1] - cur[0])) / 1e3


def _profiled(model, opt, batches, cfg) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        opt.zero_grad(set_to_none=True)
        loss, logits = lm_loss(model, batches[0], cfg.vocab)
        loss.backward()
        del logits
        opt.step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    by = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel":
            by[str(e["args"].get("stream"))].append((e["ts"], e["ts"] + e["dur"]))
    every = [iv for v in by.values() for iv in v]
    return dict(span_ms=(max(c for _, c in every) - min(a for a, _ in every)) / 1e3,
                busy_union_ms=_union_ms(every),
                per_stream={k: dict(kernels=len(v), busy_ms=sum(c - a for a, c in v) / 1e3)
                            for k, v in by.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/ns_overlap_host.json")
    ap.add_argument("--shapes", default="1x2048,4x2048", help="BxT, comma separated")
    a = ap.parse_args()
    from dmuon.stateful.optimizer import ns_overlap as overlap
    hook_s = [0.0]
    inner = overlap.NSOverlap.reduce_issued

    def timed_hook(self, names):
        t = time.perf_counter()
        try:
            return inner(self, names)
        finally:
            hook_s[0] += time.perf_counter() - t
    overlap.NSOverlap.reduce_issued = timed_hook
    device = torch.device("cuda", 0)
    mesh = init_world1(device)
    out = {}
    for shape in a.shapes.split(","):
        batch, seq = (int(x) for x in shape.split("x"))
        cfg = Cfg(batch=batch, seq=seq)
        model, opt = build(cfg, "dmuon", device, mesh, "hf")
        batches = make_batches(cfg, device)
        rows = collections.defaultdict(list)
        for _ in range(2):
            for mode in ("off", "on"):
                opt.set_ns_overlap(mode)
                for i in range(6):
                    torch.cuda.synchronize()
                    hook_s[0] = 0.0
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                    t = [time.perf_counter()]
                    ev[0].record()
                    opt.zero_grad(set_to_none=True)
                    loss, logits = lm_loss(model, batches[i % len(batches)], cfg.vocab)
                    ev[1].record()
                    t.append(time.perf_counter())
                    loss.backward()
                    del logits
                    ev[2].record()
                    t.append(time.perf_counter())
                    opt.step()
                    ev[3].record()
                    t.append(time.perf_counter())
                    torch.cuda.synchronize()
                    t.append(time.perf_counter())
                    if i >= 2:
                        rows[mode].append(dict(
                            host_fwd=1e3 * (t[1] - t[0]), host_bwd=1e3 * (t[2] - t[1]),
                            host_step=1e3 * (t[3] - t[2]), wall=1e3 * (t[4] - t[0]),
                            gpu_fwd=ev[0].elapsed_time(ev[1]), gpu_bwd=ev[1].elapsed_time(ev[2]),
                            gpu_step=ev[2].elapsed_time(ev[3]), hook_host=1e3 * hook_s[0]))
        summary = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                   for m, rs in rows.items()}
        profiles = {}
        for mode in ("off", "on"):
            opt.set_ns_overlap(mode)
            for i in range(2):  # the mode warm again (graphs captured) before the profiled step
                opt.zero_grad(set_to_none=True)
                loss, logits = lm_loss(model, batches[i], cfg.vocab)
                loss.backward()
                del logits
                opt.step()
            torch.cuda.synchronize()
            profiles[mode] = _profiled(model, opt, batches, cfg)
        out[shape] = dict(summary=summary, profile=profiles, stats=dict(opt.ns_overlap_stats))
        print(shape, json.dumps(summary), flush=True)
        del model, opt
        release(device)
    doc = {**run_header(), "gpu": torch.cuda.get_device_name(0), "results": out}
    write_json(a.out, doc)


if __name__ == "__main__":
    main()
