"""Which split Newton–Schulz units a rank runs, built once from the plan and the optimizer's NS
settings (pure): each unit's step schedule, this rank's :class:`~dmuon.functional.split_exec.
SplitMember` of the units it is a member of, and what split NS does not run with
(:func:`check_split_support`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from dmuon.functional.split_exec import (SplitMember, split_member, split_ns_settings,
                                         split_step_schedule)
from dmuon.functional.specs import dtype_from_str
from dmuon.newton_schulz.config import NSConfig

__all__ = ["global_unit", "check_split_support", "check_split_config", "split_units"]


def global_unit(unit: Any, plan: Any, global_rank: Callable[[int, int], int]) -> Any:
    """``unit`` with its blocks' slots (``r * G + s``) as the global ranks of those coordinates
    (``global_rank(s, r)``)."""
    blocks = tuple(dataclasses.replace(b, slot=global_rank(*plan.coord_of(b.slot)))
                   for b in unit.blocks)
    return dataclasses.replace(unit, blocks=blocks)


def check_split_support(rt: Any, transform: Any) -> None:
    """Raise (on every rank alike: everything checked is the same everywhere) for what split NS
    does not run with (``rt``: ``plan.splits``, ``names``, ``matrices.hp_mults``)."""
    if not rt.plan.splits:
        return
    names = [sp.param for sp in rt.plan.splits]
    if transform is not None:
        raise NotImplementedError(
            f"dmuon.Muon(transform=...): the plan splits the Newton–Schulz of {names[:3]}, which "
            "only the built-in Muon update runs; dedicate_params(split_ns=1) for a variant chain")
    mults = {tuple(rt.matrices.hp_mults.get(n, (1.0, 1.0))) for n in rt.names}
    if len(mults) > 1:
        raise NotImplementedError(
            f"dmuon.Muon: split Newton–Schulz ({names[:3]}) with per-param lr / weight-decay "
            f"multipliers {sorted(mults)} is not supported; drop the multipliers or "
            "dedicate_params(split_ns=1)")


def check_split_config(built: NSConfig, hparams: Any) -> None:
    """Raise ``ValueError`` if a step's Muon hyper-parameters ``hparams`` have other NS settings
    than ``built``, those the split units' schedules were built for."""
    config = NSConfig.from_hparams(hparams)
    if config.key() != built.key():
        raise ValueError(
            "dmuon.Muon.step: the NS settings changed since dmuon.Muon was built "
            f"({built} -> {config}); the split units' schedules are built for the "
            "first. Keep ns_* fixed with split NS, or build a new dmuon.Muon")


def split_units(plan: Any, shard_size: int, replicate_size: int, config: NSConfig,
                master_dtype: Mapping[str, Any], device_type: str, rank: int,
                global_rank: Callable[[int, int], int]) -> tuple[tuple, list[SplitMember]]:
    """``(schedules, members)``: the step schedule of every unit of ``plan.splits`` (in plan
    order) and the :class:`~dmuon.functional.split_exec.SplitMember` of those global ``rank`` is
    a member of, their NS computed with ``config`` on ``device_type``."""
    members, schedules = [], []
    for sp in plan.splits:
        unit = global_unit(sp, plan, global_rank)
        xdt = dtype_from_str(master_dtype[sp.param])
        settings = split_ns_settings(config, sp.layout.m, sp.layout.n, xdt, device_type)
        sched = split_step_schedule(unit, shard_size, replicate_size, settings, xdt)
        schedules.append(sched)
        if rank in unit.members:
            members.append(split_member(unit, unit.members.index(rank), sched, settings, xdt))
    return tuple(schedules), members
