"""Symmetric-product kernels on one GPU: ``sym_abt_tma`` configs vs ``sym_abt_triton`` vs cuBLAS.

Op: ``out = alpha a b^T + beta c + gamma I`` with a symmetric result (``b = a``: SYRK; or ``b`` a
symmetric ``(B, m, m)`` matrix commuting with ``a``). See ``dmuon/kernels/syrk_tma.py``.

Usage (from the repo root, PYTHONPATH=.)::

    python benchmarks/syrk_bench.py --out benchmarks/results/syrk_bench_h200.json
    python benchmarks/syrk_bench.py --interpret-check      # CPU: correctness only, Triton interpreter

Phase 1 (correctness): every config of ``CONFIGS`` on (B, m, k) in CHECK_SHAPES, both layouts of
``a`` (contiguous ``(B, m, k)`` and the transposed view of a contiguous ``(B, k, m)``), with and
without ``c``/``beta``/``gamma``, and with ``b`` given (two polynomials of one Gram matrix), against
an fp64 reference (relative Frobenius error < 1e-2) and ``torch.equal(out, out.mT)``.
Phase 2 (GPU timing): CUDA events, median of 10 after 3 warm-ups, of ``torch.bmm(a, a.mT)``
(cuBLAS), the old kernel and every config, on TIME_SHAPES, the transposed layout on TIME_T_SHAPES,
and for square shapes the Newton–Schulz form ``alpha a b + beta c`` (cuBLAS: ``baddbmm``). A config
that fails (compile, resources, ValueError) is recorded as an error string.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Any, Callable

CHECK_SHAPES = [(3, 256, 512), (2, 512, 256), (4, 1024, 1024)]
TIME_SHAPES = [(48, 2048, 8192), (48, 2048, 2048), (32, 2048, 2048), (36, 4096, 14336),
               (36, 4096, 4096), (64, 4096, 4096), (64, 1024, 4096), (64, 1024, 1024),
               (32, 512, 2048)]
TIME_T_SHAPES = [(32, 2048, 8192), (36, 4096, 14336)]
TOL = 1e-2


def _err(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    tail = [ln for ln in msg if "error" in ln.lower()][:2] or msg[:2]
    return f"{type(e).__name__}: {' | '.join(tail)[:400]}"


def rel_err(x, ref) -> float:
    x = x.double().cpu()
    return float((x - ref.cpu()).norm() / ref.cpu().norm().clamp_min(1e-30))


def check_case(fn: Callable, ref, torch) -> dict[str, Any]:
    try:
        out = fn()
        if out.is_cuda:
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any failure is a recorded result
        return dict(ok=False, error=_err(e))
    err = rel_err(out, ref)
    sym = bool(torch.equal(out, out.mT))
    return dict(ok=bool(err < TOL and sym), rel_err=err, symmetric=sym)


def correctness(torch, configs: list[str], shapes, device: str) -> list[dict]:
    from dmuon.kernels.syrk import sym_abt_triton
    from dmuon.kernels.syrk_tma import sym_abt_tma

    rows: list[dict] = []
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    for (bsz, m, k) in shapes:
        x = torch.randn(bsz, m, k, generator=gen, dtype=torch.float64) / k ** 0.5
        xt = torch.randn(bsz, k, m, generator=gen, dtype=torch.float64) / k ** 0.5
        g = x @ x.mT
        g = (g + g.mT) / 2
        p = g + 0.5 * g @ g                                  # two polynomials of one Gram matrix
        q = 1.5 * g - 0.3 * g @ g
        p, q = (p + p.mT) / 2, (q + q.mT) / 2
        cs = torch.randn(bsz, m, m, generator=gen, dtype=torch.float64)
        cs = (cs + cs.mT) / 2
        eye = torch.eye(m, dtype=torch.float64)
        a_c = x.to(bf).to(device)
        a_t = xt.to(bf).to(device).mT                         # transposed view, strides (m k, 1, m)
        p16, q16, c16 = (t.to(bf).contiguous().to(device) for t in (p, q, cs))
        p16t = p16.mT.contiguous().mT                         # same values, transposed layout
        q16t = q16.mT.contiguous().mT
        al, be, ga = 0.7, -0.4, 1.3
        cases = []
        for lay, a in (("contig", a_c), ("trans", a_t)):
            ad = a.double().cpu()
            cases.append((f"aaT/{lay}", dict(a=a), ad @ ad.mT))
            cases.append((f"aaT+c+gI/{lay}", dict(a=a, alpha=al, beta=be, c=c16, gamma=ga),
                          al * ad @ ad.mT + be * c16.double().cpu() + ga * eye))
        pd, qd, cd = p16.double().cpu(), q16.double().cpu(), c16.double().cpu()
        cases.append(("PQ/contig", dict(a=p16, b=q16), pd @ qd.mT))
        cases.append(("aPQ+bc/contig", dict(a=p16, b=q16, alpha=al, beta=be, c=c16),
                      al * pd @ qd.mT + be * cd))
        cases.append(("aPQ+bc+gI/trans", dict(a=p16t, b=q16t, alpha=al, beta=be, c=c16, gamma=ga),
                      al * pd @ qd.mT + be * cd + ga * eye))
        impls: list[tuple[str, Callable]] = [("old", lambda **kw: sym_abt_triton(**kw))]
        impls += [(name, (lambda name: lambda **kw: sym_abt_tma(**kw, config=name))(name))
                  for name in configs]
        for impl, f in impls:
            for case, kw, ref in cases:
                r = check_case(lambda: f(**kw), ref, torch)
                rows.append(dict(shape=[bsz, m, k], impl=impl, case=case, **r))
            if impl != "old":  # out= given, and fp16
                o = torch.empty(bsz, m, m, dtype=bf, device=device)
                r = check_case(lambda: (f(a=a_c, out=o), o)[1], a_c.double().cpu() @ a_c.double().cpu().mT, torch)
                rows.append(dict(shape=[bsz, m, k], impl=impl, case="out=/contig", **r))
                a16 = x.to(torch.float16).to(device)
                r = check_case(lambda: f(a=a16), a16.double().cpu() @ a16.double().cpu().mT, torch)
                rows.append(dict(shape=[bsz, m, k], impl=impl, case="fp16/contig", **r))
            bad = [r for r in rows if r["impl"] == impl and r["shape"] == [bsz, m, k] and not r["ok"]]
            worst = max((r.get("rel_err", 0.0) for r in rows
                         if r["impl"] == impl and r["shape"] == [bsz, m, k]), default=0.0)
            print(f"check {bsz}x{m}x{k} {impl:15s} worst rel err {worst:.2e} "
                  f"{'OK' if not bad else 'FAIL: ' + ', '.join(r['case'] for r in bad)}", flush=True)
    return rows


def contract_checks(torch, device: str) -> list[dict]:
    """Inputs the TMA kernel must refuse with ValueError (the caller then falls back)."""
    from dmuon.kernels.syrk_tma import sym_abt_tma
    bf = torch.bfloat16
    bad = {
        "m % block": lambda: sym_abt_tma(torch.zeros(2, 320, 256, dtype=bf, device=device),
                                         config="p128x256"),
        "fp32": lambda: sym_abt_tma(torch.zeros(2, 256, 256, device=device)),
        "strided a": lambda: sym_abt_tma(torch.zeros(2, 256, 512, dtype=bf, device=device)[:, :, ::2]),
        "bad config key": lambda: sym_abt_tma(torch.zeros(2, 256, 256, dtype=bf, device=device),
                                              config=dict(blockm=64)),
    }
    rows = []
    for name, f in bad.items():
        try:
            f()
            rows.append(dict(case=name, ok=False, error="no exception"))
        except ValueError as e:
            rows.append(dict(case=name, ok=True, message=str(e)[:200]))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(case=name, ok=False, error=_err(e)))
    for r in rows:
        print(f"contract {r['case']:15s} {'OK (ValueError)' if r['ok'] else 'FAIL ' + r['error']}")
    return rows


def timing(torch, configs: list[str]) -> list[dict]:
    from bench_util import time_ms
    from dmuon.kernels.syrk import sym_abt_triton
    from dmuon.kernels.syrk_tma import sym_abt_tma

    bf, dev = torch.bfloat16, "cuda"
    rows: list[dict] = []
    jobs = [(s, "aaT", False) for s in TIME_SHAPES] + [(s, "aaT", True) for s in TIME_T_SHAPES]
    jobs += [(s, "ab+c", False) for s in TIME_SHAPES if s[1] == s[2]]
    for (bsz, m, k), form, trans in jobs:
        torch.manual_seed(0)
        a = ((torch.randn(bsz, k, m, device=dev, dtype=bf) / k ** 0.5).mT if trans
             else torch.randn(bsz, m, k, device=dev, dtype=bf) / k ** 0.5)
        out = torch.empty(bsz, m, m, device=dev, dtype=bf)
        flops = 2.0 * bsz * m * m * k
        label = f"{bsz}x{m}x{k}{' T' if trans else ''} {form}"
        if form == "aaT":
            impls = [("cublas", lambda: torch.bmm(a, a.mT, out=out)),
                     ("old", lambda: sym_abt_triton(a, out=out))]
            impls += [(n, (lambda n: lambda: sym_abt_tma(a, out=out, config=n))(n)) for n in configs]
        else:
            b = torch.randn(bsz, m, m, device=dev, dtype=bf)
            b = ((b + b.mT) / 2).contiguous()
            c = (b * 0.5).contiguous()
            al, be = 0.7, -0.4
            impls = [("cublas", lambda: torch.baddbmm(c, a, b, beta=be, alpha=al, out=out)),
                     ("old", lambda: sym_abt_triton(a, b, alpha=al, beta=be, c=c, out=out))]
            impls += [(n, (lambda n: lambda: sym_abt_tma(a, b, alpha=al, beta=be, c=c, out=out,
                                                         config=n))(n)) for n in configs]
        ref = None
        base = None
        for impl, f in impls:
            row: dict[str, Any] = dict(shape=[bsz, m, k], trans=trans, form=form, impl=impl)
            try:
                ms = time_ms(f, warmup=3, repeats=10)[0]
                row.update(ms=ms, tflops_full=flops / ms / 1e9)
                if impl == "cublas":
                    ref, base = out.float().clone(), ms
                else:
                    row["speedup"] = base / ms
                    row["rel_err_vs_cublas"] = float((out.float() - ref).norm() / ref.norm())
                    row["symmetric"] = bool(torch.equal(out, out.mT))
            except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                row["error"] = _err(e)
            rows.append(row)
        best = min((r for r in rows[-len(impls):] if "ms" in r and r["impl"] not in ("cublas",)),
                   key=lambda r: r["ms"], default=None)
        cells = "  ".join(f"{r['impl']}={r['ms']:.3f}" if "ms" in r else f"{r['impl']}=ERR"
                          for r in rows[-len(impls):])
        print(f"{label:26s} {cells}", flush=True)
        if best:
            print(f"{'':26s} best {best['impl']} {best['ms']:.3f} ms, {best['speedup']:.2f}x cuBLAS, "
                  f"{best['tflops_full'] / 2:.0f} TF/s counting half the flops", flush=True)
        del a, out
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--interpret-check", action="store_true",
                    help="correctness only, on CPU, with TRITON_INTERPRET=1")
    ap.add_argument("--configs", default=None, help="comma list of CONFIGS names (default: all)")
    ap.add_argument("--check-shapes", default=None,
                    help="override CHECK_SHAPES, e.g. '3x256x512,2x512x256'")
    ap.add_argument("--skip-check", action="store_true", help="GPU: timing only")
    args = ap.parse_args()
    if args.interpret_check:
        os.environ["TRITON_INTERPRET"] = "1"      # before anything imports triton
    import torch
    import triton
    if args.interpret_check:
        from dmuon.kernels.interpreter import install_interpreter_shims
        install_interpreter_shims()
    from dmuon.kernels.syrk_tma import CONFIGS

    configs = args.configs.split(",") if args.configs else list(CONFIGS)
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.check_shapes.split(",")]
              if args.check_shapes else CHECK_SHAPES)
    device = "cpu" if args.interpret_check else "cuda"
    if not args.interpret_check and not torch.cuda.is_available():
        print("no CUDA device: use --interpret-check for the CPU correctness run", file=sys.stderr)
        return 2
    t0 = time.time()
    res: dict[str, Any] = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        configs={n: CONFIGS[n] for n in configs}, check_shapes=shapes)
    ok = True
    if not args.skip_check:
        res["contract"] = contract_checks(torch, device)
        res["correctness"] = correctness(torch, configs, shapes, device)
        # the old kernel's diagonal tiles are not mirror-exact with b given: informational only
        failed = [r for r in res["correctness"] if not r["ok"] and r["impl"] != "old"]
        ok = not failed and all(r["ok"] for r in res["contract"])
        res["check_seconds"] = time.time() - t0
        print(f"correctness: {'all OK' if ok else f'{len(failed)} FAILED'} "
              f"({res['check_seconds']:.0f} s)", flush=True)
    if not args.interpret_check:
        t1 = time.time()
        res["timing"] = timing(torch, configs)
        res["timing_seconds"] = time.time() - t1
    res["total_seconds"] = time.time() - t0
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
