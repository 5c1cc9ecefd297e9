"""Optimizer-step time of each Muon variant on one GPU, relative to Newton–Schulz alone.

For every 2-D matrix of a Llama preset (fp32 masters and gradients on the GPU, as an owner holds
them), one owner step (:func:`dmuon.functional.owner_step.owner_step`, donated, what
``dmuon.Muon.step`` runs on an owner) per variant:

* ``ns``: the NS engine alone on every matrix (what every variant pays);
* ``muon``: Muon's default path (the fused donating update: NS engine + fused Triton elementwise
  passes where Triton imports, as ``dmuon.Muon`` on CUDA);
* ``muon_chain``: ``variants.muon()`` through the chain path (foreach stages + the same engine);
* ``normuon``, ``muon_hyperball``, ``normuon_hyperball``: the variants (same engine).

Timing: CUDA events around one step, warm-up first, median of ``--repeats``; ratio = step / ns.

Usage (the H200)::

    python benchmarks/variants_step.py --out benchmarks/results/variants_step_h200.json

``--models 1b,8b`` (default ``1b``; 8B's matrices are 28 GB per fp32 copy: params, gradients,
momentum and the variants' temporaries fit an H200's 141 GB one kind at a time); ``--tiny``: small
shapes on CPU (host clock, the functional NS), a smoke run for CI (``tests/test_benchmarks_smoke.py``).
Each kind's ``peak_gib`` (CUDA) is its peak allocated memory.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dmuon.functional import muon as fmuon  # noqa: E402
from dmuon.functional import variants  # noqa: E402
from dmuon.functional.owner_step import owner_step  # noqa: E402
from dmuon.newton_schulz.batched import BatchedNS  # noqa: E402
from dmuon.newton_schulz.config import NSConfig  # noqa: E402

KINDS = ("muon", "muon_chain", "normuon", "muon_hyperball", "normuon_hyperball")
TINY = [(64, 32), (32, 64), (48, 48), (96, 32)] * 2


def _shapes(model: str) -> list[tuple[int, int]]:
    from bench_util import model_shapes
    return model_shapes({"1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}.get(model, model))


def _timer(device: torch.device):
    if device.type == "cuda":  # CUDA events (bench_util's one timer)
        from bench_util import time_ms
        return time_ms

    def run(fn, warmup: int, repeats: int) -> tuple[float, list[float]]:
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts), ts
    return run


def _engine(device: torch.device, config: NSConfig):
    if device.type == "cuda":
        from dmuon.kernels.ns_engine import NSEngine
        return NSEngine(config)
    return BatchedNS(config)


def _elementwise(device: torch.device):
    if device.type != "cuda":
        return None
    try:
        from dmuon.kernels.muon_elementwise import fused_elementwise
        return fused_elementwise()
    except Exception:  # noqa: BLE001 - no Triton: the foreach stages
        return None


def _tensors(shapes: list, device: torch.device, seed: int, scale: float = 1.0) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return {f"m{i}": (torch.randn(s, generator=g) * scale).to(device) for i, s in enumerate(shapes)}


def bench_model(shapes: list, device: torch.device, warmup: int, repeats: int) -> dict:
    """Each kind on fresh tensors (freed after: an 8B model's matrices are 28 GB in fp32)."""
    hp = fmuon.MuonHParams(lr=0.02)
    engine = _engine(device, NSConfig.from_hparams(hp))
    timer = _timer(device)
    out: dict = {}
    grads = _tensors(shapes, device, 1)
    xs = [t.unsqueeze(0) for t in grads.values()]  # the engine may overwrite them: timing only
    ms, all_ms = timer(lambda: engine(xs), warmup, repeats)
    out["ns"] = {"ms": ms, "all_ms": all_ms}
    del grads, xs
    for kind in KINDS:
        params, g_step = _tensors(shapes, device, 0, 0.02), _tensors(shapes, device, 1)
        if kind == "muon":
            state = [fmuon.init(params)]
            ew = _elementwise(device)

            def step():
                _, state[0] = fmuon.update(g_step, state[0], params, hp, donate=True,
                                           donate_grads=True, orthogonalize=engine,
                                           elementwise=ew)
        else:
            variant = variants.muon() if kind == "muon_chain" else getattr(variants, kind)()
            h = hp._replace(weight_decay=0.0) if "hyperball" in kind else hp._replace(
                weight_decay=0.1)
            state = [None]

            def step(variant=variant, h=h):
                _, state[0] = owner_step(g_step, state[0], params, h, transform=variant,
                                         donate=True, donate_grads=True,
                                         orthogonalizer_for=lambda spec, names: engine)
        ms, all_ms = timer(step, warmup, repeats)
        out[kind] = {"ms": ms, "all_ms": all_ms, "ratio_to_ns": ms / out["ns"]["ms"],
                     "over_ns_ms": ms - out["ns"]["ms"]}
        if device.type == "cuda":
            out[kind]["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        del params, g_step, state, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    return out


def machine(device: torch.device) -> dict:
    d = {"host": platform.node(), "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        d.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                 cuda=torch.version.cuda, gpus=torch.cuda.device_count())
    else:
        d["cpu"] = platform.processor() or platform.machine()
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--models", default="1b", help="comma list: 1b, 8b (Llama presets)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="small shapes on CPU (smoke)")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    models = {"tiny": TINY} if a.tiny else {m: _shapes(m) for m in a.models.split(",")}
    results = {}
    for name, shapes in models.items():
        results[name] = bench_model(shapes, device, a.warmup if not a.tiny else 1,
                                    a.repeats if not a.tiny else 3)
        r = results[name]
        print(f"{name}: {len(shapes)} matrices; NS {r['ns']['ms']:.2f} ms")
        for kind in KINDS:
            print(f"  {kind:<18} {r[kind]['ms']:9.2f} ms  {r[kind]['ratio_to_ns']:6.3f} x NS  "
                  f"(+{r[kind]['over_ns_ms']:.2f} ms)")
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(device), "torch": torch.__version__,
           "config": {"models": list(models), "warmup": a.warmup, "repeats": a.repeats,
                      "hparams": "lr 0.02, momentum 0.95, weight_decay 0.1 (hyperball: 0), "
                                 "NSConfig defaults", "masters": "fp32", "tiny": a.tiny},
           "results": results}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=2))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
