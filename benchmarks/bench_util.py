"""Shared pieces of the GPU benchmark scripts: the Llama matrix sets and CUDA-event timing.

Imported by the scripts in this folder (run as ``python benchmarks/<script>.py``, so this folder is
on ``sys.path``).
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch

#: Layer counts and widths of the two reference models (issue 8).
MODELS = {
    "llama-3.2-1b": dict(layers=16, hidden=2048, inter=8192, kv=512),
    "llama-3.1-8b": dict(layers=32, hidden=4096, inter=14336, kv=1024),
}


def model_shapes(layers: int, hidden: int, inter: int, kv: int) -> list[tuple[int, int]]:
    """Every 2-D matrix of a Llama decoder stack (q, k, v, o, gate, up, down per layer)."""
    per = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
           (inter, hidden), (inter, hidden), (hidden, inter)]
    return per * layers


def time_ms(fn: Callable[[], object], warmup: int = 2, repeats: int = 10) -> tuple[float, list]:
    """Median and all times (ms) of ``fn()`` by CUDA events, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts), ts
