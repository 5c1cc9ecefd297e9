"""Views of the step program's one byte count for offline planning: the program of an owner plan
(its split-NS units' schedules included) and the bytes each rank receives per step (the CLI, the
demo's plan table, the projector's validation, the DDP comparison read them). Every figure here is
:meth:`dmuon.functional.program.StepProgram.traffic`, i.e. :func:`dmuon.functional.schedule.op_bytes`
summed over the program's ops.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

from dmuon.functional.buckets import HookGroups, bucket_layout, hook_groups
from dmuon.functional.owner_plan import OwnerPlan
from dmuon.functional.program import StepProgram, step_program, step_traffic
from dmuon.functional.specs import ParamSpec

__all__ = ["plan_program", "step_bytes_per_rank"]


def plan_program(plan: OwnerPlan, specs: Sequence[ParamSpec], *, reshard_after_forward: bool = True,
                 compute_dtype: str = "torch.float32", reduce_dtype: Optional[str] = None,
                 groups: Optional[HookGroups] = None, ns_steps: int = 5,
                 split_dtype: str = "torch.bfloat16") -> StepProgram:
    """The :class:`StepProgram` of an owner plan with one compute and one reduce dtype for every
    matrix, its split-NS units' schedules included (the CLI, the demo's summary, the projector
    and the DDP comparison read their bytes from it).

    Args:
      plan, specs: the owner plan and its specs (split units use their own shapes).
      reshard_after_forward, groups: as :func:`step_program`.
      compute_dtype / reduce_dtype: ``str(torch dtype)`` (reduce: default the compute dtype).
      ns_steps, split_dtype: for split units' schedules (compute dtype of their gathers).
    """
    from dmuon.functional.split_exec import SplitSettings, split_step_schedule
    from dmuon.functional.split_plan import executed_entries
    from dmuon.newton_schulz.coefficients import ns_coefficient_table
    from dmuon.newton_schulz.cost import DEFAULT_GRAM_RESTART
    import torch

    owners, entries = executed_entries(plan, specs)     # as the optimizer places them
    shapes = {n: e[0] for n, e in entries.items()}
    prog = step_program(owners, shapes, {n: compute_dtype for n in shapes},
                        reduce_dtypes={n: reduce_dtype or compute_dtype for n in shapes},
                        shard_size=plan.shard_size, replicate_size=plan.replicate_size,
                        groups=groups if groups is not None else hook_groups(sorted(owners)),
                        reshard_after_forward=reshard_after_forward)
    G, R = plan.shard_size, plan.replicate_size
    table = tuple(ns_coefficient_table("polar_express", ns_steps))
    cdt = getattr(torch, split_dtype.replace("torch.", ""))
    splits = tuple(split_step_schedule(       # the executed split: scatter, program, gather
        sp, G, R, SplitSettings(table, sp.variant, DEFAULT_GRAM_RESTART if sp.variant == "gram"
                                else None, 1e-7, cdt, torch.float32), torch.float32)
        for sp in plan.splits)
    return dataclasses.replace(prog, splits=splits)


def step_bytes_per_rank(owners: Mapping[str, tuple[int, int]], shapes: Mapping[str, Sequence[int]],
                        dtypes: Mapping[str, str], shard_size: int, replicate_size: int = 1,
                        modes: Sequence[str] = ("z2", "z3"),
                        collectives: str = "per_owner") -> dict[str, list[int]]:
    """Payload bytes each rank receives in one step, per mode: a view of the step program's count
    (:func:`dmuon.functional.program.step_traffic` over one layout, one hook group per layer key,
    all lanes, the HSDP publish included; no presence elements). The mean over ranks of the
    shard-axis part is ``2(G-1)/G * P`` (Z2) and ``3(G-1)/G * P`` (Z3) per owner;
    ``collectives``: the groups' style (:mod:`dmuon.functional.collectives`; per bucket counts the
    padded parts).

    Returns:
      ``{mode: [bytes received by global rank r*G + s]}``.
    """
    layout = bucket_layout(owners, shapes, dtypes, hook_groups(sorted(owners)), shard_size,
                           replicate_size)
    out: dict[str, list[int]] = {}
    for mode in modes:
        if mode not in ("z2", "z3"):
            raise ValueError(f"modes are 'z2' and 'z3' (report labels), got {mode!r}")
        traffic = step_traffic(layout, reshard_after_forward=(mode == "z3"),
                               collectives=collectives)
        out[mode] = [traffic.rank_received(rank) for rank in range(layout.world_size)]
    return out
