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
  is a complete checkpoint an interrupted publish left: kept, and logged).
* **A folder in progress belongs to one job**: rank 0 creates ``<path>.partial-<id>`` holding
  :data:`OWNER` (host, boot id, pid namespace, pid and its start time, when the save began)
  before any rank writes; the sweep removes only a folder whose owner is gone: this very process
  (an earlier save of this job), a process of this host that no longer runs, or another host's
  (boot's, pid namespace's: a container's) folder in which
  nothing changed for ``DMUON_PARTIAL_STALE_S`` seconds (default one day). Another job's save
  in progress at the same path is left alone. A failed publish rolls
  ``<path>`` back, so ``<path>`` holds the previous checkpoint.
"""
from __future__ import annotations

import errno as errno_codes
import json
import logging
import os
import re
import shutil
import socket
import time
from typing import Any, Callable, Mapping, NamedTuple, Optional

from dmuon.checkpoint.files import (MARKER, CheckpointError, describe_exception, failures_of,
                                    open_inside)
from dmuon.stateful.runtime.agree import describe_problems, gather

logger = logging.getLogger(__name__)

__all__ = ["owner_scope", "Failure", "run_step", "agree_failure", "target_problems", "sweep_partials",
           "finish_publish", "claim_partial", "owner_record", "discard_partial", "OWNER",
           "STALE_ENV"]

#: the record of who a partial folder belongs to (:func:`owner_record`), written before any
#: rank writes into it (and kept in the published checkpoint)
OWNER = "dmuon-owner.json"
#: seconds after which another host's partial folder in which nothing changed is stale (removed
#: by a save's sweep), and the default: one day
STALE_ENV, STALE_S = "DMUON_PARTIAL_STALE_S", 86400.0

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
    try:
        got = gather((info, raised), what=f"{what} agreement", via=rt.mesh_groups)
    except RuntimeError as e:  # the collective itself failed (a rank gone or hung)
        if own is not None and isinstance(own.exc, (KeyboardInterrupt, SystemExit)):
            return own.exc
        err = CheckpointError(f"{what}: {e} (this rank's own part "
                              f"{'failed: ' + own.message if own is not None else 'succeeded'})")
        err.__cause__ = e
        return err
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


def _process_start(pid: int) -> Optional[str]:
    """When process ``pid`` of this host started (Linux: ``/proc/<pid>/stat``, clock ticks since
    boot; tells a reused pid apart), ``None`` where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_record(pid: Optional[int] = None) -> dict:
    """Who a partial folder belongs to: this host, the process ``pid`` (default: this one, rank
    0 of the saving job) and its start time, and when the save began."""
    pid = os.getpid() if pid is None else int(pid)
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _process_start(pid),
            "boot_id": _boot_id(), "pid_ns": _pid_namespace(), "started": time.time()}


def _boot_id() -> Optional[str]:
    """This boot of this machine (Linux: ``/proc/sys/kernel/random/boot_id``), ``None`` where
    unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _pid_namespace() -> Optional[int]:
    """This process's pid namespace (Linux: the inode of ``/proc/self/ns/pid``; containers that
    share a hostname and number their processes alike differ here), ``None`` where unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def owner_scope(owner: Optional[Mapping[str, Any]], here: Mapping[str, Any]) -> str:
    """Where the process an :data:`OWNER` record names runs, seen from ``here`` (this process's
    :func:`owner_record`): ``"this process"``, ``"this host"`` (its pid can be looked up here) or
    ``"elsewhere"`` (another host, boot or pid namespace, or an unreadable record: only the
    stale-time rule can tell it gone). A boot id or namespace either side lacks (an older
    record, no ``/proc``) does not tell them apart; a record that holds them is this process
    only if its pid start time matches too."""
    if not owner or owner.get("host") != here.get("host"):
        return "elsewhere"
    new = False
    for key in ("boot_id", "pid_ns"):
        if owner.get(key) is not None and here.get(key) is not None:
            if owner[key] != here[key]:
                return "elsewhere"
            new = True
    if owner.get("pid") == here.get("pid") and (
            not new or owner.get("pid_start") == here.get("pid_start")):
        return "this process"
    return "this host"


def claim_partial(tmp: str) -> list[str]:
    """Rank 0, before any rank writes: create the partial folder ``tmp`` holding its
    :data:`OWNER` record (written in a staging folder, then renamed: no other job's sweep ever
    sees ``tmp`` without its owner). Returns the problem, if any."""
    staging = f"{tmp}.claim"
    try:
        os.makedirs(staging)
        with open(os.path.join(staging, OWNER), "w") as f:
            json.dump(owner_record(), f)
        os.rename(staging, tmp)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        return [f"cannot create the partial folder {tmp!r} ({describe_exception(e)})"]
    return []


def _owner_gone(folder: str) -> Optional[str]:
    """Why the save that owns the partial ``folder`` is no longer running (``None``: it may be,
    keep it). Its :data:`OWNER` names it: this very process (an earlier save of this job; one
    save runs at a time), a process of this host that no longer runs, or (:func:`owner_scope`:
    another host's, boot's or pid namespace's, or a record that cannot be read) nothing in the folder changed for :data:`STALE_ENV` seconds. A
    folder without a record was left by a dmuon before records (removed, as then)."""
    try:
        with open_inside(folder, OWNER) as f:
            owner = json.loads(f.read(1 << 16))
        pid = int(owner["pid"])
        owner = {**owner, "pid": pid}
    except FileNotFoundError:
        return "it has no owner record (an older dmuon's)"
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        owner, pid = None, -1
    scope = owner_scope(owner, owner_record())
    if scope == "this process":
        return "an earlier save of this job left it"
    if scope == "this host":
        start = _process_start(pid)
        if start is None and not _pid_exists(pid):
            return f"its owner, process {pid}, no longer runs"
        if start is not None and owner.get("pid_start") not in (None, start):
            return f"its owner, process {pid}, no longer runs (the pid was reused)"
        return None
    stale = float(os.environ.get(STALE_ENV, STALE_S))
    newest = max([os.lstat(folder).st_mtime] + [e.stat(follow_symlinks=False).st_mtime
                                                for e in os.scandir(folder)])
    if time.time() - newest > stale:
        return f"nothing in it changed for {stale:g} s ({STALE_ENV})"
    return None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


def _beside(path: str, suffix: str = r"partial-[0-9a-f]{12}") -> list[str]:
    """The folders ``<path>.<suffix>`` beside ``path`` (``suffix`` a regular expression; the
    ``<path>.partial-<id>`` ones by default), links left out, sorted by name."""
    parent, base = os.path.split(path)
    if not os.path.isdir(parent or "."):
        return []
    pattern = re.compile(re.escape(base) + r"\." + suffix)
    return [os.path.join(parent, n) for n in sorted(os.listdir(parent or "."))
            if pattern.fullmatch(n) and not os.path.islink(os.path.join(parent, n))
            and os.path.isdir(os.path.join(parent, n))]


def finish_publish(path: str) -> Optional[str]:
    """Rank 0, before a save or a load of ``path``: finish a publish that a crash cut between its
    two renames (:func:`~dmuon.checkpoint.files.publish`: ``path`` already moved aside, the new
    checkpoint still ``<path>.partial-<id>``, complete: it holds its marker). Where ``path`` does
    not exist, the newest such partial whose save no longer runs becomes ``path`` (logged).
    Returns the folder it renamed, or ``None``."""
    if os.path.lexists(path):
        return None
    done = [f for f in _beside(path) if os.path.isfile(os.path.join(f, MARKER))
            and _owner_gone(f) is not None]
    if not done:
        return None
    newest = max(done, key=lambda f: os.path.getmtime(os.path.join(f, MARKER)))
    os.rename(newest, path)
    logger.warning("dmuon: %s did not exist, and %s held the complete checkpoint of a save whose "
                   "publish was cut between its two renames; it is now %s", path, newest, path)
    return newest


def sweep_partials(path: str) -> None:
    """Rank 0, before a save: remove the ``<path>.partial-<id>`` folders saves that no longer
    run left (:func:`_owner_gone`); keep another live job's, and keep (and log) one holding a
    marker: an interrupted publish's complete checkpoint. With a complete ``path``, remove the
    ``<path>.retired-*`` copies a publish with ``keep_last=1`` was cut before deleting."""
    for full in _beside(path):
        if os.path.isfile(os.path.join(full, MARKER)):
            logger.warning("dmuon.save_sharded: %s is a complete checkpoint an interrupted publish "
                           "left; kept (rename it to %s to load it, or delete it)", full, path)
            continue
        why = _owner_gone(full)
        if why is None:
            logger.info("dmuon.save_sharded: %s belongs to a save still running; kept", full)
            continue
        shutil.rmtree(full, ignore_errors=True)
        logger.info("dmuon.save_sharded: removed %s, left by a save that did not finish (%s)",
                    full, why)
    # keep_last=1: a publish cut before it deleted the checkpoint it replaced
    for full in _beside(path, r"retired-.+") if os.path.isfile(os.path.join(path, MARKER)) else ():
        shutil.rmtree(full, ignore_errors=True)
        logger.info("dmuon.save_sharded: removed %s, the checkpoint a publish replaced (cut "
                    "before it deleted it)", full)


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
