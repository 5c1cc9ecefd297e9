"""A :func:`dmuon.save_sharded` that fails, fails cleanly: the same error on every rank, naming
the OS cause, nothing left behind, nothing replaced that was not a checkpoint.

* **Before anything is written** (rank 0 checks, every rank agrees): ``<path>`` must not be a
  symbolic link (a publish renames ``<path>``: it would replace the link, not its target), a file,
  or a non-empty folder that is not a dmuon checkpoint (a publish would delete what it holds).
* **Each step agreed**: DCP's write (every rank), then rank 0's marker and publish; a failure on
  any rank raises :class:`~dmuon.checkpoint.files.CheckpointError` on every rank
  (:func:`agree_failure`, one small all-gather on dmuon's bounded control group), naming each
  failed rank and its own exception, not DCP's traceback dump. When an ``OSError`` caused it,
  ``CheckpointError.errno`` is its errno on every rank (``ENOSPC`` disk full, ``EDQUOT`` quota,
  ``EROFS`` read-only file system, ``EFBIG`` file too large, ``EACCES`` / ``EPERM`` permission,
  ``EIO`` ...), ``__cause__`` is that ``OSError`` (this rank's own, or rebuilt from the failing
  rank's errno, message and file), and the message says what to do.
* **Interrupts stay interrupts**: a ``SystemExit`` (a SIGTERM handler's ``sys.exit``) or a
  ``KeyboardInterrupt`` that stopped the save on a rank is re-raised there, as itself, after the
  agreement and the cleanup; the other ranks raise ``CheckpointError`` naming it. (DCP wraps
  whatever a rank raises into its ``CheckpointException``; dmuon unwraps it.)
* **Nothing left behind**: on failure rank 0 removes ``<path>.partial-<id>``; each save first
  removes the ``<path>.partial-*`` folders that killed saves left (a partial folder with a marker
  is a complete checkpoint an interrupted publish left: kept, and logged). A failed publish rolls
  ``<path>`` back, so ``<path>`` holds the previous checkpoint.
"""
from __future__ import annotations

import errno as errno_codes
import logging
import os
import re
import shutil
from typing import Any, Callable, NamedTuple, Optional

from dmuon.checkpoint.files import MARKER, CheckpointError, describe_exception, failures_of
from dmuon.stateful.runtime.agree import describe_problems, gather

logger = logging.getLogger(__name__)

__all__ = ["Failure", "run_step", "agree_failure", "target_problems", "sweep_partials",
           "discard_partial"]

#: what an OS error means for a save, and what to do
OS_HINTS = {
    errno_codes.ENOSPC: "the disk is full: free space or save elsewhere",
    errno_codes.EDQUOT: "the disk quota is exceeded: free space or save elsewhere",
    errno_codes.EROFS: "the file system is read-only: save to a writable one",
    errno_codes.EFBIG: "a file exceeds the size limit: the process's RLIMIT_FSIZE (`ulimit -f`) "
                       "or the file system's largest file",
    errno_codes.EACCES: "no permission to write there",
    errno_codes.EPERM: "the operation is not permitted there",
    errno_codes.EIO: "the device reported an I/O error",
}


class Failure(NamedTuple):
    """This rank's own failure of one save step: a one-line message and its exception."""

    message: str
    exc: BaseException


def _root(e: BaseException) -> BaseException:
    """The OS error behind ``e`` (its cause chain), else ``e``."""
    seen, x = set(), e
    while x is not None and id(x) not in seen:
        if isinstance(x, OSError):
            return x
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return e


def run_step(fn: Callable[[], Any], what: str, rank: int) -> tuple[Optional[Failure], bool]:
    """Run one save step: ``(this rank's own failure or None, whether fn raised)``. A DCP
    ``CheckpointException`` lists every failed rank's exception: only this rank's is its own
    (the failed ranks report theirs)."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - interrupts are returned and re-raised later
        fails = failures_of(e)
        own = fails.get(rank, fails.get(-1))
        if own is None:
            return None, True
        if isinstance(own, (KeyboardInterrupt, SystemExit)):
            return Failure(f"{what}: interrupted by {type(own).__name__} on rank {rank}", own), True
        own = _root(own)
        hint = OS_HINTS.get(getattr(own, "errno", None)) if isinstance(own, OSError) else None
        return Failure(f"{what} failed: {describe_exception(own)}"
                       + (f" ({hint})" if hint else ""), own), True
    return None, False


def agree_failure(rt, own: Optional[Failure], raised: bool, what: str,
                  context: str) -> Optional[BaseException]:
    """Collective: the exception every rank raises for this step (``None``: it succeeded on
    every rank). A rank interrupted gets its own interrupt back; the others a
    :class:`CheckpointError` (``errno`` and ``__cause__`` set when an OS error caused it)."""
    info = None
    if own is not None:
        exc = own.exc
        code = exc.errno if isinstance(exc, OSError) else None
        info = (own.message, code, getattr(exc, "strerror", None),
                None if getattr(exc, "filename", None) is None else os.fspath(exc.filename))
    got = gather((info, raised), what=f"{what} agreement", via=rt.mesh_groups)
    problems = {r: [i[0]] for r, (i, _) in enumerate(got) if i is not None}
    if not problems:
        problems = {r: ["failed (its log says why)"] for r, (_, up) in enumerate(got) if up}
    if not problems:
        return None
    if own is not None and isinstance(own.exc, (KeyboardInterrupt, SystemExit)):
        return own.exc
    err = CheckpointError(f"{what}: {describe_problems(problems)}. {context}")
    first = next((i for i, _ in got if i is not None and i[1] is not None), None)
    if first is not None:
        err.errno = first[1]
        if own is not None and isinstance(own.exc, OSError):
            err.__cause__ = own.exc
        else:
            err.__cause__ = OSError(first[1], first[2] or os.strerror(first[1]),
                                    *(() if first[3] is None else (first[3],)))
    return err


def target_problems(path: str) -> list[str]:
    """Why a save must not publish at ``path`` (rank 0, before anything is written)."""
    if os.path.islink(path):
        return [f"{path!r} is a symbolic link (to {os.readlink(path)!r}): a save publishes by "
                "renaming the new checkpoint to the path, which would replace the link itself, "
                "not its target. Pass the target's path, or remove the link"]
    if os.path.exists(path) and not os.path.isdir(path):
        return [f"{path!r} exists and is not a folder; remove it or save elsewhere"]
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, MARKER)):
        return [f"{path!r} is a non-empty folder but not a dmuon checkpoint (it has no {MARKER}):"
                " a save would replace it, deleting what it holds. Remove it or save elsewhere"]
    return []


def sweep_partials(path: str) -> None:
    """Rank 0, before a save: remove the ``<path>.partial-<id>`` folders killed saves left
    (keep, and log, one holding a marker: an interrupted publish's complete checkpoint)."""
    parent, base = os.path.split(path)
    if not os.path.isdir(parent or "."):
        return
    pattern = re.compile(re.escape(base) + r"\.partial-[0-9a-f]{12}")
    for name in sorted(os.listdir(parent or ".")):
        full = os.path.join(parent, name)
        if not pattern.fullmatch(name) or os.path.islink(full) or not os.path.isdir(full):
            continue
        if os.path.isfile(os.path.join(full, MARKER)):
            logger.warning("dmuon.save_sharded: %s is a complete checkpoint an interrupted publish "
                           "left; kept (rename it to %s to load it, or delete it)", full, path)
            continue
        shutil.rmtree(full, ignore_errors=True)
        logger.info("dmuon.save_sharded: removed %s, left by a save that did not finish", full)


def discard_partial(tmp: str, path: str) -> None:
    """Rank 0, after a failed save: remove the partial folder, unless it is the only complete
    copy left (a publish whose roll-back failed too: kept, and logged)."""
    if not os.path.isdir(tmp):
        return
    if not os.path.isdir(path) and os.path.isfile(os.path.join(tmp, MARKER)):
        logger.error("dmuon.save_sharded: %s is missing and %s holds the complete new checkpoint; "
                     "kept: rename it to %s", path, tmp, path)
        return
    shutil.rmtree(tmp, ignore_errors=True)
