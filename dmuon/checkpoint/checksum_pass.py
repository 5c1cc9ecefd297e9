"""The checksum passes of :func:`dmuon.save_sharded` and :func:`dmuon.load_sharded`: split
across the ranks, and waited for by progress, not by a fixed bound.

* **Split**: on a save each rank checksums the files it wrote (DCP's ``__<rank>_*`` files; rank 0
  also the rest: ``.metadata``, the owner record); on a load the marker's files are split by
  size (:func:`split_by_size`), so no rank reads much more than its share of the bytes.
* **Waited for by progress**: each rank posts on the rendezvous store the file it reads and the
  bytes done (at most once a second), then ``done``; the ranks wait there, not in a bounded
  collective, for as long as every pass keeps moving: slow storage is not a timeout. A pass
  that moves no byte for ``DMUON_CHECKSUM_STALL_S`` seconds (default: dmuon's collective bound,
  ``dedicate_params(timeout=...)``, else 600) is reported by the ranks that waited, naming its
  rank, file and bytes read.
* **Agreed**: the verdicts meet in one collective on dmuon's bounded control group; a problem on
  any rank (a read that failed, a file that does not match the marker, a stalled pass) raises
  :class:`~dmuon.checkpoint.files.CheckpointError` on every rank naming the step and the file,
  and a save publishes only when every rank's pass succeeded.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import time
from typing import Any, Callable, Mapping, Optional

import torch.distributed as dist

from dmuon.checkpoint import files as checkpoint_files  # its _crc read at call time (tests wrap it)
from dmuon.checkpoint.files import CheckpointError, _files, file_problems, open_inside
from dmuon.checkpoint.save_safety import Failure, agree_failure
from dmuon.compat.torch_api import default_store
from dmuon.stateful.runtime.agree import gather

__all__ = ["verify_files", "split_by_size", "own_files", "pass_key", "checksum_share",
           "wait_for_peers", "stall_bound", "save_checksums", "not_agreed", "STALL_ENV"]

#: the environment variable that sets how long a pass may move no byte before it is reported
STALL_ENV = "DMUON_CHECKSUM_STALL_S"
_DEFAULT_STALL_S = 600.0
_DONE = "done"
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")
#: passes run by this process (every rank runs them in one order: the keys agree)
_PASSES = itertools.count()


def split_by_size(sizes: Mapping[str, int], world: int) -> list[list[str]]:
    """``sizes`` (``{name: bytes}``) split into ``world`` shares: largest file first, each to the
    share with the fewest bytes so far (ties: the lower rank). The same on every rank."""
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        shares[r].append(name)
        load[r] += sizes[name]
    return shares


def own_files(names: list[str], rank: int) -> list[str]:
    """The files of a save that ``rank`` checksums: the DCP files it wrote (``__<rank>_*``);
    rank 0 also every file no rank's name claims."""
    out = []
    for name in sorted(names):
        m = _RANK_FILE.fullmatch(name)
        if (m is not None and int(m.group(1)) == rank) or (m is None and rank == 0):
            out.append(name)
    return out


def pass_key(tag: str) -> str:
    """The store prefix of one checksum pass (``tag``: the save id, or ``"load"``)."""
    return f"dmuon/checksum/{tag}-{next(_PASSES)}"


class _Poster:
    """Posts this rank's progress (``[file, bytes done, bytes]``) under ``key``, at most once a
    second unless forced; nothing where there is no store."""

    def __init__(self, key: str):
        self.store, self.key, self.at, self.file, self.size = default_store(), key, 0.0, "", 0

    def start(self, path: str, size: int) -> None:
        self.file, self.size = path, size
        self.post(0, force=True)

    def post(self, done: Any, force: bool = False) -> None:
        now = time.monotonic()
        if self.store is not None and (force or now - self.at >= 1.0):
            self.at = now
            self._set(json.dumps([self.file, done, self.size]))

    def done(self) -> None:
        if self.store is not None:
            self._set(_DONE)

    def _set(self, value: str) -> None:
        """Post ``value``; a store gone (its host process died) ends the posting, not the pass
        (the peers' wait and the agreement after it report the lost rank)."""
        try:
            self.store.set(self.key, value)
        except RuntimeError:  # torch's DistNetworkError / DistStoreError
            self.store = None


def checksum_share(folder: str, names: list[str], key: str, rank: int,
                   want: Optional[Mapping[str, Mapping[str, int]]] = None
                   ) -> tuple[dict[str, tuple[int, int]], list[str], Optional[OSError]]:
    """This rank's pass over ``names`` of ``folder``: against the marker's ``want`` (a load:
    :func:`~dmuon.checkpoint.files.file_problems`), or measured (a save: ``{name: (size,
    crc)}``). Returns the records, the problems (each naming its file) and the first OS error."""
    post = _Poster(f"{key}/{rank}")
    records: dict[str, tuple[int, int]] = {}
    problems: list[str] = []
    os_error: Optional[OSError] = None
    try:
        for name in names:
            full = os.path.join(folder, name)
            post.start(full, want[name]["size"] if want else 0)
            if want is not None:
                problems += file_problems(folder, name, want[name], post.post)
                continue
            try:
                with open_inside(folder, name) as f:
                    post.size = os.fstat(f.fileno()).st_size
                    records[name] = checkpoint_files._crc(f, post.post)
            except (OSError, CheckpointError) as e:
                os_error = os_error or (e if isinstance(e, OSError) else None)
                problems.append(f"the checksum of {full} failed on rank {rank}: "
                                f"{type(e).__name__}: {e}")
    finally:
        post.done()
    return records, problems, os_error


def stall_bound(rt: Any) -> float:
    """How long a pass may move no byte (:data:`STALL_ENV`, else dmuon's collective bound)."""
    if os.environ.get(STALL_ENV):
        return float(os.environ[STALL_ENV])
    timeout = getattr(rt.mesh_groups, "timeout", None)
    return timeout.total_seconds() if timeout is not None else _DEFAULT_STALL_S


def wait_for_peers(key: str, world: int, bound: float,
                   clock: Callable[[], float] = time.monotonic) -> list[str]:
    """Wait on the store until every rank's pass under ``key`` is done; a rank whose progress did
    not change for ``bound`` seconds is returned as a problem naming its file and bytes read
    (waiting goes on as long as the passes move)."""
    store = default_store()
    if store is None:
        return []
    last: dict[int, Any] = {}
    nap = 0.01
    while True:
        now, pending, stalled = clock(), False, []
        for r in range(world):
            k = f"{key}/{r}"
            try:
                value = store.get(k).decode() if store.check([k]) else None
            except RuntimeError as e:  # torch's DistNetworkError / DistStoreError
                return [f"the rendezvous store is unreachable ({type(e).__name__}: {e}): the "
                        "process that hosts it (rank 0's under mp.spawn or env://, torchrun's "
                        "agent) is gone"]
            if value == _DONE:
                continue
            pending = True
            if r not in last or last[r][0] != value:
                last[r] = (value, now)
            elif now - last[r][1] > bound:
                stalled.append(_stall_message(r, value, bound))
        if not pending or stalled:
            return stalled
        time.sleep(nap)
        nap = min(2 * nap, 0.25)


def _stall_message(rank: int, value: Optional[str], bound: float) -> str:
    where = "before its first file"
    if value is not None:
        path, done, size = json.loads(value)
        where = f"reading {path} ({done} of {size} bytes done)" if isinstance(done, int) and \
            size else f"reading {path}"
    return (f"rank {rank}'s checksum pass moved no byte for {bound:g} s, {where}: hung storage, "
            f"or a rank that died? ({STALL_ENV}=seconds sets this bound)")


def not_agreed(e: RuntimeError, what: str, context: str, problems: list[str]) -> CheckpointError:
    """The error of a checksum agreement a rank never came to (the control group's bound),
    naming this rank's own findings (a stalled pass: its rank and file) first."""
    seen = f" ({'; '.join(problems)})" if problems else ""
    return CheckpointError(f"{what}: the checksum pass was not agreed{seen}. {context} [{e}]")


def save_checksums(rt: Any, folder: str, what: str, context: str
                   ) -> tuple[Optional[BaseException], dict[str, tuple[int, int]]]:
    """Collective, after every rank's DCP write of a save: each rank checksums the files it
    wrote (:func:`own_files`), waits for the others' passes while they move, and the verdicts
    are agreed. Returns the exception every rank raises (``None``: every pass succeeded) and
    every file's ``(size, CRC-32)``."""
    world = dist.get_world_size()
    key = pass_key("save")
    records, problems, os_error = checksum_share(
        folder, own_files(_files(folder), rt.rank), key, rt.rank)
    problems += wait_for_peers(key, world, stall_bound(rt))
    own = Failure("; ".join(problems), os_error or CheckpointError(problems[0])) \
        if problems else None
    try:
        err = agree_failure(rt, own, own is not None, what, context)
        got = gather(records, what=f"{what} checksums", via=rt.mesh_groups) if err is None else []
    except RuntimeError as e:
        return not_agreed(e, what, context, problems), {}
    merged: dict[str, tuple[int, int]] = {}
    for r in got:
        merged.update(r)
    return err, merged


def verify_files(rt, path: str, marker: dict) -> list[str]:
    """This rank's share of the files (:func:`split_by_size`):
    each checked against the marker (:func:`file_problems`), progress posted; then, waiting on
    the other ranks' passes for as long as they move (a stalled one is a problem: its rank,
    file and bytes read). Files the marker does not list are problems too."""
    world = dist.get_world_size()
    names = sorted(marker["files"])
    have = set(_files(path))
    errors = [f"{os.path.join(path, f)}: not part of save {marker['save_id']}"
              for f in sorted(have - set(names))]
    mine = split_by_size({f: marker["files"][f]["size"] for f in names}, world)[rt.rank]
    errors += [f"{os.path.join(path, f)}: missing" for f in mine if f not in have]
    key = pass_key("load")
    errors += checksum_share(path, [f for f in mine if f in have], key, rt.rank,
                                marker["files"])[1]
    return errors + wait_for_peers(key, world, stall_bound(rt))
