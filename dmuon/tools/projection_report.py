"""Plain-data and text reports of step projections (:mod:`dmuon.tools.projection`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from dmuon.tools.machine import Machine
from dmuon.tools.projection import StepProjection, StepSetup
from dmuon.functional.split_plan import SPLIT_NOTE

__all__ = ["projection_summary", "projection_table", "machine_summary", "sensitivity",
           "SENSITIVE_CONSTANTS"]

#: The link constants a projection assumes (:meth:`Machine.with_values` names).
SENSITIVE_CONSTANTS = ("nvlink_busbw", "nvlink_alpha", "ib_busbw", "ib_alpha")


def machine_summary(machine: Machine) -> dict[str, Any]:
    """Every constant of ``machine`` with its source (JSON-ready)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(machine):
        if f.name == "sources":
            continue
        v = getattr(machine, f.name)
        out[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
    out["sources"] = dict(machine.sources)
    return out


def sensitivity(setup: StepSetup, machine: Machine, projections: Sequence[StepProjection], *,
                factors: tuple[float, float] = (0.5, 2.0)) -> dict[str, dict[str, list[float]]]:
    """``{design: {constant: [step ms at factors[0] x, at factors[1] x]}}`` for each latency and
    bandwidth constant of :data:`SENSITIVE_CONSTANTS` (the plan of each projection is kept)."""
    from dmuon.tools.projection import project_step

    out: dict[str, dict[str, list[float]]] = {}
    for p in projections:
        row: dict[str, list[float]] = {}
        for const in SENSITIVE_CONSTANTS:
            link, attr = const.split("_", 1)
            base = getattr(getattr(machine, link), attr)
            row[const] = [project_step(setup, machine.with_values(**{const: base * f}), p.design,
                                       plan=p.plan).step * 1e3 for f in factors]
        out[p.design] = row
    return out


def projection_summary(setup: StepSetup, machine: Machine,
                       projections: Sequence[StepProjection]) -> dict[str, Any]:
    """JSON-ready summary: the setup (with its global batch), the machine, and per design the
    phases (ms), the overhead over the ``"adamw"`` projection when present, exposed communication
    per lane (ms), the owners' phase and its imbalance, the plan's balance and split units, and
    the model-state memory."""
    base = next((p for p in projections if p.design == "adamw"), None)
    designs = {}
    for p in projections:
        d: dict[str, Any] = {
            "forward_ms": p.forward * 1e3, "backward_ms": p.backward * 1e3,
            "optimizer_ms": p.optimizer * 1e3, "step_ms": p.step * 1e3,
            "exposed_ms": {k: v * 1e3 for k, v in p.exposed.items() if v},
            "model_state_gb_per_rank": p.memory_bytes / 1e9,
            "fits_hbm_model_states_only": p.memory_bytes < machine.hbm_bytes,
        }
        if base is not None and p is not base:
            d["overhead_vs_adamw"] = p.step / base.step - 1.0
        if p.collective_styles:
            d["collective_styles"] = dict(p.collective_styles)
        if p.ns is not None:
            d["owners_phase_ms"] = p.ns.seconds * 1e3
            if setup.ns_overlap:
                d["owners_phase_hidden_ms"] = p.ns_hidden * 1e3
            d["ns_imbalance_max_over_mean"] = p.ns.imbalance
        if p.plan is not None:
            d["plan_imbalance_max_over_mean"] = p.plan.imbalance
            d["split_units"] = len(p.plan.splits)
            if p.plan.splits:
                d["split_k"] = sorted({sp.k for sp in p.plan.splits})
                d["split_note"] = SPLIT_NOTE
        designs[p.design] = d
    return {
        "model": setup.preset.name, "shard": setup.shard, "replicate": setup.replicate,
        "gpus": setup.world, "micro_batch": setup.micro_batch, "seq": setup.seq,
        "global_batch_tokens": setup.global_batch_tokens,
        "global_batch_sequences": setup.micro_batch * setup.world,
        "fsdp_reshard": setup.fsdp_reshard, "dmuon_reshard": setup.dmuon_reshard,
        "reduce_bytes": setup.reduce_bytes, "max_split": setup.max_split,
        "collectives": setup.collectives, "machine": machine.name, "designs": designs,
        "ns_overlap": (machine.ns_overlap_key if setup.ns_overlap else False),
    }


def projection_table(summary: Mapping[str, Any]) -> str:
    """The summary as text: one line per design, then exposed communication and the owners."""
    s = summary
    lines = [f"{s['model']} on {s['gpus']} {s['machine']} GPUs (G={s['shard']} x R={s['replicate']}), "
             f"micro-batch {s['micro_batch']} x seq {s['seq']}: global batch {s['global_batch_sequences']} "
             f"sequences = {s['global_batch_tokens']:,} tokens; FSDP2 "
             f"{'Z3' if s['fsdp_reshard'] else 'Z2'}, dmuon {'Z3' if s['dmuon_reshard'] else 'Z2'}, "
             f"collectives {s.get('collectives', 'per_owner')}",
             f"{'design':<10} {'forward':>9} {'backward':>9} {'optimizer':>9} {'step':>9} "
             f"{'overhead':>9} {'state GB':>9}"]
    for name, d in s["designs"].items():
        over = f"{d['overhead_vs_adamw'] * 100:+.2f}%" if "overhead_vs_adamw" in d else "-"
        mem = f"{d['model_state_gb_per_rank']:.1f}" + ("" if d["fits_hbm_model_states_only"] else "!")
        lines.append(f"{name:<10} {d['forward_ms']:>9.1f} {d['backward_ms']:>9.1f} "
                     f"{d['optimizer_ms']:>9.1f} {d['step_ms']:>9.1f} {over:>9} {mem:>9}")
    for name, d in s["designs"].items():
        ex = ", ".join(f"{k} {v:.1f}" for k, v in d["exposed_ms"].items()) or "none"
        lines.append(f"  {name}: exposed communication (ms): {ex}")
        if d.get("collective_styles"):
            lines.append(f"  {name}: hook groups per collective style: {d['collective_styles']}")
        if "owners_phase_ms" in d:
            lines.append(f"  {name}: owners' phase {d['owners_phase_ms']:.2f} ms, NS max/mean "
                         f"{d['ns_imbalance_max_over_mean']:.3f}; plan max/mean "
                         f"{d['plan_imbalance_max_over_mean']:.3f}, split units {d['split_units']}"
                         + (f" (k = {d['split_k']}; {d['split_note']})" if d.get("split_note") else ""))
        if "owners_phase_hidden_ms" in d:
            lines.append(f"  {name}: NS overlapped with the backward ({s['ns_overlap']} key): "
                         f"{d['owners_phase_hidden_ms']:.2f} ms of the owners' phase hidden")
    for name, rows in s.get("sensitivity", {}).items():
        step = s["designs"][name]["step_ms"]
        lo = min(v for r in rows.values() for v in r)
        hi = max(v for r in rows.values() for v in r)
        each = ", ".join(f"{k} {r[0] - step:+.1f}/{r[1] - step:+.1f}" for k, r in rows.items())
        lines.append(f"  {name}: step {lo:.1f} .. {hi:.1f} ms with each link constant at 1/2x and "
                     f"2x (ms change: {each})")
    if any(not d["fits_hbm_model_states_only"] for d in s["designs"].values()):
        lines.append("  ! model states alone exceed the GPU's memory")
    lines.append("  (model states only: params, grads, optimizer state, gathered layers; activations "
                 "are not modeled)")
    return "\n".join(lines)
