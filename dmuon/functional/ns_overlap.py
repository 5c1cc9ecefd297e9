"""Owner Newton–Schulz overlapped with the backward: the decisions (pure).

A hook group's owner update (momentum, NS, update of the matrices this rank owns in it) may run
as soon as the group's reduce has landed on the owner, while the backward continues: out of place,
into buffers of its own, *speculatively*. ``step()`` commits the result (a copy: bitwise what it
would compute then) only if every input the update read is still what ``step()`` would read;
otherwise it discards it and computes as without overlap. This module decides:

* :func:`overlap_blocker` / :func:`resolve_mode`: whether a mode allows it at all (once, when the
  option is set): an owner update that runs collectives (tensor parallelism, split NS, the 8-bit
  scale's MAX across TP) or a momentum kept in another dtype / offloaded is never overlapped;
* :func:`early_names`: which matrices of a group may go early (the owner had a local gradient,
  so presence needs no host read, and no divide factor will rescale the gradient in place);
* :func:`stamp_key` / :func:`invalid_reason`: whether a speculation is still valid at ``step()``
  (the one definition of validity; the runtime only compares stamps it took);
* :func:`replay_key`: whether one group's early update may be captured once as a CUDA graph
  and replayed at later steps (and under which key);
* :func:`auto_choice`: ``"auto"``'s choice from timings (median per iteration).
"""
from __future__ import annotations

import statistics
from typing import Any, Mapping, NamedTuple, Optional, Sequence

__all__ = ["MODES", "check_mode", "overlap_blocker", "resolve_mode", "early_names", "Stamp",
           "stamp_key", "take_stamp", "invalid_reason", "replay_key", "by_group", "auto_choice",
           "auto_split", "auto_verdict"]

#: the values of ``dmuon.Muon.set_ns_overlap``
MODES = ("off", "on", "auto")


def check_mode(mode: Any) -> str:
    """``mode`` if it is one of :data:`MODES`, else ``ValueError``."""
    if mode not in MODES:
        raise ValueError(f"set_ns_overlap: mode must be one of {MODES}, got {mode!r}")
    return mode


def overlap_blocker(*, tensor_parallel: bool, split_ns: bool, stored_momentum: Optional[str],
                    own_chain: bool = False) -> Optional[str]:
    """Why this optimizer's owner update cannot overlap the backward (``None``: it can).

    Args:
      tensor_parallel: TP-sliced matrices (their NS gathers / scatters over the TP group, the
        8-bit scale's MAX across TP: collectives inside the owner update).
      split_ns: split NS (units exchanged between ranks inside the owner update).
      stored_momentum: the momentum's storage when it is not the master dtype on the device
        (``"torch.bfloat16"``, ``"offload"``...; ``None``: the plain storage).
      own_chain: ``transform=`` is the user's own chain (not Muon or a
        :mod:`dmuon.functional.variants` variant, whose stages are per matrix): a stage of it may
        couple matrices (a global norm), which an update per hook group would change.
    """
    if tensor_parallel:
        return "tensor parallelism: the owner update runs TP collectives"
    if split_ns:
        return "split NS: the owner update exchanges NS units between ranks"
    if own_chain:
        return ("transform= is your own chain: its stages may couple matrices, which an update "
                "per hook group would change (dmuon.functional.variants' chains are per matrix)")
    if stored_momentum is not None:
        return (f"momentum stored as {stored_momentum}: its chunked decode / offload copies are "
                "not speculated")
    return None


def resolve_mode(mode: str, blocker: Optional[str], device_type: str) -> tuple[str, str]:
    """``(effective mode, reason)``: ``"off"``, ``"on"`` or ``"auto"`` (measure, then fixed).
    A blocker turns ``"on"`` / ``"auto"`` off (never half-applied); ``"auto"`` without CUDA
    streams (CPU / gloo) is off: there is nothing to overlap with."""
    check_mode(mode)
    if mode == "off":
        return "off", "off (set_ns_overlap)"
    if blocker is not None:
        return "off", f"not applied: {blocker}"
    if mode == "auto" and device_type != "cuda":
        return "off", "auto on a device without CUDA streams: off"
    return mode, "on (set_ns_overlap)" if mode == "on" else "auto: measuring"


def early_names(owned_here: Mapping[str, bool],
                scales: Mapping[str, Optional[float]]) -> list[str]:
    """The owned matrices of one landed reduce that may be updated early: the owner had a local
    gradient (present for sure: no presence read) and no divide factor rescales the gradient
    (``scales[n] is None``: the reduce's average is the gradient ``step()`` reads, untouched)."""
    return [n for n, here in owned_here.items() if here and scales.get(n) is None]


class Stamp(NamedTuple):
    """What one speculation read, or what ``step()`` would read now.

    ``hparams``: :func:`stamp_key` of the hyper-parameters and knobs the chain reads;
    ``steps``: completed ``step()`` calls; ``reduces``: reduces of the group launched since the
    speculation (0 at launch); ``grads``: ``{name: (storage pointer, version)}`` of each gradient
    (``None``: no gradient); ``writes``: write count of the live state and masters of the names.
    """

    hparams: tuple
    steps: int
    reduces: int
    grads: tuple
    writes: int


def stamp_key(values: Sequence[Any]) -> tuple:
    """A comparable key of hyper-parameter values: numbers / strings / objects by value, a tensor
    (a tensor lr) by identity and version (its value may change in place), a named tuple field by
    field."""
    out = []
    for v in values:
        if hasattr(v, "_version") and hasattr(v, "data_ptr"):
            out.append(("tensor", id(v), v._version))
        elif isinstance(v, tuple):
            out.append(stamp_key(v))
        else:
            out.append(v)
    return tuple(out)


def invalid_reason(launched: Stamp, now: Stamp) -> Optional[str]:
    """``None`` if a speculation stamped ``launched`` gives exactly what ``step()`` computes from
    the inputs stamped ``now``; else why not (then it is discarded)."""
    if now.steps != launched.steps:
        return "a step ran since the speculation"
    if now.reduces != 0:
        return "another backward reduced into these gradients (gradient accumulation)"
    if now.grads != launched.grads:
        return "a gradient was written, zeroed or dropped since (clipping, scaling, zero_grad)"
    if now.hparams != launched.hparams:
        return "the hyper-parameters or execution knobs the update reads changed"
    if now.writes != launched.writes:
        return "the optimizer state or the masters were written since (a load)"
    return None


def auto_choice(off_ms: Sequence[float], on_ms: Sequence[float]) -> bool:
    """``"auto"``: keep the overlap iff the median iteration with it is faster (strictly) than
    without (timings of alternating iterations on this rank; the runtime agrees the sums)."""
    if not off_ms or not on_ms:
        return False
    return statistics.median(on_ms) < statistics.median(off_ms)


def take_stamp(hparams: Sequence[Any], steps: int, reduces: int, names: Sequence[str],
               grads: Mapping[str, Any], live: Sequence[Any]) -> Stamp:
    """The :class:`Stamp` of an owner update of ``names``: ``hparams`` (what the chain reads,
    :func:`stamp_key`), the completed steps, the reduces since, the gradients' storage and
    version, the write count of ``live`` (the state's and masters' tensors of ``names``)."""
    from dmuon.functional.step_checks import write_count
    return Stamp(stamp_key(hparams), steps, reduces, tuple(
        (n, None if grads.get(n) is None else (grads[n].data_ptr(), grads[n]._version))
        for n in names), write_count(*live))


def replay_key(stamp: Stamp, live_ptrs: Sequence[int], state_leaves: Sequence[Any]
               ) -> Optional[tuple]:
    """The key under which an early update stamped ``stamp`` may run as a captured CUDA graph
    (replayed only while the key recurs), or ``None``: it may not.

    A graph replays the kernels it recorded with every number the update's Python read baked in,
    on the addresses it read and wrote. So the key is the hyper-parameters and knobs
    (:func:`stamp_key`: a tensor value by its version), the names, the gradients' storage and
    ``live_ptrs`` (the storage of the live state and masters it copies in). ``None`` where the
    update reads the step itself: a schedule among the hyper-parameters (a function, evaluated
    at the step) or a step count in the chain's state (``state_leaves``' 0-d tensors: Adam's
    bias correction, a scheduled stage), whose values change at every step."""
    def schedules(values: Any) -> bool:
        return any(schedules(v) if isinstance(v, tuple) else callable(v) for v in values)
    if schedules(stamp.hparams) or any(getattr(t, "ndim", None) == 0 for t in state_leaves):
        return None
    return (stamp.hparams, tuple((n, g[0] if g else None) for n, g in stamp.grads),
            tuple(live_ptrs))


def by_group(grads: Mapping[str, Any], group_of: Mapping[str, str], done: Sequence[str]
             ) -> list[list[str]]:
    """The names with a gradient not in ``done``, per hook group (the unit of an owner update
    while the overlap is on: the same NS batches whether it ran early or in ``step()``)."""
    out: dict[str, list[str]] = {}
    for n, g in grads.items():
        if g is not None and n not in done:
            out.setdefault(group_of[n], []).append(n)
    return list(out.values())


#: ``"auto"``: iterations left out (warm-up), then timed each way; iteration ``k`` (counted from
#: the mode's setting) runs with the overlap iff ``k`` is odd
AUTO_WARMUP, AUTO_EACH = 4, 5


def auto_split(ms: Mapping[int, float]) -> tuple[list[float], list[float]]:
    """``(without, with)``: ``"auto"``'s iteration times (``{iteration: ms}``) by mode."""
    return [t for k, t in ms.items() if not k % 2], [t for k, t in ms.items() if k % 2]


def auto_verdict(off_ms: Sequence[float], on_ms: Sequence[float], votes: Sequence[int]
                 ) -> tuple[str, str]:
    """``"auto"``'s final ``(mode, reason)``: ``"on"`` iff most ranks voted for it (``votes``:
    ``(ranks faster with it, ranks)``, agreed); the reason gives this rank's medians (``off_ms``,
    ``on_ms``: :func:`auto_split`) and the vote."""
    mode = "on" if 2 * votes[0] > votes[1] else "off"
    return mode, (f"auto: {mode} (median iteration {statistics.median(off_ms):.2f} ms without, "
                  f"{statistics.median(on_ms):.2f} ms with on this rank; {votes[0]} of {votes[1]} "
                  "ranks faster with it)")
