"""Bytes per rank and lane of one training step as the runtime lays them out.

The stateful layer builds two bucket layouts from one plan (``dmuon/stateful/state.py``): the
unshard layout in each group's compute dtype, and the reduce layout in its reduce dtype with one
presence element per matrix (:mod:`dmuon.functional.buckets`). One step moves: the forward
unshard (Z3: and the backward re-unshard), the gradient reduce (both HSDP stages) and, with
``R > 1``, the post-step publish; split NS units add their ``"split"`` schedules
(:func:`~dmuon.functional.split_ns.split_ns_schedule`). This is what the executor's counters
(``optimizer.last_step_stats()``, the demo's ``summary.json``) report, per rank and lane.
"""
from __future__ import annotations

from typing import Optional, Sequence

from dmuon.functional.buckets import HookGroups, bucket_layout, hook_groups
from dmuon.functional.ns_cost import DEFAULT_GRAM_RESTART
from dmuon.functional.plan import OwnerPlan
from dmuon.functional.schedule import Traffic, build_step_schedules
from dmuon.functional.specs import ParamSpec
from dmuon.functional.split_ns import split_ns_schedule
from dmuon.functional.split_plan import owner_entries

__all__ = ["runtime_step_traffic"]


def runtime_step_traffic(plan: OwnerPlan, specs: Sequence[ParamSpec], *, mode: str = "z3",
                         compute_dtype: str = "torch.float32", reduce_dtype: Optional[str] = None,
                         groups: Optional[HookGroups] = None, ns_steps: int = 5,
                         split_dtype: str = "torch.bfloat16") -> Traffic:
    """:class:`~dmuon.functional.schedule.Traffic` of one step (module docstring).

    Args:
      plan, specs: the owner plan and its specs.
      mode: ``"z2"`` or ``"z3"`` (``reshard_after_forward``).
      compute_dtype / reduce_dtype: dtypes of the unshard / reduce buckets (reduce: default the
        compute dtype), as ``str(torch dtype)``.
      groups: hook groups (default: by layer key, :func:`~dmuon.functional.buckets.hook_groups`).
      ns_steps, split_dtype: for split units' schedules (compute dtype of their gathers).
    """
    if mode not in ("z2", "z3"):
        raise ValueError(f"mode must be 'z2' or 'z3', got {mode!r}")
    entries = owner_entries(plan, specs)
    shapes = {n: e[0] for n, e in entries.items()}
    hg = groups if groups is not None else hook_groups(sorted(plan.owners))
    G, R = plan.shard_size, plan.replicate_size
    un = build_step_schedules(bucket_layout(plan.owners, shapes, {n: compute_dtype for n in shapes},
                                            hg, G, R))
    rd = reduce_dtype or compute_dtype
    red = build_step_schedules(bucket_layout(plan.owners, shapes, {n: rd for n in shapes}, hg, G, R,
                                             presence=True))
    total = Traffic.zero(G * R)
    k = 1 if mode == "z2" else 2
    for g in un.unshard:
        total = total + un.unshard[g].traffic().scaled(k) + red.reduce[g].traffic()
    total = total + un.publish.traffic()
    for sp in plan.splits:
        total = total + split_ns_schedule(
            sp.param, sp.layout, sp.members, G, R, steps=ns_steps, variant=sp.variant,
            gram_restart=DEFAULT_GRAM_RESTART if sp.variant == "gram" else None,
            dtype=split_dtype).traffic()
    return total
