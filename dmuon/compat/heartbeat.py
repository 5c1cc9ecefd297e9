"""Which ranks of the job still run, read from the rendezvous store: each process of a dmuon job
bumps a counter ``dmuon/alive/<rank>`` every :data:`BEAT_S` seconds from a daemon thread
(:func:`start_heartbeat`: started once per store when dmuon makes its process groups), and a rank
waiting for the others (:func:`dmuon.stateful.runtime.agree.join`) asks :class:`PeerWatch` which
of them stopped: a counter that did not move for ``DMUON_DEAD_PEER_S`` seconds (default
:data:`DEAD_AFTER_S`) is a process that is gone (exited, killed, frozen), not one that is slow to
arrive. A rank that never beat (a process that did not reach dmuon's setup) is never called dead.

At the interpreter's exit every beating thread is stopped and joined (:func:`stop_heartbeats`,
registered at the first start): a daemon thread still inside its store call when the interpreter
finalizes is ended by a forced unwind through torch's C++ frames, which aborts the process
("terminate called without an active exception").
"""
from __future__ import annotations

import atexit
import math
import os
import threading
import time
from typing import Any, Callable, Iterable

from dmuon.compat.torch_api import default_group, default_store

__all__ = ["start_heartbeat", "stop_heartbeats", "PeerWatch", "BEAT_S", "DEAD_AFTER_S", "DEAD_ENV"]

#: seconds between two beats of a process
BEAT_S = 1.0
#: a counter that did not move for this long (seconds) is a rank that is gone; the environment
#: variable that sets it
DEAD_AFTER_S, DEAD_ENV = 5.0, "DMUON_DEAD_PEER_S"
#: seconds a sleeping beat goes without looking at its stop: the longest an exit waits for it
STOP_POLL_S = 0.05
_STARTED: dict[int, threading.Thread] = {}  # id(default group or store) -> its beating thread
_STOPS: dict[int, threading.Event] = {}  # the same key -> the event that ends that thread


def _key(rank: int) -> str:
    return f"dmuon/alive/{rank}"


def start_heartbeat(rank: int, store: Any = None) -> None:
    """Beat for ``rank`` on ``store`` (default: the default group's) from a daemon thread, once
    per store; the thread ends when the store fails or, for the default group's store, when that
    group is destroyed (a model rebuilt with a new process group leaves no thread behind)."""
    group = default_group() if store is None else None
    store = default_store() if store is None else store
    key = id(group) if group is not None else id(store)
    if store is None or (key in _STARTED and _STARTED[key].is_alive()):
        return  # (a dead thread's group or store is gone: its id may be a new one's)

    # a connection of its own: on the shared one a beat would wait behind the main thread's
    # blocking store call (a barrier's wait), and a live rank would look gone
    try:
        beating = store.clone()
    except Exception:  # noqa: BLE001 - a store without clone(): the shared connection
        beating = store

    stop = _STOPS[key] = threading.Event()

    def beat() -> None:
        while not stop.is_set() and (group is None or default_group() is group):
            try:
                beating.add(_key(rank), 1)
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
                return
            # short sleeps, not stop.wait(BEAT_S): a thread waiting on an Event holds objects the
            # collector tracks (the waiter lock, the Condition's __exit__, the wait's arguments), so
            # len(gc.get_objects()) would change by 2 or 3 with the beat's phase (test_heap_soak)
            wake = time.monotonic() + BEAT_S
            while not stop.is_set() and time.monotonic() < wake:
                time.sleep(STOP_POLL_S)
    _STARTED[key] = thread = threading.Thread(target=beat, name="dmuon-heartbeat", daemon=True)
    thread.start()
    atexit.unregister(stop_heartbeats)  # registered once, however many heartbeats start
    atexit.register(stop_heartbeats)


def stop_heartbeats(timeout: float = 5.0) -> None:
    """End every beating thread and wait for each (``timeout`` seconds at most): run at the
    interpreter's exit, before it finalizes (a thread in its store call then ends the store call
    first, a sleeping one within :data:`STOP_POLL_S`)."""
    for stop in _STOPS.values():
        stop.set()
    for key, thread in list(_STARTED.items()):
        thread.join(timeout)
        del _STARTED[key], _STOPS[key]


class PeerWatch:
    """The ranks whose heartbeat stopped, observed over one wait (:meth:`gone`)."""

    def __init__(self, store: Any, clock: Callable[[], float] = time.monotonic):
        self.store, self.clock = store, clock
        self.bound = float(os.environ.get(DEAD_ENV, DEAD_AFTER_S))
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (last count, when it changed)
        self.next = -math.inf  # when to observe again (at most every BEAT_S / 2)

    def gone(self, ranks: Callable[[], Iterable[int]]) -> list[int]:
        """Of ``ranks()`` (asked only when it is time to observe again), those whose counter did
        not move for the bound since this watch first saw it; ranks that never beat are left
        out. Cheap to call in a polling loop."""
        now, out = self.clock(), []
        if now < self.next:
            return out
        self.next = now + BEAT_S / 2
        for r in ranks():
            if not self.store.check([_key(r)]):
                continue
            count = int(self.store.add(_key(r), 0))
            if r not in self.seen or self.seen[r][0] != count:
                self.seen[r] = (count, now)
            elif now - self.seen[r][1] > self.bound:
                out.append(r)
        return out
