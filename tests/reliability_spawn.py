"""One spawn per world size for the issue-39 reliability tests (the default tier's time budget).

World 2 (gloo): the 5-rebuild loop first, in the fresh process it measures
(``test_rebuild_loop.py``), then the crafted-checkpoint loads (``test_checkpoint_trust.py``) and
the failing saves, the narrowing log and the async-save recipe (``test_checkpoint_failures.py``),
then the heap soak's short run (``test_heap_soak.py``, issue 46).
World 1: the rebuild loop alone. Each part runs even if another raised: its result is then the
traceback, which the part's tests report.
"""
from __future__ import annotations

import os
import traceback
from typing import Any

from dist_utils import run_ranks

_CACHE: dict[int, list] = {}


def _part(fn, *args) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported by the part's tests
        return "worker raised:\n" + traceback.format_exc(limit=-8)


def _worker(rank: int, world: int, tmp: str) -> dict:
    import test_checkpoint_failures
    import test_checkpoint_trust
    import test_heap_soak
    import test_load_values
    import test_rebuild_loop
    out = {"rebuild": _part(test_rebuild_loop._rebuild_loop, rank, world)}
    if world > 1:
        for name, fn in (("trust", test_checkpoint_trust._trust_worker),
                         ("failures", test_checkpoint_failures._failures),
                         ("loads", test_load_values._loads)):
            os.makedirs(f"{tmp}/{name}", exist_ok=True)
            out[name] = _part(fn, rank, world, f"{tmp}/{name}")
        out["heap"] = _part(test_heap_soak._short_soak, rank, world)
    return out


def results(world: int, part: str, tmp_path_factory) -> list:
    """Every rank's result of ``part`` (one spawn per world size per session)."""
    if world not in _CACHE:
        tmp = str(tmp_path_factory.mktemp(f"reliability{world}"))
        _CACHE[world] = run_ranks(_worker, world, tmp, timeout=300)
    got = [r[part] for r in _CACHE[world]]
    for rank, r in enumerate(got):
        assert not isinstance(r, str), f"rank {rank}, {part}: {r}"
    return got
