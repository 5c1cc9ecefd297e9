"""Where forward + backward differ between FSDP2 + AdamW and FSDP2 + dmuon (world size 1, GPU).

    python benchmarks/step_profile.py --out profile.json [--tiny]

Builds the model of ``step_world1.py`` once per configuration (``adamw``, ``dmuon``; one process
each, as there), runs warm-up steps, then profiles the forward + backward of a few steps with
``torch.profiler`` (CUDA kernels and memcpy/memset) and sums device time per kernel name. The JSON
holds, per configuration, the kernel-time total and the top kernels, and the kernels whose time
differs most between the two (what dmuon adds or removes in forward + backward), beside the
CUDA-event time of the same phase.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from collections import defaultdict

import torch
import torch.distributed as dist

import step_world1 as sw
from bench_util import kernel_times


def profile_config(kind: str, tiny: bool, warmup: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    cfg = sw.TINY if tiny else sw.Cfg()
    cuda = torch.cuda.is_available() and not tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    mesh = sw.init_world1(device)
    model, opt = sw.build(cfg, kind, device, mesh)
    ids = sw.make_batches(cfg, device, 1)[0]   # the first batch of step_world1.py's

    def fwd_bwd():
        opt.zero_grad(set_to_none=True)
        loss, logits = sw.lm_loss(model, ids, cfg.vocab)  # logits live through backward
        loss.backward()

    for _ in range(warmup):
        fwd_bwd()
        opt.step()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    per: dict = defaultdict(lambda: [0.0, 0])
    event_ms = []
    for _ in range(steps):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        with profile(activities=acts) as prof:
            fwd_bwd()
            if cuda:
                torch.cuda.synchronize()
        if cuda:
            e.record()
            e.synchronize()
            event_ms.append(s.elapsed_time(e))
            for name, (ms, calls) in kernel_times(prof).items():
                per[name][0] += ms / steps
                per[name][1] += calls
        opt.step()
    dist.destroy_process_group()
    top = sorted(per.items(), key=lambda kv: -kv[1][0])
    return dict(kind=kind, kernel_ms=sum(v[0] for v in per.values()),
                event_ms_profiled=sorted(event_ms)[len(event_ms) // 2] if event_ms else None,
                kernels={k[:200]: dict(ms=v[0], calls_per_step=v[1] / steps) for k, v in top})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        res = profile_config(a.child, a.tiny, a.warmup, a.steps)
        with open(a.out, "w") as f:
            json.dump(res, f)
        return
    runs = {}
    for kind in ("adamw", "dmuon"):
        tmp = tempfile.mktemp(suffix=".json")
        subprocess.run([sys.executable, __file__, "--child", kind, "--out", tmp, "--warmup",
                        str(a.warmup), "--steps", str(a.steps)] + (["--tiny"] if a.tiny else []),
                       check=True)
        with open(tmp) as f:
            runs[kind] = json.load(f)
    ka, kd = runs["adamw"]["kernels"], runs["dmuon"]["kernels"]
    diff = sorted(((n, kd.get(n, {}).get("ms", 0.0) - ka.get(n, {}).get("ms", 0.0),
                    kd.get(n, {}).get("calls_per_step", 0), ka.get(n, {}).get("calls_per_step", 0))
                   for n in set(ka) | set(kd)), key=lambda t: -abs(t[1]))
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               torch=torch.__version__,
               totals={k: dict(kernel_ms=v["kernel_ms"], event_ms_profiled=v["event_ms_profiled"])
                       for k, v in runs.items()},
               diff=[dict(name=n[:200], dmuon_minus_adamw_ms=d, calls_dmuon=cd, calls_adamw=ca)
                     for n, d, cd, ca in diff[:40]],
               top={k: dict(list(v["kernels"].items())[:25]) for k, v in runs.items()})
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["totals"]))
    for r in out["diff"][:25]:
        print(f"{r['dmuon_minus_adamw_ms']:+8.3f} ms  calls {r['calls_dmuon']:6.0f} / "
              f"{r['calls_adamw']:6.0f}  {r['name'][:120]}")


if __name__ == "__main__":
    main()
