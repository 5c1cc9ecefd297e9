"""Which Newton–Schulz runs the owners' matrices (:class:`NSHook`: the functional core's batched
NS, or an :class:`~dmuon.kernels.ns_engine.NSEngine`), recording its calls for telemetry. Design
notes: docs/design/optimizer.md, "The Newton–Schulz hook"."""
from __future__ import annotations

from typing import Any, Optional

from dmuon.functional import muon as fmuon
from dmuon.kernels.ns_engine import NSEngine
from dmuon.newton_schulz.batched import BatchedNS
from dmuon.newton_schulz.config import NSConfig
from dmuon.newton_schulz.timing import NSTimer

__all__ = ["NSHook"]


class NSHook:
    """Builds each step's NS hook from the ``ns_engine`` choice (see :class:`dmuon.Muon`); gives
    ``telemetry`` its timer (``telemetry.ns_timer``)."""

    def __init__(self, choice: Any, telemetry: Any):
        self.check(choice)
        self.choice = choice
        self.timer = NSTimer()
        telemetry.ns_timer = self.timer
        self.engine: Optional[NSEngine] = choice if isinstance(choice, NSEngine) else None
        self._functional: Optional[BatchedNS] = None

    @staticmethod
    def check(choice: Any) -> None:
        """Raise ``ValueError`` unless ``choice`` is a valid ``ns_engine``."""
        if not (choice in ("auto", "engine", "functional") or isinstance(choice, NSEngine)):
            raise ValueError("ns_engine must be 'auto', 'engine', 'functional' or a "
                             f"dmuon.kernels.ns_engine.NSEngine, got {choice!r}")

    @property
    def mode(self) -> str:
        """How the last NS call ran (``"none"`` before any)."""
        return self.timer.mode

    def for_step(self, device_type: str, hp: fmuon.MuonHParams) -> fmuon.Orthogonalize:
        """The hook for one step with hyper-parameters ``hp`` on ``device_type``."""
        return self.for_config(device_type, NSConfig.from_hparams(hp))

    def for_config(self, device_type: str, config: NSConfig) -> fmuon.Orthogonalize:
        """The hook running Newton–Schulz with ``config`` on ``device_type`` (a variant's
        ``orthogonalize`` stage asks with its own :class:`~dmuon.newton_schulz.NSConfig`)."""
        if self.choice == "functional" or (self.choice == "auto" and device_type != "cuda"):
            if self._functional is None or self._functional.config != config:
                self._functional = BatchedNS(config, timer=self.timer)
            return self._functional
        if isinstance(self.choice, NSEngine):
            if tuple(self.choice.config[:4]) != tuple(config[:4]):  # the fields MuonHParams sets
                raise ValueError(
                    f"dmuon.Muon.step: the NSEngine given as ns_engine computes "
                    f"{self.choice.config} but this optimizer's NS hyper-parameters are {config}; "
                    "build the engine with NSEngine(dmuon.newton_schulz.NSConfig.from_hparams("
                    "opt.muon_hparams()), ...) or leave ns_engine='auto'")
        elif self.engine is None or self.engine.config != config:
            self.engine = NSEngine(config)
        self.engine.timer = self.timer
        return self.engine
