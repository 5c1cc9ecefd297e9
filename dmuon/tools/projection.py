"""Step-time projection: FSDP2 + AdamW against FSDP2 + dmuon on a model of the machine.

For a model preset, a mesh ``(R, G)``, a micro-batch and a sequence length, :func:`project_step`
builds the real owner plan (:func:`~dmuon.functional.plan.plan_owners`, split units included) and
the real schedules (:func:`~dmuon.functional.program.step_program`, split NS:
:func:`~dmuon.functional.split_ns.split_ns_schedule`), then times one steady-state step on a
:class:`~dmuon.tools.machine.Machine` with three serial resources per rank (every rank runs
the same program, so one rank's timeline stands for all, except in the owners' phase):

* ``compute``: per layer forward / backward (flops of :mod:`~dmuon.tools.model_flops` at the
  machine's MFU), the output head, the optimizer;
* ``shard`` link: FSDP2's all-gathers (bf16 params) and reduce-scatters of the params it manages
  (all of them for AdamW; the non-dedicated ones for dmuon), dmuon's forward / Z3 backward
  broadcasts and gradient reduces (one per bucket of the schedule, in schedule order; with
  ``collectives="per_bucket"`` one all-gather / reduce-scatter of ``G`` padded parts per group;
  with ``"grouped"`` each phase's per-owner ops as one launch: one latency plus their summed
  bytes, :func:`~dmuon.functional.collectives.unit_seconds`, the model ``"auto"`` weighs);
* ``replicate`` link (HSDP): FSDP2's replicate all-reduce of each gradient shard, dmuon's stage-2
  reduces and its post-step publish, which runs at the start of the next forward and gates each
  group's broadcast (as the hooks wait for it). Replicate-axis ops of dmuon run per shard column;
  the projected rank sits in the column with the most of them; the other columns' publishes,
  timed on their own links, gate their buckets' broadcasts (a wait counted as ``"unshard"``).

Ops run in program order on their resource; an op starts when its resource is free and its
dependencies are done. Forward: layer ``l``'s gathers wait for layer ``l - 2``'s compute (one layer
of prefetch, as FSDP2 and dmuon's hooks issue the next gather at the pre-forward), the compute of
``l`` for its gathers; backward: in reverse, Z3 re-gathers with one layer of prefetch, gradient
reduction after each layer's backward; the backward ends when the last gradient collective does
(the optimizer waits for them). Optimizer: AdamW over the rank's FSDP2 shard
(``adamw_s_per_param``); dmuon: the owners' phase of :func:`~dmuon.tools.ns_phase.ns_phase`
(its slowest rank) then fused AdamW over the shard of the non-dedicated params.

NS overlapped with the backward (``ns_overlap=True``, dmuon designs,
:mod:`~dmuon.tools.ns_overlap`): each rank's owner work of a hook group (its whole units' NS and
element-wise stages, :func:`~dmuon.tools.ns_phase.owner_work_by_group`) may start when the
group's reduce lands on the timeline; it progresses at the calibrated idle share of the GPU
while the backward computes and at the full rate where the compute waits or has ended; the
optimizer then finishes what is left on the slowest rank, then AdamW. Off (the default), the
owners' phase runs after the backward, as before.

Exposed communication of a lane = the time the compute resource waits for it (a wait is charged
to the dependency that finished last) plus, for the backward tail, the wait for the last gradient
collective; in the owners' phase, the slowest rank's finish minus its compute (``"split"``).

``design``: ``"adamw"``; ``"dmuon"`` (this implementation: its NS engine, fused element-wise
stages, split units when ``max_split > 1`` and they shorten the projected step: a split lowers the
owners' phase but adds buckets, hence broadcasts and reduces, to its layer); ``"reference"``
(dedicated ownership as in X-Square-Robot/dmuon 0.2.0: same schedules, its NS time = dmuon's x
``reference_slowdown``, element-wise work and AdamW at the baseline's AdamW rate, no splits).

Not modeled: activation memory and recomputation, CPU launch overhead, contention between the
shard and replicate links and between concurrent collectives of one link class beyond the
serialization above, NCCL's use of SMs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from dmuon.functional.buckets import hook_groups
from dmuon.functional.collectives import coalesced_units, unit_seconds
from dmuon.tools.machine import Machine, collective_time
from dmuon.tools.model_flops import head_forward_flops, layer_forward_flops
from dmuon.tools.ns_overlap import idle_share, overlap_key, overlapped_finish
from dmuon.tools.ns_phase import NSPhase, ns_phase, owner_work_by_group, reference_slowdown
from dmuon.functional.plan import OwnerPlan, plan_owners
from dmuon.tools.presets import ModelPreset, preset_specs
from dmuon.functional.program import step_program
from dmuon.functional.schedule import (Broadcast, Schedule, ShardAllGather, ShardBuckets,
                                       ShardCopy, ShardCopyGather, ShardCopyRefresh,
                                       ShardReduceScatter, op_bytes)
from dmuon.functional.split_plan import executed_entries

__all__ = ["StepSetup", "StepProjection", "TimelineOp", "project_step", "DESIGNS", "LANE_NAMES"]

DESIGNS = ("adamw", "dmuon", "reference")
LANE_NAMES = ("fsdp_all_gather", "fsdp_reduce_scatter", "fsdp_replicate", "unshard", "reduce",
              "replicate", "split")


@dataclass(frozen=True)
class StepSetup:
    """What is projected.

    Attributes:
      preset: the model; shard: ``G``; replicate: ``R``; micro_batch: sequences per rank;
      seq: tokens per sequence; fsdp_reshard: FSDP2's ``reshard_after_forward`` for its layers
      (True: Z3, re-gather in backward); dmuon_reshard: ``reshard_after_forward`` of the dedicated params (True: Z3);
      reduce_bytes: bytes per gradient element in reductions (4: fp32 ``reduce_dtype``, 2: bf16);
      max_split: split NS over up to this many ranks (dmuon design; 1: never); ns_steps.
      ns_overlap: owner NS overlapped with the backward (module docstring; needs
        ``max_split=1``: split units are not modeled overlapped).
      sharded_refresh: where the ``"sharded"`` style's copy refresh runs: ``"lazy"`` (what the
        runtime does: in front of each group's first forward gather) or ``"behind_ns"``
        (projected, not built: on the shard link during the owners' update, each group's after
        its NS, which needs the owners to update group by group; what does not fit in the NS
        phase but its first group's share spills into the next step, exposed).
      collectives: the dedicated groups' shard-axis style (``dedicate_params(collectives=...)``):
        ``"per_owner"`` (one broadcast / reduce per owner bucket), ``"per_bucket"`` (one padded
        all-gather / reduce-scatter per group), ``"grouped"`` (each phase's per-owner ops as
        one group call), ``"auto"`` (per group, by this machine's
        collective times: :func:`~dmuon.functional.collectives.choose_style`).
    """

    preset: ModelPreset
    shard: int
    replicate: int = 1
    micro_batch: int = 1
    seq: int = 4096
    fsdp_reshard: bool = True
    dmuon_reshard: bool = True
    reduce_bytes: int = 4
    max_split: int = 1
    ns_steps: int = 5
    collectives: str = "per_owner"
    ns_overlap: bool = False
    sharded_refresh: str = "lazy"

    @property
    def world(self) -> int:
        return self.shard * self.replicate

    @property
    def global_batch_tokens(self) -> int:
        return self.micro_batch * self.seq * self.world


@dataclass(frozen=True)
class TimelineOp:
    """One op of the projected timeline: resource, lane label, phase, start and end (seconds)."""

    name: str
    resource: str
    lane: str
    phase: str
    start: float
    end: float


@dataclass(frozen=True)
class StepProjection:
    """Projected step of one design.

    Attributes:
      design; forward, backward, optimizer, step: seconds (step = their sum);
      exposed: ``{lane: seconds the compute waited for it}``; ns: the owners' phase (dmuon
      designs) or None; plan: the owner plan (dmuon designs); timeline: every op;
      memory_bytes: model-state bytes on the fullest rank (params, grads, optimizer state, the
      gathered layers in flight; no activations).
      collective_styles: ``{style: hook groups moved in it}`` (dmuon designs).
      shard_bytes_per_rank: mean bytes a rank sends per step in dmuon's shard-axis gathers and
        reduces (the program's ``op_bytes``; per-bucket padding included; dmuon designs).
      ns_hidden: seconds of the owners' phase the overlap hid (``ns_overlap``; else 0).
    """

    design: str
    forward: float
    backward: float
    optimizer: float
    exposed: dict
    ns: Optional[NSPhase]
    plan: Optional[OwnerPlan]
    timeline: tuple[TimelineOp, ...] = field(repr=False)
    memory_bytes: float = 0.0
    collective_styles: dict = field(default_factory=dict)
    shard_bytes_per_rank: float = 0.0
    ns_hidden: float = 0.0

    @property
    def step(self) -> float:
        return self.forward + self.backward + self.optimizer


class _Timeline:
    def __init__(self) -> None:
        self.ops: list[TimelineOp] = []
        self.free = {"compute": 0.0, "shard": 0.0, "replicate": 0.0}
        self.exposed: dict[str, float] = {k: 0.0 for k in LANE_NAMES}
        self.last_compute = 0.0

    def add(self, name: str, resource: str, lane: str, phase: str, dur: float,
            deps: tuple = (), floor: float = 0.0) -> TimelineOp:
        ready = max([floor] + [d.end for d in deps if d is not None])
        start = max(self.free[resource], ready)
        if resource == "compute" and start > self.free["compute"] + 1e-15:
            waited = [d for d in deps if d is not None and d.resource != "compute"]
            if waited:
                culprit = max(waited, key=lambda d: d.end)
                self.exposed[culprit.lane] += start - max(self.free["compute"], floor)
        op = TimelineOp(name, resource, lane, phase, start, start + dur)
        self.free[resource] = op.end
        self.ops.append(op)
        if resource == "compute":
            self.last_compute = op.end
        return op


def _group_geometry(machine: Machine, setup: StepSetup) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((members per node, nodes) of a shard group, (...) of a replicate group)``."""
    g, r, gpn = setup.shard, setup.replicate, machine.gpus_per_node
    shard = (min(g, gpn), max(1, math.ceil(g / gpn)))
    if g >= gpn:
        rep = (1, r)
    else:
        per = max(1, gpn // g)
        rep = (min(r, per), max(1, math.ceil(r / per)))
    return shard, rep


def project_step(setup: StepSetup, machine: Machine, design: str, *,
                 plan: Optional[OwnerPlan] = None) -> StepProjection:
    """Project one training step of ``design`` (module docstring).

    Args:
      setup, machine, design: what, on what, which design.
      plan: the owner plan to time (dmuon designs); default: :func:`plan_owners` of the setup,
        which for ``design="dmuon"`` with ``max_split > 1`` keeps the candidate (split or whole)
        whose projected step is shortest.
    """
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    if not isinstance(setup.dmuon_reshard, bool):
        raise TypeError(f"dmuon_reshard must be a bool, got {setup.dmuon_reshard!r}")
    if setup.ns_overlap and setup.max_split > 1 and design != "adamw":
        raise ValueError("ns_overlap models whole-matrix Newton-Schulz overlapped with the "
                         "backward; split units are not modeled overlapped: pass max_split=1 "
                         f"(--max-split 1), got max_split={setup.max_split}")
    p = setup.preset
    specs = preset_specs(p)
    dedicated = design != "adamw"
    G, R = setup.shard, setup.replicate
    (sh_pn, sh_nodes), (rep_pn, rep_nodes) = _group_geometry(machine, setup)

    def coll(kind: str, nbytes: float, axis: str) -> float:
        if axis == "shard":
            return collective_time(machine, kind, nbytes, G, members_per_node=sh_pn, nodes=sh_nodes)
        return collective_time(machine, kind, nbytes, R, members_per_node=rep_pn, nodes=rep_nodes)

    def op_time(op) -> float:
        """A dedicated op's seconds on this machine (its payload: the op's bytes; a per-bucket op
        moves ``G`` padded parts; a replicate-axis op runs on the replicate group)."""
        if op.axis == "replicate":
            return coll("broadcast" if isinstance(op, Broadcast) else "reduce", op.nbytes,
                        "replicate")
        if isinstance(op, ShardBuckets):
            kind = "all_gather" if isinstance(op, ShardAllGather) else "reduce_scatter"
            return coll(kind, G * op.nbytes, "shard")
        if isinstance(op, ShardCopyGather):  # the sharded copy: G equal parts
            return coll("all_gather", G * op.nbytes, "shard")
        if isinstance(op, ShardCopyRefresh):  # an all-to-all: its busiest member's bytes
            return coll("broadcast", max(max(op_bytes(op, i, G)) for i in range(G)), "shard")
        return coll("broadcast" if isinstance(op, Broadcast) else "reduce", op.nbytes, "shard")

    def shard_time(unit: tuple) -> float:
        """A launch's seconds: one op's, or a group call's (one latency, the summed bytes)."""
        return unit_seconds(unit, lambda op, n: op_time(op), G)

    # params FSDP2 manages, per layer and for the root unit
    fsdp_layer = [0] * p.layers
    fsdp_root = 0
    for s in specs:
        if dedicated and s.route == "muon":
            continue
        if s.layer_key is None:
            fsdp_root += s.numel
        else:
            fsdp_layer[int(s.layer_key.rsplit(".", 1)[1])] += s.numel
    nsp = None
    ns_hidden = 0.0
    shard_bytes = refresh_s = 0.0
    styles: dict[str, int] = {}
    groups: dict[int, tuple[list, list, list]] = {}
    if dedicated:
        if plan is None:
            score = None
            if design == "dmuon" and setup.max_split > 1:
                def score(q):
                    return project_step(setup, machine, design, plan=q).step
            plan = plan_owners(specs, G, R, ns_steps=setup.ns_steps,
                               max_split=setup.max_split if design == "dmuon" else 1,
                               node_size=machine.gpus_per_node, split_score=score)
        owners, entries = executed_entries(plan, specs)     # as the optimizer places them
        shapes = {n: e[0] for n, e in entries.items()}
        red_dt = "torch.float32" if setup.reduce_bytes == 4 else "torch.bfloat16"
        bf16 = {n: "torch.bfloat16" for n in shapes}
        # "auto" weighs this machine's collective times; FSDP2's root reduce-scatter follows
        # the last group's reduce on the shard link (it hides that much replicate-axis wait)
        cost = _MachineCost(op_time, coll("reduce_scatter", setup.reduce_bytes * fsdp_root,
                                          "shard") if fsdp_root else 0.0)
        prog = step_program(owners, shapes, bf16, reduce_dtypes={n: red_dt for n in shapes},
                            master_dtypes=bf16, shard_size=G, replicate_size=R,
                            groups=hook_groups(sorted(owners)),
                            reshard_after_forward=setup.dmuon_reshard,
                            collectives=setup.collectives, cost=cost)
        for g, ph in prog.groups.items():
            layer = int(g.rsplit(".", 1)[1])
            if setup.sharded_refresh == "behind_ns":  # (timed below, in the owners' phase)
                refresh_s += sum(shard_time(u) for u in coalesced_units(ph.refresh))
            lazy = ph.unshard if setup.sharded_refresh == "behind_ns" else ph.refreshed_unshard
            groups[layer] = (coalesced_units(lazy), coalesced_units(ph.reduce),
                             coalesced_units(ph.publish),  # launches: group calls are one
                             coalesced_units(ph.unshard))  # (the forward's: after a refresh)
            styles[ph.collectives] = styles.get(ph.collectives, 0) + 1
        shard_ops = tuple(op for op in prog.step_schedule() if op.axis == "shard")
        shard_bytes = Schedule(shard_ops, G, 1).traffic().mean_sent(["unshard", "reduce"])
        slow = reference_slowdown(machine, p.hidden) if design == "reference" else 1.0
        ew = machine.adamw_s_per_param if design == "reference" else machine.fused_s_per_param
        nsp = ns_phase(plan, specs, machine, steps=setup.ns_steps, slowdown=slow,
                       elementwise_s_per_param=ew)
    tokens = setup.micro_batch * setup.seq
    fwd_rate = machine.peak_flops * machine.mfu("fwd", p.hidden)
    bwd_rate = machine.peak_flops * machine.mfu("bwd", p.hidden)
    f_layer = layer_forward_flops(p, setup.seq, tokens) / fwd_rate
    b_layer = 2 * layer_forward_flops(p, setup.seq, tokens) / bwd_rate
    f_head = head_forward_flops(p, tokens) / fwd_rate
    b_head = 2 * head_forward_flops(p, tokens) / bwd_rate
    tl = _Timeline()
    z3_dmuon = setup.dmuon_reshard

    # -- forward. HSDP: the previous step's publish runs first, column by column on the
    # replicate links; a bucket's broadcast waits for its column's publish of that group. This
    # rank sits in the column with the most replicate traffic (its publish and stage-2 reduces
    # are on its timeline; the other columns' publishes only gate their broadcasts).
    col_bytes = [0] * G
    for units in groups.values():
        for op in (op for u in units[1] + units[2] for op in u):
            if op.axis == "replicate":
                col_bytes[op.at] += op.nbytes
    my_col = max(range(G), key=lambda c: (col_bytes[c], -c))
    gate: dict[tuple[int, int], float] = {}
    col_t = [0.0] * G
    def rep_time(kind: str, unit: tuple) -> float:
        return unit_seconds(unit, lambda op, n: coll(kind, op.nbytes, "replicate"), R)

    for layer in sorted(groups):
        for unit in groups[layer][2]:
            at = unit[0].at
            col_t[at] += rep_time("broadcast", unit)
            gate[(layer, at)] = col_t[at]
            if at == my_col:
                tl.add(f"publish L{layer}", "replicate", "replicate", "forward",
                       rep_time("broadcast", unit))
    root_ag = tl.add("fsdp AG root", "shard", "fsdp_all_gather", "forward",
                     coll("all_gather", 2 * fsdp_root, "shard")) if fsdp_root else None
    fwd: list = [None] * p.layers
    gathers: list[list] = [[] for _ in range(p.layers)]

    def issue_gathers(layer: int, phase: str, after) -> None:
        ops = []
        if fsdp_layer[layer]:
            ops.append(tl.add(f"fsdp AG L{layer}", "shard", "fsdp_all_gather", phase,
                              coll("all_gather", 2 * fsdp_layer[layer], "shard"), (after,)))
        for unit in groups.get(layer, ([], [], [], []))[0]:
            cols = [k.column for op in unit for k in (
                op.keys if isinstance(op, (ShardBuckets, ShardCopy)) else (op.bucket,))
                if k is not None]
            # an all-gather (or a group call) waits for every column's publish
            ops.append(tl.add(f"{_label(unit)} L{layer}", "shard", "unshard", phase,
                              shard_time(unit), (after,),
                              floor=max(gate.get((layer, c), 0.0) for c in cols)))
        gathers[layer] = ops

    for layer in range(min(2, p.layers)):
        issue_gathers(layer, "forward", None)
    prev = root_ag
    for layer in range(p.layers):
        if layer >= 1 and layer + 1 < p.layers:
            issue_gathers(layer + 1, "forward", fwd[layer - 1])
        fwd[layer] = tl.add(f"F L{layer}", "compute", "compute", "forward", f_layer,
                            tuple(gathers[layer]) + (prev, root_ag))
        prev = fwd[layer]
    head_f = tl.add("F head", "compute", "compute", "forward", f_head, (prev, root_ag))
    t_forward = head_f.end

    # -- backward
    head_b = tl.add("B head", "compute", "compute", "backward", b_head, (head_f,))
    tail: list = []
    bwd: list = [None] * p.layers

    def issue_regather(layer: int, after) -> None:
        ops = []
        if setup.fsdp_reshard and fsdp_layer[layer]:
            ops.append(tl.add(f"fsdp AG' L{layer}", "shard", "fsdp_all_gather", "backward",
                              coll("all_gather", 2 * fsdp_layer[layer], "shard"), (after,)))
        if z3_dmuon:
            for unit in groups.get(layer, ([], [], [], []))[3]:
                ops.append(tl.add(f"{_label(unit)}' L{layer}", "shard", "unshard", "backward",
                                  shard_time(unit), (after,)))
        gathers[layer] = ops

    last = p.layers - 1
    for layer in (last, last - 1):
        if layer >= 0:
            issue_regather(layer, head_f)
    prev = head_b
    landed: dict[int, float] = {}   # when each layer's reduce is done on this rank's timeline
    for layer in range(last, -1, -1):
        if layer - 1 >= 0 and layer < last:
            issue_regather(layer - 1, bwd[layer + 1])
        bwd[layer] = tl.add(f"B L{layer}", "compute", "compute", "backward", b_layer,
                            tuple(gathers[layer]) + (prev,))
        prev = bwd[layer]
        landed[layer] = bwd[layer].end   # its gradients exist; its reduce (below) lands later
        if fsdp_layer[layer]:
            rs = tl.add(f"fsdp RS L{layer}", "shard", "fsdp_reduce_scatter", "backward",
                        coll("reduce_scatter", setup.reduce_bytes * fsdp_layer[layer], "shard"),
                        (bwd[layer],))
            tail.append(rs)
            if R > 1:
                tail.append(tl.add(f"fsdp AR L{layer}", "replicate", "fsdp_replicate", "backward",
                                   coll("all_reduce", setup.reduce_bytes * fsdp_layer[layer] / G,
                                        "replicate"), (rs,)))
        for unit in groups.get(layer, ([], [], [], []))[1]:
            if unit[0].lane == "reduce":
                st1 = tl.add(f"{_label(unit)} L{layer}", "shard", "reduce", "backward",
                             shard_time(unit), (bwd[layer],))
                tail.append(st1)
            elif unit[0].at == my_col:
                tail.append(tl.add(f"reduce2 L{layer}", "replicate", "replicate", "backward",
                                   rep_time("reduce", unit), (st1,)))
            landed[layer] = max(landed.get(layer, 0.0), tail[-1].end)
    if fsdp_root:
        rs = tl.add("fsdp RS root", "shard", "fsdp_reduce_scatter", "backward",
                    coll("reduce_scatter", setup.reduce_bytes * fsdp_root, "shard"), (prev,))
        tail.append(rs)
        if R > 1:
            tail.append(tl.add("fsdp AR root", "replicate", "fsdp_replicate", "backward",
                               coll("all_reduce", setup.reduce_bytes * fsdp_root / G, "replicate"), (rs,)))
    end = max([prev.end] + [t.end for t in tail])
    if tail and end > prev.end:
        tl.exposed[max(tail, key=lambda t: t.end).lane] += end - prev.end
    t_backward = end - t_forward

    # -- optimizer
    shard_params = (sum(fsdp_layer) + fsdp_root) / G
    if design == "adamw":
        t_opt = machine.adamw_step_s + machine.adamw_s_per_param * shard_params
        tl.add("AdamW", "compute", "compute", "optimizer", t_opt, floor=end)
    else:
        rate = machine.adamw_s_per_param if design == "reference" else machine.fused_s_per_param
        fixed = machine.adamw_step_s if design == "reference" else 0.0
        worst = max(range(len(nsp.finish)), key=lambda r: nsp.finish[r])
        tl.exposed["split"] += nsp.finish[worst] - nsp.compute[worst]
        t_owners = nsp.seconds
        if setup.ns_overlap:
            t_owners = _overlapped_owners(setup, machine, plan, specs, design, tl, landed, end,
                                          tokens, b_layer)
            ns_hidden = nsp.seconds - t_owners
        tl.add("owners: NS + Muon", "compute", "compute", "optimizer", t_owners, floor=end)
        spill = max(0.0, refresh_s - t_owners * (1 - 1 / max(1, len(groups))))
        if spill > 0:  # the next forward's first gather waits for the refreshes' rest
            tl.add("copy refresh (behind NS)", "shard", "unshard", "optimizer", spill,
                   floor=end + t_owners)
        t_rest = fixed + rate * shard_params
        tl.add("AdamW (rest)", "compute", "compute", "optimizer", t_rest, floor=end + t_owners)
        t_opt = max(t_owners + t_rest, t_owners + spill)  # (AdamW runs beside the spill)
        tl.exposed["unshard"] += max(0.0, spill - t_rest)
    mem = _memory(setup, specs, plan, fsdp_layer, fsdp_root)
    return StepProjection(design, t_forward, t_backward, t_opt, dict(tl.exposed), nsp, plan,
                          tuple(tl.ops), mem, styles, shard_bytes, ns_hidden)


def _overlapped_owners(setup: StepSetup, machine: Machine, plan: OwnerPlan, specs, design: str,
                       tl: _Timeline, landed: dict, end: float, tokens: int,
                       b_layer: float) -> float:
    """Seconds after the backward's end until the slowest rank's overlapped owner work is done
    (module docstring; :mod:`~dmuon.tools.ns_overlap`)."""
    slow = reference_slowdown(machine, setup.preset.hidden) if design == "reference" else 1.0
    ew = machine.adamw_s_per_param if design == "reference" else machine.fused_s_per_param
    work = owner_work_by_group(plan, specs, machine, steps=setup.ns_steps, slowdown=slow,
                               elementwise_s_per_param=ew)
    busy = [(o.start, o.end) for o in tl.ops if o.resource == "compute" and o.phase == "backward"]
    idle = idle_share(machine, overlap_key(machine, tokens, b_layer))
    finish = end
    for per_group in work:
        at: dict[float, float] = {}
        for key, sec in per_group.items():
            t = landed.get(int(key.rsplit(".", 1)[1]), end) if key else end
            at[t] = at.get(t, 0.0) + sec
        finish = max(finish, overlapped_finish(at, busy, idle))
    return finish - end


@dataclass(frozen=True)
class _MachineCost:
    """``"auto"``'s cost on the projected machine (the protocol of
    :class:`~dmuon.functional.collectives.LinkCost`): an op's seconds, and the shard-link seconds
    of FSDP2's root reduce-scatter after the step's last dedicated reduce."""

    op_time: object
    shard_tail_s: float

    def seconds(self, op, n: int) -> float:
        return self.op_time(op)


def _label(unit: tuple) -> str:
    op = unit[0]
    if op.coalesce:  # a grouped phase's launch
        return "all-gather-v" if isinstance(op, Broadcast) else "reduce-v"
    return {ShardAllGather: "all-gather", ShardReduceScatter: "reduce-scatter",
            ShardCopyGather: "all-gather of the copies", ShardCopyRefresh: "copy refresh",
            Broadcast: "broadcast"}.get(type(op), "reduce")


def _memory(setup: StepSetup, specs, plan: Optional[OwnerPlan], fsdp_layer, fsdp_root) -> float:
    """Model-state bytes on the fullest rank: FSDP2 shards at 16 B/param (fp32 param, grad, two
    moments), two gathered bf16 layers; dedicated params: the fp32 masters of the rank's shard
    column (HSDP keeps them on every rank of the column) and, for the params it owns, fp32
    momentum and gradient (8 B)."""
    G = setup.shard
    fsdp = 16 * (sum(fsdp_layer) + fsdp_root) / G
    per_layer = [0] * setup.preset.layers
    for s in specs:
        if s.layer_key is not None:
            per_layer[int(s.layer_key.rsplit(".", 1)[1])] += s.numel
    gathered = 2 * 2 * max(per_layer)
    dedicated = 0.0
    if plan is not None:
        by = {s.name: s for s in specs}
        owned = [0] * plan.num_slots
        for u, slot in zip(plan.units, plan.unit_slots):
            owned[slot] += sum(by[n].numel for n in u.params if n in by)
        for sp in plan.splits:  # executed: the whole matrix on its block 0's rank
            owned[sp.blocks[0].slot] += math.prod(sp.shape)
        column = [sum(owned[r * G + c] for r in range(setup.replicate)) for c in range(G)]
        dedicated = max(4 * column[k % G] + 8 * owned[k] for k in range(plan.num_slots))
    return fsdp + gathered + dedicated
