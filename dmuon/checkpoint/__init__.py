"""dmuon's file-level checkpoint manager, outside the training path (no module of
:mod:`dmuon.stateful`, :mod:`dmuon.functional`, :mod:`dmuon.compat`, :mod:`dmuon.kernels`,
:mod:`dmuon.newton_schulz` or :mod:`dmuon.integrations` imports it; ``tests/test_layout.py``).

* :mod:`~dmuon.checkpoint.sharded` — :func:`save_sharded` / :func:`load_sharded`: sharded
  checkpoints through ``torch.distributed.checkpoint``, atomic saves, validated transactional loads;
* :mod:`~dmuon.checkpoint.files` — the completion marker, CRCs, publish by rename, files opened
  only inside their folder;
* :mod:`~dmuon.checkpoint.checksum_pass` — the checksum passes split across ranks, waited for
  while they read;
* :mod:`~dmuon.checkpoint.save_safety` — a failed save fails cleanly on every rank;
* :mod:`~dmuon.checkpoint.trust` — readers that run no code from a file (allow-list unpickler,
  safe DCP reader, checked ``torch.save`` files);
* :mod:`~dmuon.checkpoint.state_dict_files` — :func:`read_state_dict`: full state dicts from
  ``torch.save`` files and HuggingFace ``save_pretrained`` folders.

It builds on the stateful layer's torch protocol (:mod:`dmuon.stateful.checkpoint`: full state
dicts, ``state_dict`` / ``load_state_dict``, one load path), never the other way round.
Names load on first use (``dmuon.save_sharded`` etc. are the same objects).
"""
from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module that defines it (imported on first access, PEP 562)
_EXPORTS: dict[str, str] = {
    "save_sharded": "dmuon.checkpoint.sharded",
    "load_sharded": "dmuon.checkpoint.sharded",
    "ShardedSaveResult": "dmuon.checkpoint.sharded",
    "ShardedLoadResult": "dmuon.checkpoint.sharded",
    "CheckpointError": "dmuon.checkpoint.files",
    "read_state_dict": "dmuon.checkpoint.state_dict_files",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dmuon.checkpoint' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
