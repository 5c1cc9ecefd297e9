"""Where an offloaded-momentum step spends the time an on-device one does not (issue 38): the
device timeline of a few back-to-back steps of one ``state_memory.py`` config, from
``torch.profiler``.

    python benchmarks/offload_profile.py --config dmuon_offload --out /tmp/off.json [--trace t.json.gz]
    python benchmarks/offload_profile.py --config dmuon_fp32 --tiny --out /tmp/p.json  # CPU smoke
    python benchmarks/offload_profile.py --config dmuon_offload --from-trace t.json.gz \
        --run-json /tmp/off.json --out benchmarks/results/offload_profile_h200_dmuon_offload.json

Builds the config's model and optimizer (``step_world1.build``, HF Llama 1.1B, B4 x T2048), runs
warm-up steps, then profiles ``--steps`` steps queued back to back exactly as ``run_config`` times
them (zero_grad + forward + backward inside ``record_function("fwd_bwd")``, the step inside
``record_function("opt_step")``). Per profiled step it reports, from the trace's device events:
each phase's span on the device, the busy time and the idle gaps of the stream that runs most
kernels (the compute stream) split into host gaps and wait gaps, every memcpy's kind, bytes and
time, the host syncs, how long each compute-stream copy to the host waited behind other streams'
copies, and the host time of each phase; so that a longer backward is attributed to slower kernels
(contention), to gaps (the device waiting on the host or on another stream), or to neither.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import state_memory as sm  # noqa: E402
import step_world1 as sw  # noqa: E402

GAP_US = 5.0  # idle stretches shorter than this on the compute stream are launch spacing
PHASES = ("fwd_bwd", "opt_step")


def _enclosing(events: list, inner: dict) -> list[str]:
    """Names of the host ops and ranges on ``inner``'s thread that enclose it, outermost first."""
    out = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")
           and e["tid"] == inner["tid"] and e["ts"] <= inner["ts"]
           and e["ts"] + e["dur"] >= inner["ts"] + inner["dur"]]
    return [e["name"] for e in sorted(out, key=lambda e: e["ts"])]


def analyse(trace: dict) -> dict:
    """The per-step, per-phase summary of a chrome trace exported by ``torch.profiler``.

    Every device event (kernel, memcpy, memset) is attributed to the host phase range during which
    it was launched (the CUDA runtime call of the same ``correlation`` id). On the stream that runs
    most kernels (the compute stream), an idle stretch is a host gap up to the end of the next
    event's launch (the device waited for the host) and a wait gap after it (the stream waited on
    an event, another stream or a copy engine; a few microseconds of launch latency too). Also: every
    host-blocking synchronization with the host ops around it, and every device-to-host copy on
    the compute stream with how long it waited after its launch and how many other streams'
    copies ran in that time (copies of one direction share a copy engine, in launch order)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    launch = {e["args"]["correlation"]: e for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    dev = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    per_stream = defaultdict(float)
    for k in dev:
        if k.get("cat") == "kernel":
            per_stream[k["args"].get("stream")] += k["dur"]
    compute = max(per_stream, key=per_stream.get) if per_stream else None
    ranges = sorted((e for e in events if e.get("cat") == "user_annotation"
                     and e["name"] in PHASES), key=lambda e: e["ts"])

    def phase_of(ev: dict) -> str | None:
        r = launch.get(ev["args"].get("correlation"))
        if r is not None:
            for i, h in enumerate(ranges):
                if h["ts"] <= r["ts"] <= h["ts"] + h["dur"]:
                    return f"{h['name']}[{i // 2}]"
        return None

    phases: dict = {}
    prev_end = None
    for d in dev:
        if d["args"].get("stream") != compute:
            continue
        name = phase_of(d) or "launched elsewhere"
        p = phases.setdefault(name, dict(first=d["ts"], last=0.0, busy_ms=0.0, host_gap_ms=0.0,
                                         wait_gap_ms=0.0, events=0))
        p["last"] = max(p["last"], d["ts"] + d["dur"])
        p["busy_ms"] += d["dur"] / 1e3
        p["events"] += 1
        if prev_end is not None and d["ts"] - prev_end > GAP_US:
            r = launch.get(d["args"].get("correlation"))
            gap = d["ts"] - prev_end
            host_part = gap if r is None else min(gap, max(0.0, r["ts"] + r["dur"] - prev_end))
            p["host_gap_ms"] += host_part / 1e3
            p["wait_gap_ms"] += (gap - host_part) / 1e3
        prev_end = max(prev_end or 0.0, d["ts"] + d["dur"])
    for p in phases.values():
        p["device_span_ms"] = (p.pop("last") - p.pop("first")) / 1e3
    copies = defaultdict(lambda: dict(gib=0.0, ms=0.0, count=0))
    for c in dev:
        if c.get("cat") == "gpu_memcpy":
            v = copies[f"{c['name']} stream {c['args'].get('stream')}"]
            v["gib"] += c["args"].get("bytes", 0) / 2**30
            v["ms"] += c["dur"] / 1e3
            v["count"] += 1
    d2h = [c for c in dev if c.get("cat") == "gpu_memcpy" and "DtoH" in c["name"]]
    waits = []
    for c in d2h:
        r = launch.get(c["args"].get("correlation"))
        if c["args"].get("stream") != compute or r is None:
            continue
        between = [o for o in d2h if o["args"].get("stream") != compute
                   and o["ts"] < c["ts"] and o["ts"] + o["dur"] > r["ts"]]
        waits.append(dict(phase=phase_of(c), bytes=c["args"].get("bytes"),
                          waited_ms=(c["ts"] - r["ts"]) / 1e3, other_copies_before=len(between),
                          their_gib=sum(o["args"].get("bytes", 0) for o in between) / 2**30))
    syncs = [dict(call=e["name"], ms=e["dur"] / 1e3, inside=" > ".join(_enclosing(events, e)[-4:]))
             for e in events if e.get("cat") == "cuda_runtime"
             and e["name"] in ("cudaStreamSynchronize", "cudaEventSynchronize",
                               "cudaDeviceSynchronize")]
    host = defaultdict(list)
    for h in ranges:
        host[h["name"]].append(h["dur"] / 1e3)
    return dict(compute_stream=compute,
                streams_kernel_ms={str(s): v / 1e3 for s, v in per_stream.items()},
                host_ms=dict(host), phases=phases, copies=dict(copies),
                compute_stream_d2h=waits, host_syncs=syncs)


def _report(out: dict) -> None:
    for name, p in out["phases"].items():
        print(f"{name:20s} device {p['device_span_ms']:8.2f} ms  compute busy {p['busy_ms']:8.2f}"
              f"  host gaps {p['host_gap_ms']:7.2f}  wait gaps {p['wait_gap_ms']:7.2f}", flush=True)
    for w in out["compute_stream_d2h"]:
        if w["waited_ms"] > 1.0:
            print(f"compute-stream copy to host in {w['phase']} waited {w['waited_ms']:.1f} ms "
                  f"behind {w['other_copies_before']} copies ({w['their_gib']:.2f} GiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help=f"of {sorted(sm.CONFIGS)}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--trace", default=None, help="also write the chrome trace (.json.gz)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--from-trace", default=None,
                    help="analyse a trace written by --trace (no run; --config names it)")
    ap.add_argument("--run-json", default=None,
                    help="--from-trace: the --out of the run that wrote the trace (its date, "
                         "machine, torch and settings are carried over)")
    a = ap.parse_args()
    if a.from_trace:
        run = {}
        if a.run_json:
            with open(a.run_json) as f:
                run = {k: v for k, v in json.load(f).items()
                       if k in ("date", "machine", "torch", "muon_kw", "warmup", "steps")}
        with gzip.open(a.from_trace, "rt") as f:
            out = dict(run, config=a.config, analysed_with="offload_profile.py --from-trace "
                       + os.path.basename(a.from_trace), **analyse(json.load(f)))
        _report(out)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        return
    from torch.profiler import ProfilerActivity, profile, record_function
    kind, kw, _ = sm.apply_config(a.config)
    cfg = sw.TINY if a.tiny else sw.Cfg()
    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    mesh = sw.init_world1(device)
    model, opt = sw.build(cfg, kind, device, mesh, "hf", kw)
    batches = sw.make_batches(cfg, device)

    def step(i: int) -> None:
        with record_function("fwd_bwd"):
            opt.zero_grad(set_to_none=True)
            loss, logits = sw.lm_loss(model, batches[i % len(batches)], cfg.vocab)
            loss.backward()
        with record_function("opt_step"):
            opt.step()

    for i in range(a.warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for i in range(a.steps):
            step(a.warmup + i)
        if cuda:
            torch.cuda.synchronize()
    tmp = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(tmp)
    with open(tmp) as f:
        trace = json.load(f)
    os.remove(tmp)
    if a.trace:
        with gzip.open(a.trace, "wt") as f:
            json.dump(trace, f)
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               machine=torch.cuda.get_device_name(0) if cuda else "cpu", torch=torch.__version__,
               config=a.config, muon_kw={k: str(v) for k, v in kw.items()},
               warmup=a.warmup, steps=a.steps, **analyse(trace))
    _report(out)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
