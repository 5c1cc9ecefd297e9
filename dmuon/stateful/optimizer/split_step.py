"""This rank's split Newton–Schulz units (:class:`SplitStep`): built once from the plan and the
optimizer's NS settings, run through the executor by the pure
:mod:`dmuon.functional.split_exec`. Design notes: docs/design/optimizer.md, "Split
Newton–Schulz on the owners"."""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from dmuon.functional.split_exec import run_split_units
from dmuon.functional.split_units import check_split_config, check_split_support, split_units
from dmuon.newton_schulz.config import NSConfig

log = logging.getLogger(__name__)

__all__ = ["SplitStep", "check_split_support"]


class SplitStep:
    """This rank's split units (see the module docstring).

    Args:
      rt: the model's dedicated state (its plan has ``splits``); transform: the user's chain
        (``None``: Muon), refused (:func:`check_split_support`); hparams: the optimizer's Muon
        hyper-parameters at construction (a later change of their NS settings raises at
        ``step()``).
    """

    def __init__(self, rt: Any, transform: Any, hparams: Any):
        check_split_support(rt, transform)
        mg = rt.mesh_groups
        self.executor, self.device = rt.executor, rt.device
        self.config = config = NSConfig.from_hparams(hparams)
        self.schedules, self.members = split_units(rt.plan, rt.G, rt.R, config, rt.master_dtype,
                                                   self.device.type, mg.rank, mg.global_rank)
        self.owned = {m.unit.param for m in self.members if m.index == 0}
        self._ran = False
        log.debug("dmuon split NS: %d units, rank %d is a member of %d (owner of %d)",
                  len(self.schedules), mg.rank, len(self.members), len(self.owned))

    def begin(self, hparams: Any) -> None:
        """Start a step (``hparams``: its Muon hyper-parameters; their NS settings must be the
        construction's: :func:`~dmuon.functional.split_units.check_split_config`)."""
        check_split_config(self.config, hparams)
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

