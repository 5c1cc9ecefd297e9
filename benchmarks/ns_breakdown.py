"""Where the NS engine's time goes, per shape group: GPU kernel time by kind, from the profiler.

Usage: ``python benchmarks/ns_breakdown.py --out breakdown.json [--models 1b,8b] [--restarts 2,3]
[--dtype fp16]``.
For every shape group of the Llama-3.2-1B / Llama-3.1-8B matrix sets (fp32 random inputs, as in
``ns_whole_model.py``) it times the captured engine (CUDA events, median) and runs the same
program eagerly under ``torch.profiler``, summing device time per kernel and per kind:
``sym`` (the Triton triangle kernel), ``gemm`` (cuBLAS), ``reduce`` (norms), ``copy/elementwise``
(gather, cast, scatter, clones). Kernel-time sums next to the replay time show what the replay
adds (gaps between kernels); the kinds show what is not a matrix product at all.
"""
from __future__ import annotations

import argparse
import datetime
import json
from collections import defaultdict

import torch

from dmuon.newton_schulz.cost import ns_cost
from dmuon.kernels.ns_engine import NSEngine
from dmuon.newton_schulz.config import NSConfig

from bench_util import MODELS, kernel_times, model_shapes, time_ms

def kind_of(name: str) -> str:
    n = name.lower()
    if "_sym_" in n:               # _sym_abt_kernel (pointer), _sym_tma_kernel (TMA)
        return "sym"
    if any(t in n for t in ("gemm", "xmma", "cutlass", "cublas", "matmul", "nvjet")):
        return "gemm"
    if "reduce" in n or "norm" in n:
        return "reduce"
    return "copy/elementwise"


def kernel_profile(fn) -> dict:
    """Device time per kernel name (ms) of one call of ``fn``, and per kind."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per_kernel = kernel_times(prof)
    kinds: dict = defaultdict(float)
    for name, (t, _) in per_kernel.items():
        kinds[kind_of(name)] += t
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:12]
    return dict(kinds_ms=dict(kinds), kernel_sum_ms=sum(kinds.values()),
                top=[dict(name=k[:160], ms=v[0], calls=v[1]) for k, v in top])


def run(models, restarts, out_path, dtype=None):
    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               compute_dtype=str(dtype or "default"), models=[])
    for name in models:
        shapes = model_shapes(name)
        groups = sorted({(min(s), max(s)) for s in shapes})
        mrow = dict(model=name, groups={})
        for g in groups:
            idx = [i for i, s in enumerate(shapes) if (min(s), max(s)) == g]
            ins = [torch.randn(shapes[i], device="cuda") for i in idx]
            outs = [torch.empty_like(x) for x in ins]
            row = dict(n=len(idx))
            for r in restarts:
                eng = NSEngine(NSConfig(ns_gram_restart=r, ns_dtype=dtype))
                st = eng.bind(ins, outs)
                key = f"restart_{r}"
                row[key] = dict(replay_ms=time_ms(st, repeats=5)[0], variant=st.chunks[0].variant,
                                chunks=[c.batch for c in st.chunks],
                                flops=sum(ns_cost(*shapes[i], 5, gram_restart=r).flops
                                          for i in idx))
                if r == restarts[0]:
                    row[key]["profile"] = kernel_profile(st._program.run_eager)
                del st, eng
                torch.cuda.empty_cache()
            mrow["groups"][f"{g[0]}x{g[1]}"] = row
            print(name, g, json.dumps({k: (v if not isinstance(v, dict) else
                                           {kk: vv for kk, vv in v.items() if kk != "profile"})
                                       for k, v in row.items()}), flush=True)
            prof = row[f"restart_{restarts[0]}"].get("profile")
            if prof:
                print("   kinds:", {k: round(v, 3) for k, v in prof["kinds_ms"].items()},
                      "sum", round(prof["kernel_sum_ms"], 3))
                for t in prof["top"][:8]:
                    print(f"   {t['ms']:9.3f} ms {t['calls']:4d}x  {t['name'][:110]}")
            del ins, outs
            torch.cuda.empty_cache()
        res["models"].append(mrow)
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--restarts", default="2",
                    help="comma-separated gram_restart values to time (first one is profiled)")
    ap.add_argument("--dtype", choices=("default", "bf16", "fp16"), default="default",
                    help="NS compute dtype (default: the engine's default for CUDA)")
    args = ap.parse_args()
    dtype = dict(default=None, bf16=torch.bfloat16, fp16=torch.float16)[args.dtype]
    torch.manual_seed(0)
    names = [n for k, n in zip(("1b", "8b"), MODELS) if k in args.models.split(",")]
    restarts = [None if r in ("none", "0") else int(r) for r in args.restarts.split(",")]
    run(names, restarts, args.out, dtype)


if __name__ == "__main__":
    main()
