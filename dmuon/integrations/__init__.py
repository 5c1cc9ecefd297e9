"""Framework integrations, installed by ``import dmuon`` and by ``dedicate_params`` (idempotent).

:func:`install` teaches HF Accelerate (``accelerate.accelerator.Accelerator``) and
``transformers.Trainer`` about dmuon models (see :mod:`dmuon.integrations.hf_trainer`). It never
imports those packages: a framework already imported is patched at once, one imported later is
patched right after its import (:mod:`dmuon.integrations._post_import`). Models that
``dedicate_params`` did not prepare take the frameworks' original code paths.
"""
from __future__ import annotations

from typing import Any

__all__ = ["install", "status", "dmuon_root"]

_installed = False


def install() -> None:
    """Install the Accelerate / Trainer hooks now or at their import (idempotent, cheap)."""
    global _installed
    if _installed:
        return
    from dmuon.integrations._post_import import when_imported
    when_imported("accelerate.accelerator", _hf("patch_accelerate"))
    when_imported("transformers.trainer", _hf("patch_trainer"))
    _installed = True


def _hf(name: str) -> Any:
    """``hf_trainer.<name>``, imported when the framework is (not at ``import dmuon``)."""
    def patch(module: Any) -> Any:
        from dmuon.integrations import hf_trainer
        return getattr(hf_trainer, name)(module)
    patch.__name__ = name
    return patch


def __getattr__(name: str) -> Any:
    if name in ("status", "dmuon_root"):
        from dmuon.integrations import hf_trainer
        return getattr(hf_trainer, name)
    raise AttributeError(f"module 'dmuon.integrations' has no attribute {name!r}")
