"""This rank's split Newton–Schulz units (:class:`SplitStep`): built once from the plan and the
optimizer's NS settings, run through the executor by the pure
:mod:`dmuon.functional.split_exec`. Design notes: docs/design/optimizer.md, "Split
Newton–Schulz on the owners"."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from dmuon.functional.split_exec import (run_split_units, split_member, split_ns_settings,
                                         split_orthogonalizer, split_step_schedule)
from dmuon.newton_schulz.config import NSConfig

log = logging.getLogger(__name__)

__all__ = ["SplitStep", "global_unit", "check_split_support", "split_step"]


def global_unit(unit: Any, plan: Any, mesh_groups: Any) -> Any:
    """``unit`` with its blocks' slots (``r * G + s``) as the global ranks of those coordinates."""
    blocks = tuple(dataclasses.replace(b, slot=mesh_groups.global_rank(*plan.coord_of(b.slot)))
                   for b in unit.blocks)
    return dataclasses.replace(unit, blocks=blocks)


def check_split_support(rt: Any, transform: Any) -> None:
    """Raise (on every rank alike: everything checked is the same everywhere) for what split NS
    does not run with."""
    if not rt.plan.splits:
        return
    names = [sp.param for sp in rt.plan.splits]
    if transform is not None:
        raise NotImplementedError(
            f"dmuon.Muon(transform=...): the plan splits the Newton–Schulz of {names[:3]}, which "
            "only the built-in Muon update runs; dedicate_params(split_ns=1) for a variant chain")
    mults = {tuple(rt.hp_mults.get(n, (1.0, 1.0))) for n in rt.names}
    if len(mults) > 1:
        raise NotImplementedError(
            f"dmuon.Muon: split Newton–Schulz ({names[:3]}) with per-param lr / weight-decay "
            f"multipliers {sorted(mults)} is not supported; drop the multipliers or "
            "dedicate_params(split_ns=1)")


def split_step(rt: Any, transform: Any, hparams: Any) -> Optional["SplitStep"]:
    """The :class:`SplitStep` of ``rt``'s plan (``None`` without split units); raises for what
    split NS does not run with (:func:`check_split_support`)."""
    if not rt.plan.splits:
        return None
    check_split_support(rt, transform)
    return SplitStep(rt, NSConfig.from_hparams(hparams))


class SplitStep:
    """This rank's split units (see the module docstring).

    Args:
      rt: the model's dedicated state (its plan has ``splits``); config: the optimizer's NS
        settings at construction (a later change of them raises at ``step()``).
    """

    def __init__(self, rt: Any, config: NSConfig):
        mg = rt.mesh_groups
        self.rt, self.executor, self.config = rt, rt.executor, config
        self.device = rt.device
        self.members, schedules = [], []
        for sp in rt.plan.splits:
            unit = global_unit(sp, rt.plan, mg)
            xdt = _dtype(rt.master_dtype[sp.param])
            settings = split_ns_settings(config, sp.layout.m, sp.layout.n, xdt, self.device.type)
            sched = split_step_schedule(unit, rt.G, rt.R, settings, xdt)
            schedules.append(sched)
            if mg.rank in unit.members:
                self.members.append(split_member(unit, unit.members.index(mg.rank), sched,
                                                 settings, xdt))
        self.schedules = tuple(schedules)
        self.owned = {m.unit.param for m in self.members if m.index == 0}
        self._ran = False
        log.debug("dmuon split NS: %d units, rank %d is a member of %d (owner of %d)",
                  len(self.schedules), mg.rank, len(self.members), len(self.owned))

    def begin(self, hparams: Any) -> None:
        """Start a step (``hparams``: its Muon hyper-parameters; their NS settings must be the
        construction's)."""
        config = NSConfig.from_hparams(hparams)
        if config.key() != self.config.key():
            raise ValueError(
                "dmuon.Muon.step: the NS settings changed since dmuon.Muon was built "
                f"({self.config} -> {config}); the split units' schedules are built for the "
                "first. Keep ns_* fixed with split NS, or build a new dmuon.Muon")
        self._ran = False

    def finish(self) -> None:
        """Run this rank's units if no NS call of this step did (a member with no NS of its own)."""
        if not self._ran:
            self.run({})

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run every unit this rank is a member of, in unit order, through the executor
        (:func:`dmuon.functional.split_exec.run_split_units`)."""
        self._ran = True
        return run_split_units(self.members, inputs, self.executor.run, self.device)

    def orthogonalizer(self, inner: Callable[[list], Sequence[torch.Tensor]],
                       input_names: Sequence[str]) -> Callable[[list], list]:
        """``inner`` with the inputs of this rank's split matrices run through the split units
        first (:func:`dmuon.functional.split_exec.split_orthogonalizer`)."""
        return split_orthogonalizer(inner, input_names, self.owned, self.run)


def _dtype(d: Any) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    return getattr(torch, str(d).replace("torch.", ""))
