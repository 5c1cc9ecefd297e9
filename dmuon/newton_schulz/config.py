"""The settings of Newton–Schulz: one value, named as :class:`dmuon.functional.muon.MuonHParams`
names them, from the optimizer's hyper-parameters to the engine."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from dmuon.newton_schulz.coefficients import CoefficientSpec
from dmuon.newton_schulz.iteration import GramRestart

__all__ = ["NSConfig"]


class NSConfig(NamedTuple):
    """What Newton–Schulz computes (how it runs is the engine's: graphs, kernels, chunking).

    Attributes:
      ns_steps: iterations (exactly this many run).
      ns_coefficients: a named schedule or a table of ``(a, b, c)`` triples
        (:mod:`dmuon.newton_schulz.coefficients`).
      ns_eps: ``ε`` of the Frobenius normalization ``X / (‖X‖_F + ε)``.
      ns_dtype: compute dtype (``None``: :func:`~dmuon.newton_schulz.iteration.default_ns_dtype`
        of the device: fp16 on CUDA, fp32 on CPU).
      ns_gram_restart: Gram restart period (``"auto"``: 3 in fp16, else 2; ``None``: never).
      ns_safety: the Polar Express safety factor (other schedules ignore it).
    """

    ns_steps: int = 5
    ns_coefficients: CoefficientSpec = "polar_express"
    ns_eps: float = 1e-7
    ns_dtype: Optional[torch.dtype] = None
    ns_gram_restart: GramRestart = "auto"
    ns_safety: float = 1.01

    @classmethod
    def from_hparams(cls, hparams: Any) -> "NSConfig":
        """The NS settings of a :class:`~dmuon.functional.muon.MuonHParams` (same names; the
        fields it has not keep their defaults)."""
        return cls(**{f: getattr(hparams, f) for f in cls._fields if hasattr(hparams, f)})

    def iteration_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`~dmuon.newton_schulz.iteration.newton_schulz`."""
        return dict(steps=int(self.ns_steps), coefficients=self.ns_coefficients,
                    eps=float(self.ns_eps), dtype=self.ns_dtype, gram_restart=self.ns_gram_restart,
                    safety=float(self.ns_safety))

    def key(self) -> tuple:
        """A hashable identity (a coefficient table is a list)."""
        return (int(self.ns_steps), repr(self.ns_coefficients), float(self.ns_eps),
                self.ns_dtype, repr(self.ns_gram_restart), float(self.ns_safety))
