"""Bytes per rank and lane of one training step as the runtime lays them out.

The stateful layer builds two bucket layouts from one plan (``dmuon/stateful/runtime/state.py``): the
unshard layout in each group's compute dtype, and the reduce layout in its reduce dtype with one
presence element per matrix (:mod:`dmuon.functional.buckets`). One step moves: the forward
unshard (Z3: and the backward re-unshard), the gradient reduce (both HSDP stages) and, with
``R > 1``, the post-step publish; split NS units add their ``"split"`` schedules
(:func:`~dmuon.newton_schulz.split.split_ns_schedule`). This is what the executor's counters
(``optimizer.last_step_stats()``, the demo's ``summary.json``) report, per rank and lane.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from dmuon.functional.buckets import HookGroups, bucket_layout, hook_groups
from dmuon.newton_schulz.cost import DEFAULT_GRAM_RESTART
from dmuon.functional.owner_plan import OwnerPlan
from dmuon.functional.schedule import Traffic, build_step_schedules, step_traffic
from dmuon.functional.specs import ParamSpec
from dmuon.newton_schulz.split import split_ns_schedule
from dmuon.functional.split_plan import owner_entries

__all__ = ["runtime_step_traffic", "step_bytes_per_rank"]


def runtime_step_traffic(plan: OwnerPlan, specs: Sequence[ParamSpec], *, reshard_after_forward: bool = True,
                         compute_dtype: str = "torch.float32", reduce_dtype: Optional[str] = None,
                         groups: Optional[HookGroups] = None, ns_steps: int = 5,
                         split_dtype: str = "torch.bfloat16") -> Traffic:
    """:class:`~dmuon.functional.schedule.Traffic` of one step (module docstring).

    Args:
      plan, specs: the owner plan and its specs.
      reshard_after_forward: the dedicated params' mode (True: Z3, re-gathered in backward).
      compute_dtype / reduce_dtype: dtypes of the unshard / reduce buckets (reduce: default the
        compute dtype), as ``str(torch dtype)``.
      groups: hook groups (default: by layer key, :func:`~dmuon.functional.buckets.hook_groups`).
      ns_steps, split_dtype: for split units' schedules (compute dtype of their gathers).
    """
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
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
    k = 2 if reshard_after_forward else 1
    for g in un.unshard:
        total = total + un.unshard[g].traffic().scaled(k) + red.reduce[g].traffic()
    total = total + un.publish.traffic()
    for sp in plan.splits:
        total = total + split_ns_schedule(
            sp.param, sp.layout, sp.members, G, R, steps=ns_steps, variant=sp.variant,
            gram_restart=DEFAULT_GRAM_RESTART if sp.variant == "gram" else None,
            dtype=split_dtype).traffic()
    return total


def step_bytes_per_rank(owners: Mapping[str, tuple[int, int]], shapes: Mapping[str, Sequence[int]],
                        dtypes: Mapping[str, str], shard_size: int, replicate_size: int = 1,
                        modes: Sequence[str] = ("z2", "z3")) -> dict[str, list[int]]:
    """Payload bytes each rank receives in one training step, per mode, from the schedule accounting.

    Builds the bucket layout of ``owners`` (one hook group per layer key) and sums
    :func:`step_traffic` over all lanes (the HSDP publish included). The mean over ranks of the
    shard-axis part is ``2(G-1)/G * P`` (Z2) and ``3(G-1)/G * P`` (Z3).

    Returns:
      ``{mode: [bytes received by global rank r*G + s]}``.
    """
    names = sorted(owners)
    layout = bucket_layout(owners, shapes, dtypes, hook_groups(names), shard_size, replicate_size)
    out: dict[str, list[int]] = {}
    for mode in modes:
        if mode not in ("z2", "z3"):
            raise ValueError(f"modes are 'z2' and 'z3' (report labels), got {mode!r}")
        traffic = step_traffic(layout, reshard_after_forward=(mode == "z3"))
        out[mode] = [traffic.rank_received(rank) for rank in range(layout.world_size)]
    return out
