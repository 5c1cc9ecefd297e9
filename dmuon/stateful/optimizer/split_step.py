"""The optimizer's side of split Newton–Schulz: every rank runs, once per step and in the plan's
unit order, the split units it is a member of (:mod:`dmuon.functional.split_exec` holds the math
and the schedule; this module only feeds the executor).

The owner of a split matrix hands its NS input to :meth:`SplitStep.orthogonalizer` (the wrapper
of the optimizer's NS hook); the other members join in the same call or, when they have no NS of
their own this step, in :meth:`SplitStep.finish`. An owner whose split matrix has no gradient
this step sends zeros and drops the result (the members cannot know).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from dmuon.functional.schedule import Schedule
from dmuon.functional.split_exec import split_ns_settings, split_step_schedule, split_unit_rank
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
        self.units, schedules = [], []
        for sp in rt.plan.splits:
            unit = global_unit(sp, rt.plan, mg)
            xdt = _dtype(rt.master_dtype[sp.param])
            settings = split_ns_settings(config, sp.layout.m, sp.layout.n, xdt, self.device.type)
            sched = split_step_schedule(unit, rt.G, rt.R, settings, xdt)
            schedules.append(sched)
            if mg.rank in unit.members:
                one = {op.id: Schedule((dataclasses.replace(op, waits=()),), rt.G, rt.R)
                       for op in sched}
                self.units.append((unit, unit.members.index(mg.rank), sched, settings, xdt, one))
        self.schedules = tuple(schedules)
        self.owned = {u.param for u, i, *_ in self.units if i == 0}
        rt.split_schedules = self.schedules  # the step program's split phases
        if rt.program is not None:
            rt.program = dataclasses.replace(rt.program, splits=self.schedules)
        self._ran = False
        log.debug("dmuon split NS: %d units, rank %d is a member of %d (owner of %d)",
                  len(self.schedules), mg.rank, len(self.units), len(self.owned))

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

    def around(self, hparams: Any, owner_step: Callable[[], Any]) -> Any:
        """``owner_step()`` (the owner's Muon update, whose NS call runs the split units) as one
        step with split NS: :meth:`begin`, the step, :meth:`finish`."""
        self.begin(hparams)
        out = owner_step()
        self.finish()
        return out

    def finish(self) -> None:
        """Run this rank's units if no NS call of this step did (a member with no NS of its own)."""
        if not self._ran:
            self.run({})

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run every unit this rank is a member of, in unit order; ``inputs``: the owner's 2-D NS
        inputs by param name. Returns the owner's results for the names in ``inputs``."""
        self._ran = True
        out: dict[str, torch.Tensor] = {}
        for unit, index, sched, settings, xdt, one in self.units:
            x = None
            if index == 0:
                x = inputs.get(unit.param)
                if x is None:  # no gradient this step: the members still run the program
                    x = torch.zeros(unit.shape, dtype=xdt, device=self.device)
            gen = split_unit_rank(unit, sched, index, x, settings, input_dtype=xdt,
                                  device=self.device)
            try:
                op, buf = next(gen)
                while True:
                    self.executor.run(one[op.id], {op.bucket: buf})
                    op, buf = gen.send(None)
            except StopIteration as stop:
                if index == 0 and unit.param in inputs:
                    out[unit.param] = stop.value
        return out

    def orthogonalizer(self, inner: Callable[[list], Sequence[torch.Tensor]],
                       input_names: Sequence[str]) -> Callable[[list], list]:
        """``inner`` with the inputs of this rank's split matrices (named by ``input_names``, one
        per input) taken out and run through the split units first."""
        def run(xs: list) -> list:
            if len(xs) != len(input_names):
                raise RuntimeError(f"dmuon split NS: {len(xs)} NS inputs for {len(input_names)} "
                                   "names (internal error)")
            split = {n: i for i, n in enumerate(input_names) if n in self.owned}
            for n, i in split.items():
                if xs[i].dim() != 3 or xs[i].shape[0] != 1:
                    raise RuntimeError(f"dmuon split NS: {n!r} has NS input {tuple(xs[i].shape)}, "
                                       "not one matrix (internal error)")
            got = self.run({n: xs[i][0] for n, i in split.items()})
            plain = [i for i in range(len(xs)) if input_names[i] not in split]
            outs = list(inner([xs[i] for i in plain])) if plain else []
            result: list = [None] * len(xs)
            for k, i in enumerate(plain):
                result[i] = outs[k]
            for n, i in split.items():
                result[i] = got[n].unsqueeze(0)
            return result
        return run


def _dtype(d: Any) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    return getattr(torch, str(d).replace("torch.", ""))
