"""Human- and machine-readable reports of an :class:`~dmuon.functional.plan.OwnerPlan`.

:func:`plan_summary` returns a JSON-serializable dict; :func:`plan_table` renders per-slot rows
(coordinate, NS cost, owned bytes, matrices) followed by the balance numbers.

Per-rank communication bytes per step (Z2 / Z3) come from the schedule accounting, not from the plan:
callers pass them in as ``comm_bytes_per_rank`` (``{"z2": [bytes per slot], "z3": [...]}``) and the
report shows them; without it the summary carries ``None`` and the table omits those columns.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from dmuon.functional.owner_plan import OwnerPlan

__all__ = ["strategy_rows", "strategy_table", "plan_summary", "plan_table", "format_bytes", "format_flops"]


def strategy_rows(plan: "OwnerPlan", specs: Sequence[Any]) -> list[dict[str, Any]]:
    """Per Muon matrix: where its Newton–Schulz runs and why, as data.

    Each row: ``name``, ``shape``, ``placement`` (``"owner"``: whole on one rank; ``"split"``: over
    ``k`` ranks of one node, :mod:`dmuon.functional.split_ns`), ``ranks`` (global ranks),
    ``ns_flops`` and ``bytes`` (of the whole matrix), ``cost_vs_mean`` (its plan cost over the mean
    rank cost: above 1 a whole matrix alone makes its rank the slowest), and ``reason``: for a split,
    its largest piece's cost over the mean rank cost after splitting; for a whole matrix, that
    splitting was not asked for (``max_split`` 1) or did not lower the largest rank cost.
    (Tensor-parallel matrices are sliced by TP before the plan sees them: each slice is a row.)
    """
    from dmuon.functional.plan_units import param_cost

    settings = plan.params
    mean = sum(plan.slot_costs) / max(len(plan.slot_costs), 1) or 1.0
    split = {sp.param: sp for sp in plan.splits}
    max_split = int(settings.get("max_split", 1) or 1)
    G = plan.shard_size
    rows = []
    for spec in specs:
        if spec.route != "muon":
            continue
        cost, flops, nbytes, _ = param_cost(spec, ns_steps=int(settings.get("ns_steps", 5)))
        row = {"name": spec.name, "shape": list(spec.shape), "ns_flops": flops, "bytes": nbytes,
               "cost_vs_mean": cost / mean}
        sp = split.get(spec.name)
        if sp is not None:
            piece = max(b.cost for b in sp.blocks)
            row.update(placement="split", k=sp.k, ranks=[b.slot for b in sp.blocks],
                       reason=f"whole it costs {cost / mean:.2f}x the mean rank; split {sp.k} ways "
                              f"its largest piece costs {piece / mean:.2f}x")
        else:
            s_, r_ = plan.owners[spec.name]
            row.update(placement="owner", k=1, ranks=[r_ * G + s_],
                       reason=("splitting not asked for (max_split 1)" if max_split <= 1 else
                               "splitting would not lower the largest rank cost"))
        rows.append(row)
    return rows


def strategy_table(rows: Sequence[Mapping[str, Any]], max_rows: Optional[int] = 40) -> str:
    """:func:`strategy_rows` as text, the most costly matrices first."""
    order = sorted(rows, key=lambda r: (-r["cost_vs_mean"], r["name"]))
    shown = order if max_rows is None else order[:max_rows]
    lines = [f"{'matrix':<48} {'shape':>13} {'placement':>10} {'ranks':>16} {'vs mean':>8}  reason"]
    for r in shown:
        ranks = ",".join(map(str, r["ranks"]))
        shape = "x".join(map(str, r["shape"]))
        where = r["placement"] if r["k"] == 1 else f"{r['placement']}/{r['k']}"
        lines.append(f"{r['name'][-48:]:<48} {shape:>13} {where:>10} {ranks[-16:]:>16} "
                     f"{r['cost_vs_mean']:>8.3f}  {r['reason']}")
    if len(order) > len(shown):
        lines.append(f"... {len(order) - len(shown)} more (the cheapest)")
    return "\n".join(lines)


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def format_flops(n: float) -> str:
    """``2.5e12 -> '2.50 TF'`` (decimal units)."""
    for unit, scale in (("PF", 1e15), ("TF", 1e12), ("GF", 1e9), ("MF", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} F"


def _check_comm(plan: "OwnerPlan", comm: Optional[Mapping[str, Sequence[int]]]) -> Optional[dict]:
    if comm is None:
        return None
    out = {}
    for mode, per_rank in comm.items():
        per_rank = [int(x) for x in per_rank]
        if len(per_rank) != plan.num_slots:
            raise ValueError(f"comm_bytes_per_rank[{mode!r}] has {len(per_rank)} entries; the plan has "
                             f"{plan.num_slots} ranks (G*R)")
        out[str(mode)] = per_rank
    return out


def _split_note() -> str:
    from dmuon.functional.split_plan import SPLIT_NOTE
    return SPLIT_NOTE


def plan_summary(plan: "OwnerPlan", *,
                 comm_bytes_per_rank: Optional[Mapping[str, Sequence[int]]] = None,
                 planning_seconds: Optional[float] = None) -> dict[str, Any]:
    """A plain dict describing ``plan``.

    Args:
      plan: the plan.
      comm_bytes_per_rank: optional ``{mode: [bytes per rank]}`` from the schedule accounting
        (e.g. ``{"z2": [...], "z3": [...]}``); stored under ``"comm_bytes_per_rank"`` (``None`` if absent).
      planning_seconds: optional wall time of ``plan_owners`` measured by the caller (plans themselves
        hold nothing time-dependent, so equal inputs give equal plans).

    Returns:
      dict with sizes, strategy, balance numbers, cost-model settings, fingerprint and per-slot rows.
    """
    n = plan.num_slots
    costs = plan.slot_costs
    total = sum(costs)
    cols = plan.column_costs
    col_mean = total / plan.shard_size if plan.shard_size else 0.0
    slots = []
    for k in range(n):
        s, r = plan.coord_of(k)
        slots.append({"slot": k, "shard": s, "replicate": r, "cost": costs[k],
                      "bytes": plan.slot_bytes[k], "matrices": plan.slot_matrices[k]})
    return {
        "shard_size": plan.shard_size,
        "replicate_size": plan.replicate_size,
        "slots": n,
        "strategy": plan.strategy,
        "num_params": len(plan.owners),
        "num_units": len(plan.units),
        "num_matrices": sum(plan.slot_matrices),
        "total_cost": total,
        "total_bytes": sum(plan.slot_bytes),
        "max_cost": max(costs) if costs else 0,
        "mean_cost": total / n if n else 0.0,
        "min_cost": min(costs) if costs else 0,
        "largest_unit_cost": plan.units[0].cost if plan.units else 0,
        "imbalance": plan.imbalance,
        "balance": plan.balance,
        "column_imbalance": (max(cols) / col_mean) if col_mean else 1.0,
        "lpt_max_cost": plan.lpt_max_cost,
        "round_robin_max_cost": plan.round_robin_max_cost,
        "layer_collisions": plan.layer_collisions,
        "settings": dict(plan.params),
        "fingerprint": plan.fingerprint,
        "planning_seconds": planning_seconds,
        # Filled by the schedule accounting (Z2 / Z3 bytes per rank per step); None until provided.
        "comm_bytes_per_rank": _check_comm(plan, comm_bytes_per_rank),
        "splits": [{"param": sp.param, "k": sp.k, "members": list(sp.members), "dim": sp.dim,
                    "variant": sp.variant} for sp in plan.splits],
        "split_note": _split_note() if plan.splits else None,
        "per_slot": slots,
    }


def plan_table(plan: "OwnerPlan", *,
               comm_bytes_per_rank: Optional[Mapping[str, Sequence[int]]] = None,
               planning_seconds: Optional[float] = None, max_rows: Optional[int] = None) -> str:
    """Per-slot table plus balance lines, as text.

    Args:
      plan: the plan.
      comm_bytes_per_rank: as in :func:`plan_summary`; adds one column per mode.
      planning_seconds: printed when given.
      max_rows: show at most this many slot rows (the most loaded first half, the least loaded last
        half) when the mesh is large; ``None`` shows all.
    """
    summ = plan_summary(plan, comm_bytes_per_rank=comm_bytes_per_rank, planning_seconds=planning_seconds)
    comm = summ["comm_bytes_per_rank"] or {}
    mean = summ["mean_cost"] or 1.0
    head = f"{'rank':>5} {'(s,r)':>9} {'NS+mem cost':>12} {'vs mean':>8} {'bytes':>11} {'#mat':>5}"
    for mode in comm:
        head += f" {mode.upper() + ' recv/step':>12}"
    rows = summ["per_slot"]
    shown = rows
    skipped = 0
    if max_rows is not None and len(rows) > max_rows:
        order = sorted(rows, key=lambda x: (-x["cost"], x["slot"]))
        keep = order[: (max_rows + 1) // 2] + order[len(order) - max_rows // 2:]
        shown = sorted(keep, key=lambda x: x["slot"])
        skipped = len(rows) - len(shown)
    lines = [f"OwnerPlan G={plan.shard_size} x R={plan.replicate_size} ({summ['slots']} ranks), "
             f"{summ['num_params']} dedicated params in {summ['num_units']} units, strategy={plan.strategy}",
             head, "-" * len(head)]
    for x in shown:
        line = (f"{x['slot']:>5} {'(%d,%d)' % (x['shard'], x['replicate']):>9} {format_flops(x['cost']):>12} "
                f"{x['cost'] / mean:>8.3f} {format_bytes(x['bytes']):>11} {x['matrices']:>5}")
        for mode, per in comm.items():
            line += f" {format_bytes(per[x['slot']]):>12}"
        lines.append(line)
    if skipped:
        lines.append(f"  ... {skipped} ranks not shown (max_rows={max_rows})")
    lines.append("-" * len(head))
    lines.append(f"total {format_flops(summ['total_cost'])}, {format_bytes(summ['total_bytes'])}, "
                 f"{summ['num_matrices']} matrices; largest unit {format_flops(summ['largest_unit_cost'])}")
    lines.append(f"max/mean (imbalance) {summ['imbalance']:.4f}; balance max/max(mean, largest unit) "
                 f"{summ['balance']:.4f}; column max/mean {summ['column_imbalance']:.4f}")
    lines.append(f"greedy max {format_flops(summ['lpt_max_cost'])} vs round-robin max "
                 f"{format_flops(summ['round_robin_max_cost'])}; same-layer collisions "
                 f"{summ['layer_collisions']}")
    if plan.splits:
        ks: dict[int, int] = {}
        for sp in plan.splits:
            ks[sp.k] = ks.get(sp.k, 0) + 1
        lines.append(f"split Newton-Schulz: {len(plan.splits)} matrices over k ranks of one node ("
                     + ", ".join(f"{c} x k={k}" for k, c in sorted(ks.items())) + "); "
                     + _split_note())
    if not comm:
        lines.append("comm bytes per rank (Z2/Z3): not computed here (schedule accounting)")
    if planning_seconds is not None:
        lines.append(f"planning time {planning_seconds * 1e3:.1f} ms")
    lines.append(f"fingerprint {plan.fingerprint}")
    return "\n".join(lines)
