"""``benchmarks/offload_profile.py``'s trace analysis (pure): device events attributed to the host
phase that launched them, idle stretches split into host gaps and wait gaps, and a compute-stream
copy to the host that waited behind another stream's copies (the README's explanation of the
fp32-offload step on HF's Llama rests on these three readings)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from offload_profile import analyse  # noqa: E402

COMPUTE, SIDE = 7, 24


def _trace() -> dict:
    ev, corr = [], [0]

    def host(name, ts, dur, tid=1, cat="user_annotation"):
        ev.append(dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid, args={}))

    def dev(cat, name, ts, dur, stream, launched, nbytes=0):
        corr[0] += 1
        ev.append(dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=launched, dur=1,
                       tid=1, args={"correlation": corr[0]}))
        ev.append(dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=stream,
                       args={"correlation": corr[0], "stream": stream, "bytes": nbytes}))

    host("fwd_bwd", 0, 100)
    host("opt_step", 100, 50)
    dev("kernel", "gemm", 10, 20, COMPUTE, launched=5)      # busy 10..30
    dev("kernel", "gemm", 60, 10, COMPUTE, launched=55)     # host gap 30..60 (launched at 55)
    dev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 20, 50, SIDE, launched=2, nbytes=1 << 30)
    # a 1-byte read launched at 71, on the compute stream: the engine is busy until 90
    dev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 90, 1, COMPUTE, launched=71, nbytes=1)
    dev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 72, 18, SIDE, launched=3, nbytes=1 << 29)
    dev("kernel", "ns", 110, 30, COMPUTE, launched=101)     # opt_step
    ev.append(dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize", ts=71.5, dur=19.5,
                   tid=1, args={}))
    host("aten::item", 71, 21, cat="cpu_op")
    return {"traceEvents": ev}


def test_phases_gaps_and_the_copy_that_waited():
    out = analyse(_trace())
    assert out["compute_stream"] == COMPUTE
    fb, st = out["phases"]["fwd_bwd[0]"], out["phases"]["opt_step[0]"]
    assert fb["events"] == 3 and st["events"] == 1
    # 30..60: the host launched the kernel at 55..56 (26 host, 4 launch latency); 70..90: the
    # copy was launched at 71..72 (2 host) and waited for the copy engine until 90 (18)
    assert abs(fb["host_gap_ms"] - 0.028) < 1e-9
    assert abs(fb["wait_gap_ms"] - 0.022) < 1e-9
    assert abs(fb["busy_ms"] - 0.031) < 1e-9 and abs(fb["device_span_ms"] - 0.081) < 1e-9
    assert abs(st["busy_ms"] - 0.030) < 1e-9
    (w,) = out["compute_stream_d2h"]
    assert w["phase"] == "fwd_bwd[0]" and w["bytes"] == 1
    assert abs(w["waited_ms"] - 0.019) < 1e-9
    assert w["other_copies_before"] == 1 and abs(w["their_gib"] - 0.5) < 1e-9  # 72..90 only
    (s,) = out["host_syncs"]
    assert s["call"] == "cudaStreamSynchronize" and s["inside"].endswith("aten::item")
    side = out["copies"][f"Memcpy DtoH (Device -> Pinned) stream {SIDE}"]
    assert side["count"] == 2 and abs(side["gib"] - 1.5) < 1e-9

