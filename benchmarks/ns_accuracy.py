"""Accuracy of NS compute dtypes and Gram restart periods on hard spectra, against fp64 (GPU).

Usage: ``python benchmarks/ns_accuracy.py --out acc.json [--shapes 2048x8192,4096x14336]``.

For each shape and each input kind it builds ``G`` in fp64 on the GPU, runs the fp64 iteration
(direct NS, the same Polar Express schedule) as the reference, and reports for every variant the
relative Frobenius error ``||Y - Y_64|| / ||Y_64||`` and, where the singular vectors are known,
the same error restricted to the weaker half of the left singular directions
(``||U_w^T (Y - Y_64)|| / ||U_w^T Y_64||``): the directions NS amplifies most, and the first to
suffer from fp16's narrow exponent range.

Kinds: ``gauss`` (i.i.d. normal), ``decay`` (singular values ``logspace(0, -4)``), ``lowrank``
(8 values in ``[0.1, 1]`` over a ``1e-3`` floor), ``powerlaw`` (``1/i``), ``rowscale`` (normal
entries, rows scaled by ``logspace(0, -4)``).

Variants: the GPU engine (``NSEngine``, the production path) in bf16 / fp16 with restart periods
2 and 3 (fp16 with the library's range lift ``s = 2^7``), plus two functional fp16 loops on cuBLAS:
``fp16_r3_plain`` (the library's ``ns_iterate`` without the lift) and ``fp16_r3_lift`` (with it,
as the engine). (``benchmarks/results/ns_accuracy_h200.json`` also holds ``fp16_r3_scaled``, the
experiment the lift came from: separate shape-dependent powers of two on ``X`` and ``A`` kept to
the end; it matched ``fp16_r3_lift`` on all 25 inputs and was removed from the script.)
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch

from dmuon.newton_schulz.coefficients import ns_coefficient_table
from dmuon.newton_schulz.iteration import (default_range_lift, frobenius_normalize,
                                            newton_schulz, ns_iterate)
from dmuon.newton_schulz.cost import choose_ns_variant
from dmuon.newton_schulz.config import NSConfig
from dmuon.kernels.ns_engine import NSEngine

ENGINE_VARIANTS = {
    "bf16_r2": NSConfig(ns_dtype=torch.bfloat16, ns_gram_restart=2),
    "bf16_r3": NSConfig(ns_dtype=torch.bfloat16, ns_gram_restart=3),
    "fp16_r2": NSConfig(ns_dtype=torch.float16, ns_gram_restart=2),
    "fp16_r3": NSConfig(ns_dtype=torch.float16, ns_gram_restart=3),
}
KINDS = ("gauss", "decay", "lowrank", "powerlaw", "rowscale")


def make(kind: str, m: int, n: int, gen: torch.Generator):
    """``(G, U)``: an ``(m, n)`` fp64 CUDA matrix of the kind and its left singular vectors."""
    dev = "cuda"
    if kind in ("gauss", "rowscale"):
        g = torch.randn(m, n, dtype=torch.float64, device=dev, generator=gen)
        if kind == "rowscale":
            g *= torch.logspace(0, -4, m, dtype=torch.float64, device=dev)[:, None]
        return g, None
    u, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, device=dev, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(n, m, dtype=torch.float64, device=dev, generator=gen))
    if kind == "decay":
        s = torch.logspace(0, -4, m, dtype=torch.float64, device=dev)
    elif kind == "lowrank":
        s = torch.full((m,), 1e-3, dtype=torch.float64, device=dev)
        s[:8] = torch.logspace(0, -1, 8, dtype=torch.float64, device=dev)
    else:
        s = 1.0 / torch.arange(1, m + 1, dtype=torch.float64, device=dev)
    return (u * s) @ v.mT, u


def errors(y: torch.Tensor, ref: torch.Tensor, u) -> dict:
    d = y.double() - ref
    out = dict(rel=(d.norm() / ref.norm()).item())
    if u is not None:
        w = u[:, u.shape[1] // 2:]
        out["weak_half"] = ((w.mT @ d).norm() / (w.mT @ ref).norm()).item()
    if not torch.isfinite(y).all():
        out["nonfinite"] = True
    return out


def run(shapes, out_path: str) -> dict:
    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=[])
    table = ns_coefficient_table("polar_express", 5, safety=1.01)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for (m, n) in shapes:
        for kind in KINDS:
            g, u = make(kind, m, n, gen)
            ref = newton_schulz(g, dtype=torch.float64, variant="direct")
            row = dict(m=m, n=n, kind=kind, variant=choose_ns_variant(m, n, 5, gram_restart=3))
            x = g.float()
            for name, kw in ENGINE_VARIANTS.items():
                row[name] = errors(NSEngine(kw).orthogonalize([x])[0], ref, u)
            x0 = frobenius_normalize(x[None], 1e-7, torch.float32)
            row["fp16_r3_plain"] = errors(ns_iterate(
                x0.half(), table, variant=row["variant"], gram_restart=3).float()[0], ref, u)
            s = default_range_lift(torch.float16)
            row["fp16_r3_lift"] = errors(ns_iterate(
                frobenius_normalize(x[None], 1e-7, torch.float16, lift=s), table,
                variant=row["variant"], gram_restart=3, lift=s).float()[0], ref, u)
            res["rows"].append(row)
            print(f"{m}x{n} {kind:8s} {row['variant']:6s} " + " ".join(
                f"{k}={v['rel']:.2e}" + (f"/{v['weak_half']:.2e}" if "weak_half" in v else "")
                for k, v in row.items() if isinstance(v, dict)), flush=True)
            del g, u, ref, x, x0
            torch.cuda.empty_cache()
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="512x2048,2048x8192,4096x4096,4096x14336,8192x28672")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    run(shapes, args.out)


if __name__ == "__main__":
    main()
