"""Full state dicts from disk: ``torch.save`` files and HuggingFace ``save_pretrained`` folders
(safetensors or bin, sharded or not), read onto the CPU into the flat dict
:func:`dmuon.set_model_state_dict` takes, running no code from the file
(:mod:`dmuon.checkpoint.trust`).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from dmuon.checkpoint.trust import index_targets, read_torch_file

__all__ = ["read_state_dict"]

_HF_FILES = ("model.safetensors.index.json", "model.safetensors",
             "pytorch_model.bin.index.json", "pytorch_model.bin")


def read_state_dict(path: str | os.PathLike, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Read a full state dict from disk onto the CPU (no process group needed), running no code
    from the file (:mod:`dmuon.checkpoint.trust`).

    Args:
      path: a ``torch.save`` file (``.pt``/``.pth``/``.bin``; e.g. ``torch.save(model.state_dict())``
        or a ``{"model": ..., "optim": ...}`` checkpoint: any ``weights_only`` content), a
        ``.safetensors`` file, a sharded-checkpoint index (``*.index.json``), or a HuggingFace
        ``save_pretrained`` folder (``model.safetensors[.index.json]`` or
        ``pytorch_model.bin[.index.json]``).
      verify: check every record of a ``torch.save`` file against the CRC-32 the zip format stores
        for it (one extra read of the file; ``torch.load`` never checks them), and refuse the
        legacy non-zip format. ``False`` skips both.

    Returns:
      what the file holds: ``{name: tensor}`` ready for :func:`dmuon.set_model_state_dict` (tied
      names HF dropped stay absent; ``set_model_state_dict`` fills them from their alias).

    Raises:
      FileNotFoundError: the folder holds none of the files above.
      dmuon.checkpoint.files.CheckpointError: a pickle that names anything
        ``torch.load(weights_only=True)`` does not allow (it would run code), a compressed record
        (``torch.save`` never compresses; a zip bomb), a record that fails its CRC-32, an index
        naming a file outside its folder, another index or a folder.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in _HF_FILES:
            if os.path.exists(os.path.join(path, name)):
                return read_state_dict(os.path.join(path, name), verify=verify)
        raise FileNotFoundError(f"read_state_dict: {path!r} has none of {list(_HF_FILES)} "
                                "(is it a save_pretrained folder?)")
    if path.endswith(".index.json"):
        out: dict[str, torch.Tensor] = {}
        for shard in index_targets(path):
            out.update(_read_file(shard, verify))
        return out
    return _read_file(path, verify)


def _read_file(path: str, verify: bool) -> Any:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(path, device="cpu")
    return read_torch_file(path, verify=verify)
