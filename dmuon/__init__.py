"""dmuon: distributed Muon for PyTorch FSDP2/HSDP by dedicated ownership.

``import dmuon`` makes every later ``fully_shard`` call skip the params that
:func:`dedicate_params` marked (they carry ``_dedicated_owner_rank``), whatever the order in which
user code imported ``fully_shard`` (:mod:`dmuon.compat.fsdp_patch`: how, and how to remove it).
It also teaches accelerate / HF ``Trainer``, when they are imported, about dmuon-prepared models
(:mod:`dmuon.integrations`). Nothing else changes torch. On a torch newer than the tested range
(:data:`dmuon.compat.torch_api.SUPPORTED_TORCH`) the import warns and installs as usual, unless a
private torch API dmuon wraps is gone: then, as on a torch older than the range, it warns naming
what is missing and installs nothing; ``dedicate_params`` then raises, and the pure core
``dmuon.functional`` works as anywhere.

Public API (the stateful wrapper, see SPEC §2), loaded on first use (``import dmuon.functional``
loads no module of :mod:`dmuon.stateful`):
  ``dedicate_params`` (its options: ``DedicateOptions``), ``Muon``, ``no_sync``, ``wait_all_replicate_broadcasts``,
  ``get_model_state_dict`` / ``set_model_state_dict``, ``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict``, ``read_state_dict``, ``save_sharded`` / ``load_sharded``
  (torch.distributed.checkpoint, never gathered, any topology), ``clip_grad_norm_``,
  ``clip_grad_value_``, ``verify_step`` (checks one step against single-device Muon/AdamW on the
  real mesh), ``release`` (frees dmuon's part of a model the caller keeps; a discarded model needs
  no call), ``mesh_executor`` (the executor of the runtime over ``G x R`` ranks: its ``run`` is the
  runner a functional step takes, :func:`dmuon.functional.step.rank_step`).
The pure core is ``dmuon.functional``; offline tools (projector, plan reports) are ``dmuon.tools``;
the file-level checkpoint manager (``save_sharded`` / ``load_sharded``, ``read_state_dict``) is
``dmuon.checkpoint``, which training never imports.
"""
from __future__ import annotations

import importlib
from typing import Any

#: the one place the version is written (pyproject.toml reads it; CHANGELOG.md names it)
__version__ = "0.4.0"

#: public name -> the module that defines it (imported on first access, PEP 562)
_PUBLIC: dict[str, str] = {
    "dedicate_params": "dmuon.stateful.setup.dedicate",
    "DedicateOptions": "dmuon.functional.dedicate_options",
    "Muon": "dmuon.stateful.optimizer.muon",
    "no_sync": "dmuon.stateful.runtime.no_sync",
    "wait_all_replicate_broadcasts": "dmuon.stateful.runtime.no_sync",
    "clip_grad_norm_": "dmuon.stateful.extras.grad_clip",
    "clip_grad_value_": "dmuon.stateful.extras.grad_clip",
    "get_optimizer_state_dict": "dmuon.stateful.checkpoint.optimizer_state_dict",
    "set_optimizer_state_dict": "dmuon.stateful.checkpoint.optimizer_state_dict",
    "save_sharded": "dmuon.checkpoint.sharded",
    "load_sharded": "dmuon.checkpoint.sharded",
    "verify_step": "dmuon.verify",
    "VerificationError": "dmuon.verify",
    "VerifyReport": "dmuon.verify",
    "get_model_state_dict": "dmuon.stateful.checkpoint.state_dict",
    "set_model_state_dict": "dmuon.stateful.checkpoint.state_dict",
    "read_state_dict": "dmuon.checkpoint.state_dict_files",
    "LoadResult": "dmuon.stateful.checkpoint.state_dict",
    "release": "dmuon.stateful.setup.release",
    "mesh_executor": "dmuon.stateful.runtime.executor",
}
_SUBPACKAGES = ("functional", "tools", "stateful", "checkpoint", "verify", "newton_schulz", "kernels",
                "integrations", "compat", "launch", "demo")


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"dmuon.{name}")
    raise AttributeError(f"module 'dmuon' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | set(_SUBPACKAGES))


def _install() -> None:
    """The seeds' import contract: the fully_shard patch and the framework hooks."""
    from dmuon.compat.fsdp_patch import install_fully_shard_patch
    from dmuon.compat.torch_api import import_warning, torch_supported

    message = import_warning()  # None on a tested torch
    if message is not None:
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=3)
    if torch_supported():  # a tested torch, or a newer one with every wrapped private API
        install_fully_shard_patch()
        from dmuon.integrations import install as install_integrations

        install_integrations()  # accelerate / HF Trainer learn about dmuon models (on their import)


_install()

__all__ = ["functional", *_PUBLIC]
