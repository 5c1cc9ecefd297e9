"""Reading checkpoint files without running code, reading outside their folder, or inflating them.

A checkpoint is data someone else may have written (a downloaded model, a shared folder, a bucket
others can write to). dmuon's readers treat it so:

* **no code runs**: a pickle names functions and classes that unpickling calls, so every pickle
  dmuon reads goes through an allow-list. A DCP ``.metadata`` file is unpickled by
  :class:`MetadataUnpickler` (only DCP's metadata classes, ``torch.Size``, dtypes, layouts and
  paths: :data:`dmuon.compat.torch_api.DCP_METADATA_CLASSES`); non-tensor entries (counters,
  param groups, ``extra``) and tensors load with ``torch.load(weights_only=True)``; a full
  ``torch.save`` file too. Whatever else a file names is refused with :class:`CheckpointError`
  before it is called;
* **inside the folder**: the files a checkpoint's index, marker or metadata names must be plain
  names in its folder (no ``..``, no absolute path, no other index), and every file is opened
  through :func:`~dmuon.checkpoint.files.open_inside` before a byte of it is read: a symbolic
  link whose target lies outside the folder, a FIFO, device or socket is refused (a link to
  another file of the folder reads); an index's per-key map is obeyed (a key is read from the
  file the index names for it: found in another file, or missing from its own, it is refused);
* **bounded**: a ``torch.save`` record must be stored, not compressed (``torch.save`` never
  compresses; a deflated record can inflate x1000, a zip bomb), and each DCP item must lie inside
  its file as the marker measured it; no DCP storage transform (compression) is accepted;
* **checked**: a full ``torch.save`` file's records are CRC-32-checked against the checksums the
  zip format stores for each (``torch.load`` never checks them: 64 flipped bytes load silently).

What is *not* covered: a ``storage_reader`` the caller passes to ``load_sharded`` reads the
metadata its own way (DCP's ``FileSystemReader`` unpickles it with ``pickle.load``); ``torch.load``
with ``weights_only=False``, and ``torch.distributed.checkpoint.load`` itself (its reader unpickles
``.metadata`` and its planner ``torch.load(weights_only=False)``-s non-tensor entries): run those
only on files you trust (docs/checkpoints.md, "What is safe to load").
"""
from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from typing import Any, BinaryIO, Mapping, Optional

import torch

from dmuon.compat.torch_api import dcp_metadata_global
from dmuon.checkpoint.files import CheckpointError, open_inside, plain_name

__all__ = ["plain_name", "MetadataUnpickler", "read_metadata", "safe_reader", "load_bytes",
           "value_problems", "read_torch_file", "index_targets"]

#: an index (``*.index.json``) larger than this is refused (HF's are well under 1 MiB)
MAX_INDEX_BYTES = 64 << 20

_RUNS_CODE = ("would have to import or call something torch.load(weights_only=True) does not "
              "allow (a pickle can run any code that way), so it was not loaded")


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, refusing every global not on the allow-list."""

    def find_class(self, module: str, name: str) -> Any:
        obj = dcp_metadata_global(module, name)
        if obj is None:
            raise CheckpointError(
                f"the checkpoint's .metadata names {module}.{name}, which is not allowed in DCP "
                "metadata (only DCP's metadata classes, torch.Size, dtypes, layouts and paths): "
                "a crafted file runs code that way, so it was not loaded.")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError("the checkpoint's .metadata holds a persistent reference, which DCP "
                              "metadata never does; not loaded.")


def read_metadata(path: str, files: Mapping[str, int]) -> Any:
    """The DCP metadata in ``path`` (unpickled by :class:`MetadataUnpickler`), every item of it
    checked to lie inside one of ``files`` (``{plain name: size}``, the marker's)."""
    from torch.distributed.checkpoint.metadata import Metadata
    try:
        with open_inside(os.path.dirname(path), os.path.basename(path)) as f:
            md = MetadataUnpickler(f).load()
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any malformed pickle
        raise CheckpointError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{path}: not DCP metadata (a {type(md).__name__})")
    for index, info in md.storage_data.items():
        rel = getattr(info, "relative_path", None)
        where = f"{path}: item {getattr(index, 'fqn', index)!r}"
        if not plain_name(rel):
            raise CheckpointError(f"{where} is read from {rel!r}, outside the checkpoint's "
                                  "folder; refused.")
        if rel not in files:
            raise CheckpointError(f"{where} is read from {rel!r}, which the checkpoint's marker "
                                  "does not list; refused.")
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(off, int) and isinstance(length, int) and 0 <= off
                and 0 <= length <= files[rel] - off):
            raise CheckpointError(f"{where}: bytes [{off}, +{length}) lie outside {rel!r} "
                                  f"({files[rel]} bytes); refused.")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} is stored through {info.transform_descriptors} (a "
                                  "DCP storage transform such as compression), which "
                                  "dmuon.save_sharded never writes; refused.")
    return md


def _stored_only(zf: zipfile.ZipFile, what: str) -> None:
    for info in zf.infolist():
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise CheckpointError(
                f"{what}: record {info.filename!r} is compressed ({info.compress_size} bytes "
                f"inflating to {info.file_size}); torch.save never compresses, and a compressed "
                "record can inflate without bound (a zip bomb), so it was not loaded. Re-save "
                "the values with torch.save where the file is trusted.")


def load_bytes(value: io.BytesIO, what: str) -> Any:
    """A DCP non-tensor entry, read with ``torch.load(weights_only=True)``."""
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"entry {what!r}: {_RUNS_CODE} ({str(e).splitlines()[0]}).") \
            from None


class _Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable file of their own (a
    DCP item: read where it lies, no copy of it in memory)."""

    def __init__(self, f: Any, offset: int, length: int):
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._len - self._pos))
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buf)[:n]) if n else 0
        self._pos += got
        return got


def _tensor_item(buf: Any, what: str) -> torch.Tensor:
    try:
        with zipfile.ZipFile(buf) as zf:
            _stored_only(zf, what)
    except zipfile.BadZipFile:
        raise CheckpointError(f"{what}: not a torch.save record; refused.") from None
    buf.seek(0)
    try:
        t = torch.load(buf, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{what}: {_RUNS_CODE} ({str(e).splitlines()[0]}).") from None
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{what}: a {type(t).__name__} where a tensor was saved; refused.")
    return t


def safe_reader(path: str, files: Mapping[str, int]) -> Any:
    """A DCP ``FileSystemReader`` of ``path`` that reads the metadata with
    :func:`read_metadata`, and each item itself: only inside the marker's ``files``, stored
    (uncompressed) ``torch.save`` records, ``weights_only`` (no storage transforms)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            md = read_metadata(os.path.join(path, name), files)
            from torch.distributed.checkpoint.metadata import StorageMeta
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = getattr(self, "load_id", None)
            return md

        def read_data(self, plan: Any, planner: Any) -> Any:
            for req in plan.items:
                info = self.storage_data[req.storage_index]
                what = f"{info.relative_path}: item {req.storage_index.fqn!r}"
                with open_inside(path, info.relative_path) as f:
                    if os.fstat(f.fileno()).st_size < info.offset + info.length:
                        raise CheckpointError(f"{what}: the file ends early (truncated?)")
                    if req.type == LoadItemType.BYTE_IO:
                        f.seek(info.offset)
                        planner.load_bytes(req, io.BytesIO(f.read(info.length)))
                        continue
                    t = _tensor_item(io.BufferedReader(_Slice(f, info.offset, info.length)),
                                     what)
                for dim, (off, size) in enumerate(zip(req.storage_offsets, req.lengths)):
                    if size < t.size(dim):
                        t = t.narrow(dim, off, size)
                target = planner.resolve_tensor(req).detach()
                if target.size() != t.size():
                    raise CheckpointError(f"{what}: {tuple(t.shape)} read where "
                                          f"{tuple(target.shape)} was planned; refused.")
                target.copy_(t)
                planner.commit_tensor(req, target)
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(None)
            return fut

    return SafeReader(path)


def value_problems(prefix: str, values: Mapping[str, Any]) -> list[str]:
    """Save side: the entries of ``values`` a load could not read with
    ``torch.load(weights_only=True)`` (a custom class, a function, ...), named ``prefix[key]``."""
    problems = []
    for k, v in values.items():
        buf = io.BytesIO()
        try:
            torch.save(v, buf)
            buf.seek(0)
            torch.load(buf, weights_only=True)
        except Exception as e:  # noqa: BLE001 - unpicklable, or not weights_only-loadable
            problems.append(
                f"{prefix}[{k!r}] is a {type(v).__name__}, which a load could not read without "
                f"running code (torch.load(weights_only=True): {str(e).splitlines()[0][:160]}); "
                "store plain values (numbers, strings, lists, tuples, dicts, tensors)")
    return problems


def _starts_as_zip(source: Any) -> bool:
    """The file (a path or an open binary file) begins with a zip record's signature."""
    if isinstance(source, str):
        with open(source, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    return source.read(4) == b"PK\x03\x04"


def read_torch_file(path: str, *, verify: bool = True, file: Optional[BinaryIO] = None) -> Any:
    """A ``torch.save`` file, loaded with ``weights_only=True`` after checking that its records
    are stored (not compressed) and (``verify``) match their CRC-32s; ``file``: the file already
    opened (and checked), read instead of opening ``path`` (then only named in errors)."""
    def source() -> Any:
        if file is None:
            return path
        file.seek(0)
        return file
    if zipfile.is_zipfile(source()):
        try:
            with zipfile.ZipFile(source()) as zf:
                _stored_only(zf, path)
                if verify:
                    for info in zf.infolist():
                        with zf.open(info) as rec:
                            while rec.read(1 << 24):
                                pass
        except zipfile.BadZipFile as e:
            raise CheckpointError(
                f"{path}: corrupt ({e}): a record does not match the CRC-32 torch.save stored for "
                "it (flipped bytes, a torn copy); not loaded. verify=False skips this check.") \
                from None
    elif verify and _starts_as_zip(source()):
        raise CheckpointError(
            f"{path}: cut short or corrupt: it starts as a torch.save (zip) file but its end, the "
            "index of its records, is missing or damaged (a copy or save that did not finish, a "
            "full disk); not loaded. Load an intact copy.")
    elif verify:
        raise CheckpointError(
            f"{path}: not a zip-format torch.save file (torch < 1.6's legacy format, or not a "
            "torch file): its sizes cannot be checked before they are allocated, nor its bytes "
            "against checksums. Re-save it with a current torch.save where it is trusted, or pass "
            "verify=False.")
    try:
        return torch.load(source(), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: {_RUNS_CODE} ({str(e).splitlines()[0]}).") from None


def index_targets(index: str, also: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The shard files a ``*.index.json`` names, as paths in its folder, each with the keys the
    index maps to it (refused: a name outside the folder, another index, a folder; ``also``: as
    :func:`~dmuon.checkpoint.files.open_inside`'s, for the index file itself)."""
    folder = os.path.dirname(index)
    try:
        with open_inside(folder, os.path.basename(index), also) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_INDEX_BYTES:
                raise CheckpointError(f"{index}: {size} bytes, more than an index holds "
                                      f"({MAX_INDEX_BYTES} at most); refused.")
            weight_map = json.load(f)["weight_map"]
        keys_of: dict[Any, list[str]] = {}
        for key, name in weight_map.items():
            keys_of.setdefault(name, []).append(key)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a weight index ({type(e).__name__}: {e})") from None
    out = {}
    for name in sorted(keys_of, key=str):
        parts = name.replace("\\", "/").split("/") if isinstance(name, str) else [None]
        if not isinstance(name, str) or os.path.isabs(name) or not all(
                plain_name(p) for p in parts):
            raise CheckpointError(f"{index} names {name!r}, outside its folder {folder!r}; an "
                                  "index may name only files in its folder. Refused.")
        if name.endswith(".index.json"):
            raise CheckpointError(f"{index} names {name!r}, another index (or itself); an index "
                                  "names shard files only. Refused.")
        full = os.path.join(folder, *parts)
        if os.path.isdir(full):
            raise CheckpointError(f"{index} names {name!r}, a folder; refused.")
        out[full] = sorted(keys_of[name])
    return out
