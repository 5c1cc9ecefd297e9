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
2 and 3 (fp16 with the library's range lift ``s = 2^7``), plus three functional fp16 loops on
cuBLAS: ``fp16_r3_plain`` (the library's ``ns_iterate`` without the lift), ``fp16_r3_lift`` (with
it, as the engine) and ``fp16_r3_scaled`` (the iteration on ``s X`` and ``t A`` with separate,
shape-dependent powers of two ``s, t`` kept to the end: the experiment the lift came from).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math

import torch

from dmuon.functional.coefficients import ns_coefficient_table
from dmuon.functional.newton_schulz import (default_range_lift, frobenius_normalize, left_product,
                                            newton_schulz, ns_iterate)
from dmuon.functional.ns_cost import choose_ns_variant
from dmuon.stateful.ns_engine import NSEngine

ENGINE_VARIANTS = {
    "bf16_r2": dict(dtype=torch.bfloat16, gram_restart=2),
    "bf16_r3": dict(dtype=torch.bfloat16, gram_restart=3),
    "fp16_r2": dict(dtype=torch.float16, gram_restart=2),
    "fp16_r3": dict(dtype=torch.float16, gram_restart=3),
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


def _prod(a, b, *, alpha=1.0, beta=0.0, c=None):
    """``alpha a b + beta c`` with alpha applied in the fp32 epilogue (never an fp16 overflow)."""
    if c is None:
        c, beta = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype,
                              device=a.device), 0.0
    return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)


def ns_scaled(x0: torch.Tensor, table, variant: str, restart: int | None, dtype) -> torch.Tensor:
    """The NS iteration on ``X~ = s X`` and ``A~ = t A`` (s, t powers of two), wide ``x0`` (B,m,n).

    Every update is linear in ``X`` and in ``A`` except ``Z = b A + c A^2``, computed as
    ``(b/t) A~ + (c/t^2) A~^2``; ``A~ = (t/s^2) X~ X~^T``; the result is ``Q X~ / s``.
    """
    m, n = x0.shape[-2:]
    s = 2.0 ** min(13, max(0, math.floor(math.log2(math.sqrt(m * n) / 2))))
    t = 2.0 ** min(13, max(0, math.floor(math.log2(m))))
    acc = torch.promote_types(x0.dtype, torch.float32)
    xs = (x0.to(acc) * s).to(dtype)

    def gram_of(x):
        return _prod(x, x.mT, alpha=t / s ** 2)

    if variant == "direct":
        for a, b, c in table:
            am = gram_of(xs)
            z = _prod(am, am, alpha=c / t ** 2, beta=b / t, c=am)
            xs = left_product(z, xs, beta=a, c=xs)
        return xs.to(acc) / s
    am, q = gram_of(xs), None
    for i, (a, b, c) in enumerate(table):
        if restart and i > 0 and i % restart == 0:
            xs = left_product(q, xs)
            am, q = gram_of(xs), None
        z = _prod(am, am, alpha=c / t ** 2, beta=b / t, c=am)
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = _prod(z, q, beta=a, c=q)
        if not (i == len(table) - 1 or (restart and (i + 1) % restart == 0)):
            r = _prod(am, z, beta=a, c=am)
            am = _prod(z, r, beta=a, c=r)
    return left_product(q, xs).to(acc) / s


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
                row[name] = errors(NSEngine(**kw).orthogonalize([x])[0], ref, u)
            x0 = frobenius_normalize(x[None], 1e-7, torch.float32)
            row["fp16_r3_plain"] = errors(ns_iterate(
                x0.half(), table, variant=row["variant"], gram_restart=3).float()[0], ref, u)
            s = default_range_lift(torch.float16)
            row["fp16_r3_lift"] = errors(ns_iterate(
                (x0 * s).half(), table, variant=row["variant"], gram_restart=3,
                lift=s).float()[0], ref, u)
            row["fp16_r3_scaled"] = errors(
                ns_scaled(x0, table, row["variant"], 3, torch.float16)[0], ref, u)
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
