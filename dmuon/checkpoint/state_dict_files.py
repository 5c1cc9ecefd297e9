"""Full state dicts from disk: ``torch.save`` files and HuggingFace ``save_pretrained`` folders
(safetensors or bin, sharded or not), read onto the CPU into the flat dict
:func:`dmuon.set_model_state_dict` takes, running no code from the file
(:mod:`dmuon.checkpoint.trust`).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from dmuon.checkpoint.files import CheckpointError, open_inside
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
      what the file holds, ``{name -> tensor}``, ready for :func:`dmuon.set_model_state_dict` (tied
        names HF dropped stay absent; ``set_model_state_dict`` fills them from their alias).

    Raises:
      FileNotFoundError: the folder holds none of the files above.
      dmuon.checkpoint.files.CheckpointError: a pickle that names anything
        ``torch.load(weights_only=True)`` does not allow (it would run code), a compressed record
        (``torch.save`` never compresses; a zip bomb), a record that fails its CRC-32, an index
        naming a file outside its folder, another index or a folder; a file of the folder
        (the one chosen, an index's shard) that is a symbolic link leading outside the folder
        (a link to another file of the folder reads, and so does a Hugging Face hub cache
        snapshot's ``<repo>/snapshots/<rev>/`` link into ``<repo>/blobs/``; an index named
        directly finds its shards beside the name given), a FIFO, device or socket (refused before a
        byte is read); a shard holding a key its index maps elsewhere (or to no file), or missing
        one the index maps to it.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in _HF_FILES:
            if os.path.lexists(os.path.join(path, name)):  # a link leading out: refused
                return _read(path, name, verify, _hub_blobs(path))
        raise FileNotFoundError(f"read_state_dict: {path!r} has none of {list(_HF_FILES)} "
                                "(is it a save_pretrained folder?)")
    # a file named directly: the caller chose it, links included; an index's shards are beside
    # the name given (a hub snapshot's index links to a blob; its shards are in the snapshot)
    folder = os.path.dirname(path) or "."
    chosen = (os.path.dirname(os.path.realpath(path)),)
    return _read(folder, os.path.basename(path), verify, _hub_blobs(folder), chosen)


def _hub_blobs(folder: str) -> tuple[str, ...]:
    """Where else the files of ``folder`` may link to: a Hugging Face hub cache snapshot
    (``<repo>/snapshots/<revision>``) links each of its files to ``<repo>/blobs/<hash>``."""
    snapshots, _ = os.path.split(os.path.abspath(folder))
    repo, kind = os.path.split(snapshots)
    blobs = os.path.join(repo, "blobs")
    return (blobs,) if kind == "snapshots" and os.path.isdir(blobs) else ()


def _read(folder: str, name: str, verify: bool, also: tuple[str, ...],
          chosen: tuple[str, ...] = ()) -> Any:
    """``folder/name`` (a file, or an index and its shards, each checked by
    :func:`~dmuon.checkpoint.files.open_inside` before it is read); ``also``: where links of the
    folder may lead besides it (:func:`_hub_blobs`), ``chosen``: where ``name`` itself may."""
    full = os.path.join(folder, name)
    if not name.endswith(".index.json"):
        return _read_file(folder, name, verify, also + chosen)
    out: dict[str, torch.Tensor] = {}
    targets = index_targets(full, also + chosen)
    owner = {k: os.path.relpath(shard, folder) for shard, keys in targets.items() for k in keys}
    for shard, keys in targets.items():
        got = _read_file(folder, os.path.relpath(shard, folder), verify, also)
        missing = sorted(set(keys) - set(got))
        stray = sorted(set(got) - set(keys))
        if missing or stray:
            k = (missing or stray)[0]
            where = (f"{full} maps it to {shard}, which does not hold it" if missing else
                     f"it is in {shard}, but {full} maps it to {owner.get(k, 'no file')!r}")
            raise CheckpointError(
                f"key {k!r}: {where} ({len(missing)} key(s) of that file missing, {len(stray)} "
                "not its own): which value is meant is unclear, so nothing was returned. Fix "
                "the index or the files.")
        out.update(got)
    return out


def _read_file(folder: str, name: str, verify: bool, also: tuple[str, ...]) -> Any:
    """One file's values, read from the file :func:`~dmuon.checkpoint.files.open_inside`
    accepted (contained and regular, before a byte is read)."""
    full = os.path.join(folder, name)
    with open_inside(folder, name, also) as f:
        if not name.endswith(".safetensors"):
            return read_torch_file(full, verify=verify, file=f)
        from safetensors.torch import load_file
        # safetensors maps a path: the checked open file's own (Linux), else its resolved path
        fd_path = f"/proc/self/fd/{f.fileno()}"
        return load_file(fd_path if os.path.exists(fd_path) else os.path.realpath(full),
                         device="cpu")
