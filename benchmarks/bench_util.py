"""Shared pieces of the benchmark scripts: the Llama matrix sets, CUDA-event timing, profiler
kernel sums, the header every results file starts with (:func:`run_header`), writing a results
file (:func:`write_json`) and handing a run's GPU memory back between runs (:func:`release`).

Imported by the scripts in this folder (run as ``python benchmarks/<script>.py``, so this folder is
on ``sys.path``).
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import sys
from collections import defaultdict
from typing import Callable

import torch

from dmuon.tools.presets import preset_specs

#: The two reference models (issue 8): names of :data:`dmuon.tools.presets.PRESETS`.
MODELS = ("llama-3.2-1b", "llama-3.1-8b")


def run_header() -> dict:
    """What every results JSON records first: ``date`` (UTC), ``machine_run_on`` (platform and
    processor), ``python`` and ``torch`` versions."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine_run_on": {"platform": platform.platform(),
                               "processor": platform.processor() or platform.machine()},
            "python": sys.version.split()[0], "torch": torch.__version__}


def write_json(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` (its folder made if missing), indented."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def release(device: torch.device) -> None:
    """After a run's last reference to its model is dropped: collect it and, on CUDA, wait for
    the device and return the cached memory, so that the next run starts from an empty GPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def model_shapes(name: str) -> list[tuple[int, int]]:
    """Every 2-D matrix of a preset's decoder stack (q, k, v, o, gate, up, down per layer, in layer
    order): the shapes of its Muon-routed parameters."""
    return [sp.shape for sp in preset_specs(name) if sp.route == "muon"]


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


def kernel_times(prof) -> dict[str, list]:
    """Device time (ms) and call count per kernel name, ``{name: [ms, calls]}``, summed over the
    CUDA-device events of a finished ``torch.profiler.profile`` ``prof``."""
    per: dict = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = ev.device_time_total / 1e3 if hasattr(ev, "device_time_total") else ev.cuda_time / 1e3
            per[ev.name][0] += t
            per[ev.name][1] += 1
    return dict(per)
