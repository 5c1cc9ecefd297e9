"""The ``orthogonalize`` hook of ``dmuon.Muon.step``: which Newton–Schulz runs the owners' matrices.

``ns_engine="functional"`` (or ``"auto"`` off CUDA): the functional core's batched NS
(:func:`dmuon.functional.muon.orthogonalize_batched`). Otherwise an
:class:`~dmuon.kernels.ns_engine.NSEngine` (the user's, checked against the optimizer's NS
hyper-parameters, or one built and kept for as long as they do not change) in place on the donated
gradient buckets. Either way the call is timed by the step's telemetry, and :attr:`NSHook.mode`
says how the last one ran (``"functional"``, ``"graph"``, ``"eager"``; ``"none"`` before any).
"""
from __future__ import annotations

from typing import Any, Optional

from dmuon.functional import muon as fmuon
from dmuon.newton_schulz.config import NSConfig
from dmuon.kernels.ns_engine import NSEngine

__all__ = ["NSHook"]


class NSHook:
    """Builds each step's NS hook from the ``ns_engine`` choice (see :class:`dmuon.Muon`)."""

    def __init__(self, choice: Any, telemetry: Any):
        if not (choice in ("auto", "engine", "functional") or isinstance(choice, NSEngine)):
            raise ValueError("ns_engine must be 'auto', 'engine', 'functional' or a "
                             f"dmuon.kernels.ns_engine.NSEngine, got {choice!r}")
        self.choice = choice
        self.telemetry = telemetry
        self.engine: Optional[NSEngine] = choice if isinstance(choice, NSEngine) else None
        self.mode = "none"

    def for_step(self, device_type: str, hp: fmuon.MuonHParams) -> fmuon.Orthogonalize:
        """The hook for one step with hyper-parameters ``hp`` on ``device_type``."""
        tel = self.telemetry
        config = NSConfig.from_hparams(hp)
        if self.choice == "functional" or (self.choice == "auto" and device_type != "cuda"):
            def functional(xs: list) -> list:
                tel.ns_begin()
                out = fmuon.orthogonalize_batched(xs, config)
                tel.ns_end()
                self.mode = "functional"
                return out
            return functional
        if isinstance(self.choice, NSEngine):
            if tuple(self.choice.config[:4]) != tuple(config[:4]):  # the fields MuonHParams sets
                raise ValueError(
                    f"dmuon.Muon.step: the NSEngine given as ns_engine computes "
                    f"{self.choice.config} but this optimizer's NS hyper-parameters are {config}; "
                    "build the engine with NSEngine(dmuon.newton_schulz.NSConfig.from_hparams("
                    "opt.muon_hparams()), ...) or leave ns_engine='auto'")
        elif self.engine is None or self.engine.config != config:
            self.engine = NSEngine(config)
        engine = self.engine

        def with_engine(xs: list) -> list:
            tel.ns_begin()
            out = engine.orthogonalize_(xs, batch_dims=1)
            tel.ns_end()
            self.mode = engine.last_mode
            return out
        return with_engine
