"""Where one small matrix's Newton–Schulz time goes (issue 24: one 512 x 2048 <= 0.06 ms).

For each shape: the engine as users get it (``orthogonalize_``, graph-replayed), the functional
iteration captured by hand in its variants (Gram / direct, cuBLAS or Triton symmetric products),
the latency of every single product kind it is made of (each captured ``--reps`` times in one
graph, so launch gaps inside a graph count, host launches do not), and a kernel table of one eager
run (profiler). Errors are relative Frobenius errors against the fp64 iteration.

    python benchmarks/ns_small_probe.py --out benchmarks/results/ns_small_probe_h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import kernel_times, time_ms  # noqa: E402

from dmuon.kernels.syrk import make_sym_op  # noqa: E402
from dmuon.newton_schulz import chunks as chunks_mod  # noqa: E402
from dmuon.newton_schulz.config import NSConfig  # noqa: E402
from dmuon.kernels.ns_engine import NSEngine  # noqa: E402
from dmuon.newton_schulz.iteration import (default_range_lift, frobenius_normalize,  # noqa: E402
                                            newton_schulz, ns_iterate)
from dmuon.newton_schulz.coefficients import ns_coefficient_table  # noqa: E402


def graph_of(fn, reps: int = 1):
    """Capture ``reps`` calls of ``fn`` into one CUDA graph (after two eager warm-ups)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g


def per_call_us(fn, reps: int, repeats: int) -> float:
    g = graph_of(fn, reps)
    ms, _ = time_ms(g.replay, warmup=3, repeats=repeats)
    return ms * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="512x2048,2048x512,1024x4096")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--variant-grid", default="",
                    help="BxMxN,...: only time the engine with each variant forced on these batches")
    a = ap.parse_args()
    if a.variant_grid:
        return variant_grid(a)
    torch.manual_seed(0)
    dt = torch.float16
    lift = default_range_lift(dt)
    table = ns_coefficient_table("polar_express", 5)
    rows = []
    for spec in a.shapes.split(","):
        m, n = map(int, spec.split("x"))
        s_, l_ = min(m, n), max(m, n)
        g = torch.randn(m, n, device="cuda")
        ref = newton_schulz(g.double(), dtype=torch.float64)
        row = dict(shape=[m, n])

        def err(y):
            y = y.reshape(m, n).double()
            return float((y - ref).norm() / ref.norm())

        # 1. the engine, as dmuon.Muon calls it, and with the variant forced
        for forced in (None, "direct", "gram"):
            patch = (mock.patch.object(chunks_mod, "choose_ns_variant", lambda *x, **k: forced)
                     if forced else mock.patch.object(chunks_mod, "plan_ns_chunks",
                                                      chunks_mod.plan_ns_chunks))
            for backend in ("auto", "triton"):
                with patch:
                    eng = NSEngine(NSConfig(), sym_backend=backend)
                    buf = g.clone()

                    def inplace():
                        buf.copy_(g)
                        eng.orthogonalize_([buf], batch_dims=0)
                    ms, _ = time_ms(inplace, warmup=5, repeats=a.repeats)
                    key = f"engine_{forced or 'default'}_{backend}"
                    row[key] = dict(us=ms * 1e3, mode=eng.last_mode, err=err(buf),
                                    variant=next(iter(eng._inplace.values())).chunks[0].variant)
        # 2. the functional iteration alone on a prepared X_0 (no normalization / casts)
        x0 = frobenius_normalize(g.unsqueeze(0) if m <= n else g.unsqueeze(0).mT, 1e-7, dt,
                                 lift=lift)
        for variant in ("direct", "gram"):
            for backend in ("torch", "triton"):
                sym = make_sym_op(backend)
                res = {}

                def it():
                    res["y"] = ns_iterate(x0, table, variant=variant, sym=sym, lift=lift)
                try:
                    row[f"iterate_{variant}_{backend}_us"] = per_call_us(it, 1, a.repeats)
                    row[f"iterate_{variant}_{backend}_err"] = err(
                        res["y"].mT if m > n else res["y"])
                except Exception as exc:  # a backend that cannot take the shape
                    row[f"iterate_{variant}_{backend}_us"] = repr(exc)[:200]
        # 3. single products (wide orientation), each `reps` times in one graph
        xw = torch.randn(1, s_, l_, device="cuda", dtype=dt) / (s_ * l_) ** 0.5
        am = torch.randn(1, s_, s_, device="cuda", dtype=dt) / s_
        am = (am + am.mT) / 2
        out32 = torch.empty(1, s_, l_, device="cuda", dtype=torch.float32)
        g32 = torch.randn(1, s_, l_, device="cuda")
        ops = {
            "xxt_cublas": lambda: torch.bmm(xw, xw.mT),
            "xxt_triton": lambda: make_sym_op("triton")(xw),
            "sym_mm_cublas(baddbmm m^3)": lambda: torch.baddbmm(am, am, am, beta=0.5, alpha=0.3),
            "sym_mm_triton(m^3)": lambda: make_sym_op("triton")(am, am, alpha=0.3, beta=0.5,
                                                                c=am),
            "left_product(baddbmm m^2 n)": lambda: torch.baddbmm(xw, am, xw, beta=0.5),
            "left_product_bmm": lambda: torch.bmm(am, xw),
            "final_fp32_out": lambda: torch.bmm(am, xw, out_dtype=torch.float32, out=out32),
            "norm_fp32": lambda: torch.linalg.vector_norm(g32, dim=(-2, -1), keepdim=True),
            "clone_diag": lambda: am.clone().diagonal(dim1=-2, dim2=-1).add_(1.0),
            "empty_kernel(fill_ 1 elt)": lambda: out32[0, 0, :1].fill_(1.0),
        }
        lat = {}
        for k, fn in ops.items():
            try:
                lat[k] = per_call_us(fn, a.reps, a.repeats // 2)
            except Exception as exc:
                lat[k] = repr(exc)[:200]
        row["op_latency_us"] = lat
        # 4. kernel table of one eager engine run
        eng = NSEngine(NSConfig(), cuda_graphs=False)
        buf = g.clone()
        eng.orthogonalize_([buf])
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                eng.orthogonalize_([buf])
            torch.cuda.synchronize()
        row["eager_kernels_us_per_run"] = {
            k: [round(v[0] * 1e3 / 10, 2), v[1] // 10] for k, v in
            sorted(kernel_times(prof).items(), key=lambda kv: -kv[1][0])}
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               gpu=torch.cuda.get_device_name(0), torch=torch.__version__, rows=rows)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


def variant_grid(a) -> None:
    """The engine (default backend, graph replay) with Gram and direct forced, per batch shape:
    time per call and the worst relative error vs fp64 over the batch."""
    rows = []
    for spec in a.variant_grid.split(","):
        b, m, n = map(int, spec.split("x"))
        g = torch.randn(b, m, n, device="cuda")
        ref = newton_schulz(g.double(), dtype=torch.float64)
        row = dict(shape=[b, m, n])
        for forced in ("direct", "gram"):
            with mock.patch.object(chunks_mod, "choose_ns_variant", lambda *x, **k: forced):
                eng = NSEngine(NSConfig())
                buf = g.clone()

                def inplace():
                    buf.copy_(g)
                    eng.orthogonalize_([buf], batch_dims=1)
                reps = max(5, min(a.repeats, int(2e4 / (b * m * n / 1e6 + 1))))
                ms, _ = time_ms(inplace, warmup=3, repeats=reps)
                d = (buf.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
                row[forced] = dict(us=ms * 1e3, mode=eng.last_mode, worst_err=float(d.max()),
                                   mean_err=float(d.mean()))
        row["direct_over_gram"] = row["direct"]["us"] / row["gram"]["us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               gpu=torch.cuda.get_device_name(0), torch=torch.__version__, variant_grid=rows)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
