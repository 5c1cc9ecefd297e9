"""Latency of Newton–Schulz on one small matrix (issue 24: one 512 x 2048 <= 0.06 ms).

Times ``NSEngine.orthogonalize_`` (in place on a fixed fp32 buffer: eager once, captured the
second call, replayed after), ``NSEngine.orthogonalize`` (copy in / out) and
``torch.optim.Muon``'s own NS where this torch has it, by CUDA events (median of many calls,
warm-up first), and the error of each against an fp64 Newton–Schulz.

    python benchmarks/ns_single.py --out benchmarks/results/ns_single_h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch

from dmuon.newton_schulz.config import NSConfig
from dmuon.kernels.ns_engine import NSEngine
from dmuon.newton_schulz.iteration import newton_schulz

from bench_util import time_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="512x2048,2048x512,2048x2048")
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for s in a.shapes.split(","):
        m, n = map(int, s.split("x"))
        g = torch.randn(m, n, device="cuda")
        ref = newton_schulz(g.double(), dtype=torch.float64)
        eng = NSEngine(NSConfig())
        buf = g.clone()

        def inplace():
            buf.copy_(g)
            eng.orthogonalize_([buf], batch_dims=0)
        inplace_ms, _ = time_ms(inplace, warmup=5, repeats=a.repeats)
        row = dict(shape=[m, n], engine_inplace_ms=inplace_ms, engine_mode=eng.last_mode)
        copy_ms, _ = time_ms(lambda: eng.orthogonalize([g]), warmup=5, repeats=a.repeats)
        row["engine_copy_ms"] = copy_ms
        row["engine_rel_err_vs_fp64"] = float((buf.double() - ref).norm() / ref.norm())
        try:
            from torch.optim._muon import _zeropower_via_newtonschulz as zp
            tm, _ = time_ms(lambda: zp(g, (3.4445, -4.775, 2.0315), 5, 1e-7), warmup=5,
                            repeats=a.repeats)
            row["torch_muon_ms"] = tm
        except Exception as exc:  # noqa: BLE001
            row["torch_muon_error"] = repr(exc)
        rows.append(row)
        print(row, flush=True)
    doc = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
