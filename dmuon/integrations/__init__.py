"""Framework integrations, installed by ``import dmuon`` and by ``dedicate_params`` (idempotent).

:func:`install` teaches HF Accelerate (``accelerate.accelerator.Accelerator``) and
``transformers.Trainer`` about dmuon models (see :mod:`dmuon.integrations.hf_trainer`). It never
imports those packages: a framework already imported is patched at once, one imported later is
patched right after its import (:mod:`dmuon.integrations._post_import`). Models that
``dedicate_params`` did not prepare take the frameworks' original code paths.
"""
from __future__ import annotations

from dmuon.integrations.hf_trainer import dmuon_root, status

__all__ = ["install", "status", "dmuon_root"]

_installed = False


def install() -> None:
    """Install the Accelerate / Trainer hooks now or at their import (idempotent, cheap)."""
    global _installed
    if _installed:
        return
    from dmuon.integrations._post_import import when_imported
    from dmuon.integrations.hf_trainer import patch_accelerate, patch_trainer
    when_imported("accelerate.accelerator", patch_accelerate)
    when_imported("transformers.trainer", patch_trainer)
    _installed = True
