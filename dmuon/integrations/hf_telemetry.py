"""``Muon.last_step_stats()`` in HF ``Trainer``'s logs, beside ``loss`` / ``grad_norm``.

For a dmuon model, ``Trainer.train`` gets :class:`DmuonTelemetryCallback` (added once, by the
integration). At every optimizer step where Trainer will log (``control.should_log``, set by
Trainer's ``DefaultFlowCallback`` before ours runs, identically on every rank) the callback gathers
each rank's last-step stats over the default process group (one small ``all_gather_object``) and
keeps the entries; the wrapped ``Trainer.log`` adds them to that step's training log, so they reach
``trainer.state.log_history`` and every ``report_to`` backend (TensorBoard, W&B, ...). Like
``grad_norm``, they describe the last optimizer step before the log:

* ``dmuon_ns_ms``: the slowest rank's Newton–Schulz wall time in that ``step()`` (ms; CUDA events
  on GPU, the host clock on CPU; 0 on a rank that owns nothing);
* ``dmuon_ns_imbalance``: max / mean of the ranks' NS ms (1.0 = perfectly balanced);
* ``dmuon_comm_bytes``: the largest per-rank payload sent + received by dmuon's collectives since
  the previous step (forward gathers, backward reduces of every micro-batch, HSDP publish);
* ``dmuon_owned_imbalance``: max / mean of the ranks' owned dedicated elements (the owner plan's
  balance, fixed for a run).

On CUDA, reading the NS time waits for that step's NS events (a host sync at log steps only).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch.distributed as dist

__all__ = ["DmuonTelemetryCallback", "telemetry_entries"]

try:  # the callback base class; the integration only builds this when transformers is imported
    from transformers import TrainerCallback as _Base
except Exception:  # noqa: BLE001 - without transformers nothing here is used
    _Base = object


def _ratio(values: Sequence[float]) -> Optional[float]:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else None


def telemetry_entries(per_rank: Sequence[Optional[dict[str, Any]]]) -> dict[str, float]:
    """Trainer log entries from every rank's ``StepStats.as_dict()`` (None: no step yet).

    Returns ``{}`` unless every rank has stats; ratios whose mean is 0 are left out.
    """
    if not per_rank or any(s is None for s in per_rank):
        return {}
    ns = [float(s["ns_ms"] or 0.0) for s in per_rank]
    owned = [float(s["owned_elements"]) for s in per_rank]
    out: dict[str, float] = {
        "dmuon_ns_ms": max(ns),
        "dmuon_comm_bytes": float(max(int(s["payload_bytes"]) for s in per_rank)),
    }
    for key, vals in (("dmuon_ns_imbalance", ns), ("dmuon_owned_imbalance", owned)):
        r = _ratio(vals)
        if r is not None:
            out[key] = r
    return out


def _muon_of(optimizer: Any) -> Any:
    """``dmuon.Muon`` inside Accelerate's ``AcceleratedOptimizer`` (or None)."""
    for _ in range(3):
        if optimizer is None or hasattr(optimizer, "last_step_stats"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


class DmuonTelemetryCallback(_Base):
    """Gathers the ranks' ``last_step_stats()`` at Trainer's log steps (see the module docstring).

    ``pending`` holds ``(global_step, entries)`` until the wrapped ``Trainer.log`` takes them.
    """

    def __init__(self) -> None:
        self.pending: Optional[tuple[int, dict[str, float]]] = None

    def _collect(self, state: Any, control: Any, optimizer: Any) -> None:
        if not getattr(control, "should_log", False):
            return
        muon = _muon_of(optimizer)
        if muon is None:
            return
        st = muon.last_step_stats()
        mine = st.as_dict() if st is not None else None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        self.pending = (int(state.global_step), telemetry_entries(gathered))

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102
        self._collect(state, control, kwargs.get("optimizer"))
        return control

    def on_epoch_end(self, args, state, control, **kwargs):  # noqa: D102
        if self.pending is None or self.pending[0] != state.global_step:
            self._collect(state, control, kwargs.get("optimizer"))
        return control

    def take(self, global_step: int) -> dict[str, float]:
        """The entries gathered at ``global_step`` (once), else ``{}``."""
        if self.pending is None or self.pending[0] != global_step:
            return {}
        entries, self.pending = self.pending[1], None
        return entries
