"""Machine models for step-time projection: compute rates, Newton–Schulz rates, links, collectives.

A :class:`Machine` holds every constant the projector (:mod:`dmuon.tools.projection`) uses,
each with its source in :attr:`Machine.sources`: measured (benchmarks/results/*.json), fitted on
AdamW rows only (``benchmarks/validate_projection.py``), taken from a vendor spec sheet, or an
assumption. All are overridable (``dataclasses.replace``; ``python -m dmuon project --set``).

Collective time over a group of ``n`` ranks (NCCL's bus-bandwidth convention; ring algorithms)::

    t = latency + f * P / busbw,   latency = alpha + hops_ib * alpha_hop_ib + hops_nvlink * alpha_hop_nvlink
    f = 2 (n-1)/n  all-reduce;  (n-1)/n  all-gather / reduce-scatter (P = the whole buffer);
    f = 1          broadcast / reduce (pipelined chain)

with the group's bus bandwidth: NVLink's if the group lies in one node; otherwise the NICs'
``ib_busbw * members per node`` (rings through every member's NIC, rail-optimized fabric), capped
by NVLink's. A ring over ``n`` ranks in ``nodes`` nodes makes ``nodes`` network hops and
``n - nodes`` NVLink hops (one node: ``n`` NVLink hops); ``alpha`` is the slowest link's.

Newton–Schulz time of one matrix: measured per-matrix time for a measured shape (H200 engine,
``benchmarks/results/ns_whole_model_h200.json``), else its flop count (the engine's restart period)
over a rate interpolated in ``log2(m)`` between measured shapes of the same variant (clamped at
the ends); other machines scale the H200 rates by their peak matmul rate ratio.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

from dmuon.newton_schulz.cost import ns_cost

__all__ = ["Link", "Machine", "H200", "A800", "MACHINES", "H200_NS_GROUPS", "MEASURED_NS_STEPS",
           "collective_time",
           "collective_latency", "interp_log2",
           "group_busbw", "ns_matrix_seconds", "ns_rate"]


@dataclass(frozen=True)
class Link:
    """One link class: bus bandwidth per GPU (bytes/s, one direction, as NCCL reports busbw),
    start-up latency ``alpha`` and per-hop latency ``alpha_hop`` (seconds)."""

    busbw: float
    alpha: float
    alpha_hop: float


#: The Newton–Schulz iterations of the measured groups (the engine's default NSConfig).
MEASURED_NS_STEPS = 5

#: H200 engine, per shape group: (m, n, variant, matrices, ms), the default fp16 engine with one
#: Gram restart (gram_restart 3) and :data:`MEASURED_NS_STEPS` iterations;
#: benchmarks/results/ns_whole_model_h200.json "groups_auto".
H200_NS_GROUPS: tuple[tuple[int, int, str, int, float], ...] = (
    (512, 2048, "gram", 32, 1.422592043876648),
    (2048, 2048, "direct", 32, 11.415295600891113),
    (2048, 8192, "gram", 48, 32.72623825073242),
    (1024, 4096, "gram", 64, 7.099808216094971),
    (4096, 4096, "direct", 64, 163.5202178955078),
    (4096, 14336, "gram", 96, 412.9757995605469),
)
#: bf16 matmul rate measured in the same run (TFLOP/s), the reference for scaling other machines.
H200_MEASURED_MATMUL = 787.2999493823834e12

#: The share of the GPU owner NS gets while the backward computes (NS overlapped with the
#: backward, :mod:`dmuon.tools.ns_overlap`), ``(key name, ((key, share), ...))``: fitted by
#: :func:`dmuon.tools.calibration.fit_idle_points` on the H200 model from the issue-47 H100
#: measurements (:data:`dmuon.tools.ns_overlap.MEASURED`); keyed by tokens per GPU or by one
#: layer's projected backward seconds. A test re-fits them.
H200_NS_OVERLAP_IDLE: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = (
    ("tokens", ((2048, 0.216182), (4096, 0), (8192, 0))),
    ("layer_backward_s", ((0.00121539, 0.216182), (0.00486154, 0), (0.00731274, 0))),
)


@dataclass(frozen=True)
class Machine:
    """Every constant of the step model (see the module docstring and :attr:`sources`).

    Attributes:
      name; peak_flops: dense bf16 matmul FLOP/s; mfu_fwd, mfu_bwd: model-FLOPs utilization
      (achieved model flops over ``peak_flops``) of the forward / backward of a wide model, scaled
      by ``h / (h + mfu_half_hidden)`` at model width ``h`` (narrow models run smaller, less
      efficient kernels; 0: the same MFU at every width); adamw_step_s, adamw_s_per_param: the
      baseline's AdamW step takes ``adamw_step_s + adamw_s_per_param * params on the rank`` (its own
      implementation); fused_s_per_param: seconds
      per parameter of a fused 28 B/param pass (dmuon's element-wise Muon stages on owned params,
      and the fused AdamW dmuon runs on the rest); nvlink, ib:
      :class:`Link` (``ib.busbw`` per GPU NIC); gpus_per_node; hbm_bytes: memory per GPU;
      ns_groups: measured NS shape groups (``H200_NS_GROUPS`` format); ns_rate_scale: factor on
      the measured NS rates; ns_restart: Gram restart period of the NS engine;
      ref_ns_slowdown: ``(hidden, factor)`` points: the reference implementation's NS time over
      dmuon's, measured on the same H200 lease, interpolated in ``log2(hidden)``;
      ns_overlap_idle, ns_overlap_key: the GPU share owner NS gets during the backward when it
      overlaps it, per key, and the key used (``"tokens"`` per GPU or ``"layer_backward_s"``;
      :mod:`dmuon.tools.ns_overlap`); sources: ``{field: where the value comes from}``.
    """

    name: str
    peak_flops: float
    mfu_fwd: float
    mfu_bwd: float
    mfu_half_hidden: float
    adamw_step_s: float
    adamw_s_per_param: float
    fused_s_per_param: float
    nvlink: Link
    ib: Link
    gpus_per_node: int = 8
    hbm_bytes: float = 141e9
    ns_groups: tuple[tuple[int, int, str, int, float], ...] = H200_NS_GROUPS
    ns_rate_scale: float = 1.0
    ns_restart: int = 3
    ref_ns_slowdown: tuple[tuple[int, float], ...] = ((2048, 92.7 / 47.2), (4096, 954.0 / 605.8))
    ns_overlap_idle: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = H200_NS_OVERLAP_IDLE
    ns_overlap_key: str = "layer_backward_s"
    sources: Mapping[str, str] = field(default_factory=dict)

    def mfu(self, phase: str, hidden: int) -> float:
        """MFU of ``phase`` (``"fwd"`` / ``"bwd"``) for a model of width ``hidden``."""
        top = self.mfu_fwd if phase == "fwd" else self.mfu_bwd
        return top * hidden / (hidden + self.mfu_half_hidden)

    def with_values(self, **values: float) -> "Machine":
        """A copy with fields replaced (``nvlink_busbw=...`` etc. set one field of a link)."""
        kw: dict = {}
        for key, v in values.items():
            if key.startswith(("nvlink_", "ib_")):
                link, attr = key.split("_", 1)
                kw[link] = dataclasses.replace(kw.get(link, getattr(self, link)), **{attr: float(v)})
            elif key in {f.name for f in dataclasses.fields(self)}:
                kw[key] = type(getattr(self, key))(v)
            else:
                raise KeyError(f"unknown machine constant {key!r}")
        src = dict(self.sources)
        for key in values:
            src[key] = "set by the caller"
        return dataclasses.replace(self, **kw, sources=src)


_COMMON_SOURCES = {
    "ns_groups": "measured: benchmarks/results/ns_whole_model_h200.json groups_auto (H200)",
    "ref_ns_slowdown": "measured: DESIGN.md 2026-12-01 round, same H200 lease: reference / dmuon "
                       "whole-model NS 92.7/47.2 ms (Llama-3.2-1B shapes), 954/605.8 ms (8B)",
    "ns_restart": "dmuon default on CUDA (fp16, gram_restart 3)",
    "gpus_per_node": "assumption: 8-GPU HGX/DGX nodes",
    "ns_overlap_idle": "fitted (dmuon.tools.calibration.fit_idle_points, H200 model) on dmuon's "
                       "own overlap (graph replay) on one H100, W=1 step saved (main 4ff4b92, "
                       "session 11): HF Llama 1.1B +4.6 % at B1xT2048, -4.9 % at B4xT2048 (fits "
                       "0); Llama-3.1-8B layer shapes (8 layers) -7.0 % at B1xT4096 (fits 0)",
    "ns_overlap_key": "assumption: the idle share depends on one layer's backward time (a wider "
                      "layer fills the GPU sooner at the same tokens); 'tokens' (tokens per GPU "
                      "alone) is the alternative",
}

#: NVIDIA H200 SXM (our measurement machine).
H200 = Machine(
    name="H200", peak_flops=H200_MEASURED_MATMUL, mfu_fwd=0.8365, mfu_bwd=0.8365,
    mfu_half_hidden=1030.0, adamw_step_s=0.0, adamw_s_per_param=8.247e-12, fused_s_per_param=8.247e-12,
    nvlink=Link(busbw=360e9, alpha=15e-6, alpha_hop=1e-6),
    ib=Link(busbw=40e9, alpha=20e-6, alpha_hop=3e-6),
    hbm_bytes=141e9,
    sources={**_COMMON_SOURCES,
             "peak_flops": "measured: bf16 matmul 787.3 TFLOP/s, ns_whole_model_h200.json",
             "mfu_fwd": "fitted on the AdamW row of step_world1_h200.json (fwd+bwd 124.0 ms at "
                        "hidden 2048; one MFU for both): 0.557 there, x h/(h+1030) elsewhere",
             "mfu_bwd": "= mfu_fwd (the W=1 run times forward+backward together)",
             "mfu_half_hidden": "fitted on the four 8xA800 AdamW rows (an assumption for H200)",
             "adamw_step_s": "0: a single W=1 row cannot separate a fixed part",
             "adamw_s_per_param": "fitted on the AdamW row of step_world1_h200.json (fused AdamW "
                                  "9.11 ms over 1.10 B params)",
             "fused_s_per_param": "= adamw_s_per_param: the baseline is fused AdamW, and fused "
                                  "Muon stages move 28 B/param like it (NOTES_step.md run 3)",
             "nvlink": "spec: NVLink 900 GB/s total = 450 GB/s per direction (NVIDIA H200 sheet); "
                       "busbw 80 % of it and latencies are assumptions",
             "ib": "spec: 400 Gb/s ConnectX-7 per GPU (DGX H200) = 50 GB/s; busbw 80 % and "
                   "latencies are assumptions",
             "hbm_bytes": "spec: 141 GB HBM3e (NVIDIA H200 sheet)"})

#: NVIDIA A800 SXM4 80GB (the reference implementation's published runs).
A800 = Machine(
    name="A800", peak_flops=312e12, mfu_fwd=0.6946, mfu_bwd=0.7037,
    mfu_half_hidden=1030.0, adamw_step_s=7.815e-3, adamw_s_per_param=4.607e-11, fused_s_per_param=1.941e-11,
    nvlink=Link(busbw=160e9, alpha=15e-6, alpha_hop=1e-6),
    ib=Link(busbw=20e9, alpha=20e-6, alpha_hop=3e-6),
    hbm_bytes=80e9, ns_rate_scale=312e12 / H200_MEASURED_MATMUL,
    sources={**_COMMON_SOURCES,
             "peak_flops": "spec: 312 TFLOP/s bf16 dense (NVIDIA A100/A800 sheet; issue 25)",
             "mfu_fwd": "fitted on the 4 FSDP2+AdamW forward rows of the reference's 8xA800 run",
             "mfu_bwd": "fitted on the 4 FSDP2+AdamW backward rows of the reference's 8xA800 run",
             "mfu_half_hidden": "fitted on the same 8 forward and backward rows",
             "adamw_step_s": "fitted on the 4 FSDP2+AdamW optimizer rows (t = c0 + s * params)",
             "adamw_s_per_param": "fitted on the 4 FSDP2+AdamW optimizer rows of the reference's "
                                  "8xA800 run (torch.optim.AdamW default, not fused)",
             "fused_s_per_param": "H200's fused rate scaled by HBM bandwidth 4.8/2.039 TB/s (spec "
                                 "sheets): an assumption",
             "nvlink": "spec: NVLink 400 GB/s total = 200 GB/s per direction (A800; issue 25); "
                       "busbw 80 % of it and latencies are assumptions",
             "ib": "assumption: one 200 Gb/s HDR NIC per GPU = 25 GB/s, busbw 80 %",
             "hbm_bytes": "spec: 80 GB HBM2e",
             "ns_rate_scale": "assumption: H200 NS rates x 312 / 787.3 (peak matmul ratio)",
             "ns_overlap_idle": "assumption: H200's fitted points (no A800 measurement); keyed by "
                                "layer time, A800's slower layers read as a busier GPU"})

MACHINES: dict[str, Machine] = {"h200": H200, "a800": A800}


def group_busbw(machine: Machine, members_per_node: int, nodes: int) -> float:
    """Bus bandwidth of a group spanning ``nodes`` nodes with ``members_per_node`` ranks in each."""
    if nodes <= 1:
        return machine.nvlink.busbw
    return min(machine.nvlink.busbw, machine.ib.busbw * members_per_node)


def collective_time(machine: Machine, kind: str, nbytes: float, n: int, *, members_per_node: int,
                    nodes: int) -> float:
    """Seconds of one collective (module docstring). ``kind``: ``"all_reduce"``, ``"all_gather"``,
    ``"reduce_scatter"``, ``"broadcast"``, ``"reduce"``; ``nbytes``: the whole buffer; groups of
    one rank take no time."""
    if n <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
              "reduce_scatter": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}[kind]
    bw = group_busbw(machine, members_per_node, nodes)
    return collective_latency(machine, n, nodes) + factor * nbytes / bw


def collective_latency(machine: Machine, n: int, nodes: int) -> float:
    """Latency of a ring over ``n`` ranks in ``nodes`` nodes: the start-up ``alpha`` of the slowest
    link, then one hop per rank: ``nodes`` of them over the network (none in one node), the rest
    over NVLink."""
    if n <= 1:
        return 0.0
    inter = nodes if nodes > 1 else 0
    alpha = machine.ib.alpha if nodes > 1 else machine.nvlink.alpha
    return alpha + inter * machine.ib.alpha_hop + (n - inter) * machine.nvlink.alpha_hop


def interp_log2(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation of ``(x, y)`` points in ``log2(x)``, clamped at the ends."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            t = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + t * (y1 - y0)
    raise AssertionError("unreachable")  # pragma: no cover


def ns_rate(machine: Machine, m: int, variant: str, *, steps: int = 5,
            groups: Optional[tuple] = None) -> float:
    """Full-count flop rate (FLOP/s) of ``variant`` NS at short side ``m``: the measured groups'
    rates (their flops at :data:`MEASURED_NS_STEPS` iterations and the machine's restart period,
    over their time) interpolated in ``log2(m)``, times ``ns_rate_scale``. ``groups`` overrides
    ``machine.ns_groups`` (to cross-validate on a subset); ``steps`` is not used (a rate does not
    depend on how many iterations run)."""
    pts = []
    for gm, gn, gv, count, ms in (machine.ns_groups if groups is None else groups):
        if gv == variant:
            f = ns_cost(gm, gn, MEASURED_NS_STEPS, variant=gv, batch=count,
                        gram_restart=machine.ns_restart).flops
            pts.append((min(gm, gn), f / (ms * 1e-3)))
    if not pts:
        raise ValueError(f"no measured NS group of variant {variant!r} on {machine.name}")
    return interp_log2(pts, m) * machine.ns_rate_scale


def ns_matrix_seconds(machine: Machine, m: int, n: int, *, steps: int = 5, flops: Optional[int] = None,
                      groups: Optional[tuple] = None) -> float:
    """Seconds of the NS of one ``m x n`` matrix with ``steps`` iterations on ``machine`` (module
    docstring): a measured shape's time scaled by its flops at ``steps`` over those at
    :data:`MEASURED_NS_STEPS`; any other shape's flops at the interpolated rate. ``flops``
    replaces the whole matrix's count (a split piece's share), timed at the whole shape's rate."""
    s, l = min(m, n), max(m, n)
    cost = ns_cost(s, l, steps, variant="auto", gram_restart=machine.ns_restart)
    for gm, gn, gv, count, ms in (machine.ns_groups if groups is None else groups):
        if (min(gm, gn), max(gm, gn)) == (s, l) and flops is None:
            ratio = (ns_cost(s, l, steps, variant=gv, gram_restart=machine.ns_restart).flops
                     / ns_cost(s, l, MEASURED_NS_STEPS, variant=gv,
                               gram_restart=machine.ns_restart).flops)
            return ms * 1e-3 / count * ratio / machine.ns_rate_scale
    f = cost.flops if flops is None else flops
    return f / ns_rate(machine, s, cost.variant, steps=steps, groups=groups)
