"""The files of a :func:`dmuon.save_sharded` checkpoint: completion marker, CRCs, publish by rename.

A checkpoint directory is complete when it holds ``dmuon-complete.json``: the save id and, for every
other file, its size and CRC-32, written by rank 0 after every rank's DCP write returned and before
the directory is published (renamed into place). :func:`dmuon.checkpoint.checksum_pass.verify_files` checks a
share of the files on each rank; :func:`complete_or_raise` refuses a directory without a marker and names the newest
complete sibling (``<path>.1``, a partial or retired directory left by an interrupted publish).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import zlib
from typing import Any, BinaryIO, Callable, Mapping, Optional

import torch.distributed as dist

from dmuon.stateful.runtime.agree import agree, agree_equal

__all__ = ["MARKER", "CheckpointError", "write_marker", "publish", "complete_or_raise",
           "file_problems", "open_inside", "dcp_errors", "agree_errors"]

logger = logging.getLogger(__name__)

MARKER = "dmuon-complete.json"
#: a marker larger than this is refused (one small record per file)
MAX_MARKER_BYTES = 64 << 20


class CheckpointError(Exception):
    """A sharded checkpoint cannot be loaded (torn, corrupt, not matching the model, crafted), or
    a save failed; raised on every rank, with nothing changed.

    Attributes:
      errno: when an ``OSError`` on some rank caused it, that error's number, the same on every
        rank (``errno.ENOSPC`` disk full, ``EDQUOT``, ``EROFS`` read-only, ``EFBIG`` file too
        large, ``EACCES``, ``EIO``, ...); ``__cause__`` is then that ``OSError``. ``None``
        otherwise.
    """

    errno: Optional[int] = None


def open_inside(folder: str, name: str, also: tuple[str, ...] = ()) -> BinaryIO:
    """``folder/name`` opened for reading, checked before a byte is read: refused
    (:class:`CheckpointError` naming it) unless its path, every symbolic link resolved, stays
    inside ``folder`` or one of the folders ``also`` (a link to another file of the folder
    reads; one leading out does not: a checkpoint reads nothing outside its folder), and it is a
    regular file (a FIFO, device or socket is opened non-blocking and refused, never waited
    on)."""
    full = os.path.join(folder, name)
    root, real = os.path.realpath(folder), os.path.realpath(full)
    if not any(os.path.commonpath([r, real]) == r
               for r in (root, *map(os.path.realpath, also))):
        raise CheckpointError(f"{full} is a symbolic link to {real!r}, outside the folder "
                              f"{root!r}; refused (a checkpoint reads nothing outside its folder). "
                              "Copy the file into the folder (cp -L) if it is meant to be read.")
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else \
            "a device or socket"
        raise CheckpointError(f"{full} is not a regular file ({kind}); refused, nothing read.")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _crc(f: BinaryIO, progress: Optional[Callable[[int], None]] = None) -> tuple[int, int]:
    """``(size, CRC-32)`` of an open file, read in 16 MiB chunks (``progress(bytes done)``
    after each)."""
    crc, size = 0, 0
    while True:
        chunk = f.read(1 << 24)
        if not chunk:
            return size, crc
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
        if progress is not None:
            progress(size)


def _files(d: str) -> list[str]:
    """The entries of ``d`` but the marker and folders (links and FIFOs included: refused when
    read, named when not part of the save)."""
    return sorted(e.name for e in os.scandir(d)
                  if e.name != MARKER and not e.is_dir(follow_symlinks=False))


def file_problems(folder: str, name: str, want: Mapping[str, int],
                  progress: Optional[Callable[[int], None]] = None) -> list[str]:
    """One marker entry's check: contained and regular (:func:`open_inside`), then its size
    (before a byte is read), then its CRC-32 (``progress``: as :func:`_crc`'s)."""
    full = os.path.join(folder, name)
    try:
        with open_inside(folder, name) as f:
            size = os.fstat(f.fileno()).st_size
            if size != want["size"]:
                return [f"{full}: {size} bytes, the save wrote {want['size']} "
                        f"({'truncated' if size < want['size'] else 'another file'}?); "
                        "refused before reading it"]
            _, crc = _crc(f, progress)
    except FileNotFoundError:
        return [f"{full}: missing"]
    except (CheckpointError, OSError) as e:
        return [str(e)]
    if crc != want["crc32"]:
        return [f"{full}: CRC-32 {crc:08x}, the save wrote {want['crc32']:08x} (corrupt)"]
    return []


def failures_of(e: BaseException) -> dict[int, BaseException]:
    """``{rank: exception}`` behind ``e``: DCP's ``CheckpointException`` carries each failed
    rank's exception (``failures``); anything else is this rank's own (key -1)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return {int(r): (f[0] if isinstance(f, tuple) else f) for r, f in failures.items()}
    return {-1: e}


def describe_exception(e: BaseException) -> str:
    """``Type: message`` of ``e`` (a :class:`CheckpointError`: its message alone), one line."""
    if isinstance(e, CheckpointError):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:400] if text else ''}".rstrip(": ")


def dcp_errors(fn: Any, what: str) -> list[str]:
    """Run a DCP call; its failure as a message (DCP's ``CheckpointException`` is a
    ``BaseException``: caught here so that it reaches every rank as a :class:`CheckpointError`),
    naming each failed rank's own exception rather than DCP's traceback dump."""
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001
        parts = [describe_exception(x) + (f" (rank {r})" if r >= 0 else "")
                 for r, x in sorted(failures_of(e).items())]
        return [f"{what} failed: " + "; ".join(dict.fromkeys(parts))]
    return []


def agree_errors(rt, errors: list[str], what: str) -> None:
    """Raise :class:`CheckpointError` on every rank if any rank has an error (collective;
    :func:`dmuon.stateful.runtime.agree.agree`)."""
    _as_checkpoint_error(what, lambda: agree(
        errors, what=f"{what} agreement", via=rt.mesh_groups, error=lambda detail: (
            CheckpointError(f"{what}: {detail}. Nothing was changed on any rank."))))


def agree_same(rt, value: Any, what: str, differ: str, fix: str) -> None:
    """Raise :class:`CheckpointError` on every rank unless every rank holds an equal ``value``
    (collective; ``differ``: what differs, ``fix``: how to fix it)."""
    _as_checkpoint_error(what, lambda: agree_equal(
        value, what=f"{what} agreement", via=rt.mesh_groups, error=lambda detail: (
            CheckpointError(f"{what}: {differ}: {detail}; {fix}. Nothing was changed on any "
                            "rank."))))


def _as_checkpoint_error(what: str, agreement: Callable[[], Any]) -> None:
    """Run a collective ``agreement``; its own failure (a rank gone or hung: ``RuntimeError``)
    as :class:`CheckpointError` (which is not one)."""
    try:
        agreement()
    except RuntimeError as e:
        raise CheckpointError(f"{what}: {e}") from e


def publish(path: str, tmp: str, keep_last: int) -> None:
    """Rank 0: the new checkpoint ``tmp`` becomes ``path``; older ones rotate to ``path.1`` .. .
    If the final rename fails, ``path`` is renamed back (it holds the previous checkpoint); a
    retired copy that cannot be deleted afterwards is logged, not an error (the save is done)."""
    keep_last = max(1, int(keep_last))
    oldest = f"{path}.{keep_last - 1}" if keep_last > 1 else None
    if oldest and os.path.exists(oldest):
        shutil.rmtree(oldest)
    for i in range(keep_last - 2, 0, -1):
        if os.path.exists(f"{path}.{i}"):
            os.rename(f"{path}.{i}", f"{path}.{i + 1}")
    retired = f"{path}.1" if keep_last > 1 else f"{path}.retired-{os.path.basename(tmp)}"
    had = os.path.exists(path)
    if had:
        os.rename(path, retired)
    try:
        os.rename(tmp, path)
    except BaseException:
        if had:
            os.rename(retired, path)
        raise
    if keep_last == 1 and had:
        try:
            shutil.rmtree(retired)
        except OSError as e:
            logger.warning("dmuon.save_sharded: could not delete the previous checkpoint %s (%s); "
                           "the new one is published at %s", retired, e, path)


def plain_name(name: Any) -> bool:
    """``name`` is a file name inside its folder: a non-empty str, no separator, not ``.``/``..``."""
    return (isinstance(name, str) and bool(name) and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and not os.path.isabs(name))


def _checked_marker(marker: Any, where: str) -> dict:
    """The marker's content, refused unless it is what :func:`write_marker` writes: a save id
    and ``{plain file name: {"size": int, "crc32": int}}``."""
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or not isinstance(marker.get("save_id"), str):
        raise CheckpointError(f"{where}: not a dmuon completion marker; refused.")
    for name, rec in files.items():
        if not plain_name(name):
            raise CheckpointError(f"{where} lists {name!r}, outside the checkpoint's folder; "
                                  "refused.")
        if not (isinstance(rec, dict) and all(type(rec.get(k)) is int and rec[k] >= 0
                                              for k in ("size", "crc32"))):
            raise CheckpointError(f"{where}: the entry of {name!r} is not a size and a CRC; "
                                  "refused.")
    return marker


def complete_or_raise(path: str) -> dict:
    """The marker of a complete checkpoint at ``path`` (raises naming the last complete one)."""
    marker = os.path.join(path, MARKER)
    if os.path.lexists(marker):
        try:
            with open_inside(path, MARKER) as f:
                if os.fstat(f.fileno()).st_size > MAX_MARKER_BYTES:
                    raise CheckpointError(f"{marker}: more than {MAX_MARKER_BYTES} bytes, more "
                                          "than a marker holds; refused.")
                return _checked_marker(json.load(f), marker)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{marker}: unreadable ({e})") from None
    parent, base = os.path.split(path)
    candidates = sorted(
        (c for c in os.listdir(parent or ".")
         if c.startswith(base + ".") and os.path.isfile(os.path.join(parent, c, MARKER))),
        key=lambda c: os.path.getmtime(os.path.join(parent, c, MARKER)), reverse=True)
    hint = (f" The last complete checkpoint is {os.path.join(parent, candidates[0])!r} (an "
            "interrupted publish or rotation: rename it to the path to load it)."
            if candidates else " No complete checkpoint was found beside it.")
    what = "does not exist" if not os.path.exists(path) else \
        f"has no {MARKER} (a save that did not finish, or not written by dmuon.save_sharded)"
    raise CheckpointError(f"dmuon.load_sharded: {path!r} {what}.{hint}")


def write_marker(directory: str, save_id: str,
                 records: Optional[Mapping[str, tuple[int, int]]] = None) -> None:
    """Rank 0: every file of ``directory`` with its ``(size, CRC-32)`` (from ``records``, the
    ranks' checksum passes; a file none of them measured is measured here) into its marker
    (written, synced, then renamed)."""
    files = dict(records or {})
    listed = _files(directory)
    gone = sorted(set(files) - set(listed))
    if gone:
        raise CheckpointError(f"{directory}: {gone[:5]} were checksummed but are not in the "
                              "folder now; not published.")
    for name in listed:
        if name not in files:
            with open_inside(directory, name) as f:
                files[name] = _crc(f)
    marker = {"save_id": save_id, "format": 1,
              "files": {f: {"size": sz, "crc32": c} for f, (sz, c) in files.items()}}
    tmp = os.path.join(directory, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(directory, MARKER))
