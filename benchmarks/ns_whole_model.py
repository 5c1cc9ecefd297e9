"""Whole-model Newton–Schulz time on one GPU: dmuon's graph-replayed batched engine vs
``torch.optim.Muon``'s own NS (one matrix at a time, its defaults), over every 2-D matrix of
Llama-3.2-1B and Llama-3.1-8B shapes, beside the measured bf16 (and fp16) matmul rate and two flop
floors (direct, and min(direct, Gram) with the default compute dtype's restart period).

Usage: ``python benchmarks/ns_whole_model.py --out results.json [--models 1b,8b]``.
Timing: CUDA events around the whole model's NS, warm-up first, median of repeats, random inputs
(fp32, like momentum buffers). Also times the symmetric-product kernel against cuBLAS on the
shapes the models use, and each variant's error against fp64 on one matrix per shape.
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch

from dmuon.newton_schulz.iteration import default_gram_restart, default_ns_dtype, newton_schulz
from dmuon.newton_schulz.cost import direct_flops, gram_flops, ns_cost
from dmuon.kernels.syrk import sym_abt_torch, sym_abt_triton, triton_available
from dmuon.kernels.ns_engine import NSEngine
from dmuon.newton_schulz.config import NSConfig

from bench_util import MODELS, model_shapes, time_ms

def matmul_rate(dtype=torch.bfloat16):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms, _ = time_ms(lambda: a @ b, warmup=3, repeats=20)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


#: Engine settings timed and error-checked beside the default (fp16 with one restart,
#: ``gram_restart="auto"`` = 3): bf16 with its default two restarts (the default before fp16),
#: bf16 with one restart, fp16 with two restarts.
VARIANTS = {
    "bf16": NSConfig(ns_dtype=torch.bfloat16),
    "bf16_restart3": NSConfig(ns_dtype=torch.bfloat16, ns_gram_restart=3),
    "fp16_restart2": NSConfig(ns_dtype=torch.float16, ns_gram_restart=2),
}
#: The default's restart period on CUDA (for the flop counts and floors).
RESTART = default_gram_restart(default_ns_dtype("cuda"))

SWEEP = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 4),
         (128, 32, 8, 5)]


def sym_microbench(shapes, sweep_shapes=(), dtype=torch.float16):
    rows = []
    for (bsz, m, k) in shapes:
        a = torch.randn(bsz, m, k, device="cuda", dtype=dtype)
        full = 2 * bsz * m * m * k
        t_cublas, _ = time_ms(lambda: sym_abt_torch(a), warmup=2, repeats=10)
        row = dict(batch=bsz, m=m, k=k, dtype=str(dtype), cublas_ms=t_cublas,
                   cublas_tflops=full / t_cublas / 1e9)
        if triton_available():
            out = torch.empty(bsz, m, m, device="cuda", dtype=dtype)
            t_tri, _ = time_ms(lambda: sym_abt_triton(a, out=out), warmup=2, repeats=10)
            row.update(triton_ms=t_tri, triton_effective_tflops=full / t_tri / 1e9,
                       speedup=t_cublas / t_tri)
            if (bsz, m, k) in sweep_shapes:
                sw = {}
                for cfg in SWEEP:
                    try:
                        sw[str(cfg)] = time_ms(lambda: sym_abt_triton(a, out=out, config=cfg),
                                               warmup=2, repeats=10)[0]
                    except Exception as exc:  # e.g. out of shared memory
                        sw[str(cfg)] = repr(exc)[:200]
                row["config_sweep_ms"] = sw
        rows.append(row)
        del a
    return rows


def layout_microbench():
    """Cost of the gather (normalize + cast) into a wide batch from tall vs wide fp32 sources."""
    src = torch.randn(32, 8192, 2048, device="cuda")
    norm = torch.linalg.vector_norm(src, dim=(-2, -1), keepdim=True)
    wide = torch.empty(32, 2048, 8192, device="cuda", dtype=torch.bfloat16)
    straight = torch.empty(32, 8192, 2048, device="cuda", dtype=torch.bfloat16)
    t_t, _ = time_ms(lambda: torch.div(src, norm, out=wide.mT), repeats=5)
    t_s, _ = time_ms(lambda: torch.div(src, norm, out=straight), repeats=5)
    gb = src.numel() * 6 / 1e9
    return dict(transposed_ms=t_t, straight_ms=t_s, gbytes=gb)


def gram_fp32_probe():
    """Numbers for the "fp32 Gram state, no restarts" option (NOTES_ns.md): batched m x m product
    rates in bf16, tf32 and fp32, and the functional core's all-fp32 (tf32) Gram without
    restarts on the 1B model's largest group, beside the engine's bf16 Gram (restart 2)."""
    res = {}
    prev = torch.backends.cuda.matmul.allow_tf32
    try:
        for bsz, m in [(48, 2048), (36, 4096)]:
            row = {}
            for name, dt, tf32 in [("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                                   ("fp32", torch.float32, False)]:
                torch.backends.cuda.matmul.allow_tf32 = tf32
                a = torch.randn(bsz, m, m, device="cuda", dtype=dt)
                t, _ = time_ms(lambda: torch.bmm(a, a), repeats=5)
                row[name] = dict(ms=t, tflops=2 * bsz * m ** 3 / t / 1e9)
                del a
            res[f"bmm_{bsz}x{m}x{m}"] = row
        torch.backends.cuda.matmul.allow_tf32 = True
        x = torch.randn(48, 2048, 8192, device="cuda")
        x0 = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
        t32, _ = time_ms(lambda: newton_schulz(x0, dtype=torch.float32, variant="gram",
                                               gram_restart=None, normalize=False), repeats=3)
        torch.backends.cuda.matmul.allow_tf32 = prev
        xb = [x[i] for i in range(x.shape[0])]
        outs = [torch.empty_like(t) for t in xb]
        st = NSEngine(NSConfig(ns_dtype=torch.bfloat16)).bind(xb, outs)
        tb, _ = time_ms(st, repeats=5)
        res["gram_48x2048x8192"] = dict(fp32_tf32_no_restart_ms=t32, engine_bf16_restart2_ms=tb)
        del x, x0, xb, outs, st
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
        torch.cuda.empty_cache()
    return res


def run_model(name, rate, repeats):
    shapes = model_shapes(name)
    ins = [torch.randn(s, device="cuda") for s in shapes]
    from torch.optim._muon import (DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS,
                                   _zeropower_via_newtonschulz)
    coeffs = (DEFAULT_A, DEFAULT_B, DEFAULT_C)

    def torch_muon():
        for g in ins:
            _zeropower_via_newtonschulz(g, coeffs, DEFAULT_NS_STEPS, EPS)

    res = dict(model=name, n_matrices=len(shapes), params=sum(a * b for a, b in shapes))
    t_ref, ts_ref = time_ms(torch_muon, warmup=1, repeats=repeats)
    res.update(torch_muon_ms=t_ref, torch_muon_times=ts_ref)
    outs = [torch.empty_like(x) for x in ins]
    torch.cuda.empty_cache()       # the reference's cached temporaries, before any capture
    for backend in (["auto", "triton"] if triton_available() else []) + ["torch"]:
        eng = NSEngine(sym_backend=backend)
        step = eng.bind(ins, outs)
        t, ts = time_ms(step, warmup=2, repeats=max(repeats, 5))
        res[f"dmuon_{backend}_ms"] = t
        res[f"dmuon_{backend}_times"] = ts
        res[f"dmuon_{backend}_mode"] = step.mode
        res[f"dmuon_{backend}_chunks"] = [(c.short, c.long, c.variant, c.batch) for c in step.chunks]
        del step, eng
        torch.cuda.empty_cache()
    # the other dtype / restart settings (NOTES_ns.md)
    for name, kw in VARIANTS.items():
        eng = NSEngine(kw)
        step = eng.bind(ins, outs)
        res[f"dmuon_auto_{name}_ms"], _ = time_ms(step, warmup=2, repeats=max(repeats, 5))
        res[f"dmuon_auto_{name}_mode"] = step.mode
        del step, eng
        torch.cuda.empty_cache()
    # per shape group (auto backend): where the time goes
    groups = {}
    for s in sorted({(min(a, b), max(a, b)) for a, b in shapes}):
        idx = [i for i, sh in enumerate(shapes) if (min(sh), max(sh)) == s]
        st = NSEngine().bind([ins[i] for i in idx], [outs[i] for i in idx])
        t, _ = time_ms(st, warmup=2, repeats=5)
        fl = sum(ns_cost(*shapes[i], 5, gram_restart=RESTART).flops for i in idx)
        groups[f"{s[0]}x{s[1]}"] = dict(n=len(idx), ms=t, variant=st.chunks[0].variant,
                                        full_count_tflops=fl / t / 1e9)
        del st
    res["groups_auto"] = groups
    torch.cuda.empty_cache()
    best = min(res[f"dmuon_{b}_ms"] for b in ("auto", "triton", "torch") if f"dmuon_{b}_ms" in res)
    res["dmuon_best_ms"] = best
    res["ratio_best_to_torch_muon"] = best / t_ref
    fl_direct = sum(direct_flops(a, b, 5) for a, b in shapes)
    fl_min = sum(min(direct_flops(a, b, 5), gram_flops(a, b, 5, RESTART)) for a, b in shapes)
    fl_auto = sum(ns_cost(a, b, 5, gram_restart=RESTART).flops for a, b in shapes)
    res.update(gram_restart=RESTART, flops_direct=fl_direct, flops_min=fl_min, flops_auto=fl_auto,
               floor_direct_ms=fl_direct / (rate * 1e12) * 1e3,
               floor_min_ms=fl_min / (rate * 1e12) * 1e3)
    # accuracy of the fast path on one matrix per distinct shape, vs fp64 NS of the same input
    errs = {}
    for s in sorted(set(shapes)):
        x = ins[shapes.index(s)]
        ref = newton_schulz(x.double(), dtype=torch.float64, variant="direct")
        for key, kw in [("", NSConfig())] + [(f"{n}:", kw) for n, kw in VARIANTS.items()]:
            y = NSEngine(kw).orthogonalize([x])[0]
            errs[f"{key}{s[0]}x{s[1]}"] = ((y.double() - ref).norm() / ref.norm()).item()
    res["rel_err_vs_fp64"] = errs
    del ins, outs
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-probes", action="store_true",
                    help="skip the tile sweep, the gather-layout and the fp32-Gram probes")
    args = ap.parse_args()
    torch.manual_seed(0)
    rate = matmul_rate()
    rate16 = matmul_rate(torch.float16)
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__ if triton_available() else None,
               bf16_matmul_tflops=rate, fp16_matmul_tflops=rate16, models=[])
    out["sym_microbench"] = sym_microbench([
        (48, 2048, 8192), (32, 2048, 2048), (48, 2048, 2048), (32, 512, 2048), (32, 512, 512),
        (36, 4096, 14336), (64, 4096, 4096), (36, 4096, 4096), (64, 1024, 4096), (64, 1024, 1024)],
        sweep_shapes=set() if args.skip_probes else
        {(48, 2048, 8192), (48, 2048, 2048), (36, 4096, 14336), (36, 4096, 4096)})
    if not args.skip_probes:
        out["layout_gather_32x8192x2048"] = layout_microbench()
        torch.cuda.empty_cache()
        out["gram_fp32_probe"] = gram_fp32_probe()
    want = args.models.split(",")
    for key, name in zip(("1b", "8b"), MODELS):
        if key in want:
            out["models"].append(run_model(name, rate, args.repeats))
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"GPU {out['gpu']}  torch {out['torch']}  triton {out['triton']}  "
          f"bf16 matmul {rate:.0f} TFLOP/s, fp16 {rate16:.0f}")
    print(f"{'B':>3} {'m':>5} {'k':>6} {'cuBLAS ms':>10} {'Triton ms':>10} {'speedup':>8}")
    for r in out["sym_microbench"]:
        print(f"{r['batch']:>3} {r['m']:>5} {r['k']:>6} {r['cublas_ms']:>10.3f} "
              f"{r.get('triton_ms', float('nan')):>10.3f} {r.get('speedup', float('nan')):>8.2f}")
        if "config_sweep_ms" in r:
            print("     sweep:", {k: (round(v, 3) if isinstance(v, float) else "err")
                                  for k, v in r["config_sweep_ms"].items()})
    if not args.skip_probes:
        print("gather 32x8192x2048 fp32->bf16:", {k: round(v, 3) for k, v in
                                                   out["layout_gather_32x8192x2048"].items()})
        print("fp32-Gram probe:", json.dumps(out["gram_fp32_probe"]))
    nan = float("nan")
    print(f"{'model':<14} {'torch.Muon':>10} {'dm/auto':>8} {'dm/triton':>9} {'dm/cuBLAS':>9} "
          f"{'ratio':>6} {'floor dir':>9} {'floor min':>9}")
    for r in out["models"]:
        print(f"{r['model']:<14} {r['torch_muon_ms']:>10.1f} {r.get('dmuon_auto_ms', nan):>8.1f} "
              f"{r.get('dmuon_triton_ms', nan):>9.1f} {r['dmuon_torch_ms']:>9.1f} "
              f"{r['ratio_best_to_torch_muon']:>6.3f} "
              f"{r['floor_direct_ms']:>9.1f} {r['floor_min_ms']:>9.1f}")
        for g, v in r["groups_auto"].items():
            print(f"   group {g:>10} x{v['n']:<3} {v['variant']:<6} {v['ms']:8.2f} ms  "
                  f"{v['full_count_tflops']:6.0f} TFLOP/s (full-count flops)")
        print("   variants:", {n: round(r[f"dmuon_auto_{n}_ms"], 2) for n in VARIANTS})
        print("   rel err vs fp64:", {k: round(v, 4) for k, v in r["rel_err_vs_fp64"].items()})


if __name__ == "__main__":
    main()
