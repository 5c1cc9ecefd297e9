"""Messages that name ranks (pure): each problem or value once, under the ranks that have it, so
that an error raised on every rank (:mod:`dmuon.stateful.runtime.agree`) stays short at any world
size."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

__all__ = ["MAX_GROUPS", "MAX_MESSAGES", "describe_problems", "describe_values",
           "collective_failure", "PEER_GONE", "SAVE_FIX", "not_on_every_rank"]

#: at most this many groups of ranks, and this many messages per group, in a detail
MAX_GROUPS = 8
MAX_MESSAGES = 12


def describe_problems(problems: Mapping[int, Sequence[str]]) -> str:
    """``"rank(s) [0, 2]: a; b | rank(s) [1]: c"``: each problem once, under the ranks that have
    it (ranks with the same problems share one entry); ``""`` when no rank has one."""
    ranks_of: dict[str, list[int]] = {}
    for r in sorted(problems):
        for p in dict.fromkeys(problems[r]):
            ranks_of.setdefault(str(p), []).append(r)
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for p, rs in ranks_of.items():
        by_ranks.setdefault(tuple(rs), []).append(p)
    parts = []
    for rs, ps in list(by_ranks.items())[:MAX_GROUPS]:
        more = f"; ... ({len(ps) - MAX_MESSAGES} more)" if len(ps) > MAX_MESSAGES else ""
        parts.append(f"rank(s) {list(rs)}: " + "; ".join(ps[:MAX_MESSAGES]) + more)
    if len(by_ranks) > MAX_GROUPS:
        parts.append(f"... ({len(by_ranks) - MAX_GROUPS} more groups of ranks)")
    return " | ".join(parts)


def describe_values(values: Sequence[Any], show: Callable[[Any], str] = str) -> str:
    """``"ranks [0, 2]: x | ranks [1]: y"``: each distinct value (hashable) under the ranks that
    hold it."""
    ranks_of: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        ranks_of.setdefault(v, []).append(r)
    parts = [f"ranks {rs}: {show(v)}" for v, rs in list(ranks_of.items())[:MAX_GROUPS]]
    if len(ranks_of) > MAX_GROUPS:
        parts.append(f"... ({len(ranks_of) - MAX_GROUPS} more values)")
    return " | ".join(parts)


#: what gloo and NCCL say when a peer's process is gone (its connection closed mid-collective)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote worker",
             "Broken pipe")


def collective_failure(what: str, ranks: Sequence[int], rank: int, timeout: Any, err: Any,
                       after: str = "") -> str:
    """The message of dmuon's collective ``what`` (over ``ranks``) that failed on ``rank`` with
    ``err`` under ``timeout`` (``None``: the default group's): a timeout means a rank never came.
    ``after``: what else to say before the bound's fix."""
    bound = f" (timeout {timeout})" if timeout is not None else ""
    if any(w in str(err) for w in PEER_GONE):
        after = ("The error says a peer's connection closed: a rank's process is gone (crashed, "
                 "killed, out of memory: see its log). " + after)
    return (f"dmuon: the {what} collective failed on rank {rank}{bound}: {err}. A timeout means a "
            f"rank of {list(ranks)} never reached it: every rank must make the same dmuon calls "
            "(forward, backward, optimizer.step(), state-dict and clip calls) in the same order "
            "(none may skip a forward or take another code path: a block called on some ranks "
            "only, or twice on some ranks only, an evaluation forward on some ranks only), or a "
            "rank crashed (see its "
            f"log). {after}The bound is dedicate_params(..., timeout=...).")


#: what to do instead of a state dict / save on some ranks only (:func:`not_on_every_rank`)
SAVE_FIX = ("Call it on every rank and write on one: `sd = dmuon.get_model_state_dict(model)` on "
            "every rank, then on rank 0 only `torch.save(sd, path)` or Hugging Face "
            "`model.save_pretrained(dir, state_dict=sd)`; with a Trainer, `trainer.save_model(dir)` "
            "on every rank. (`model.save_pretrained(dir, is_main_process=...)` on every rank does "
            "not work on an FSDP2 model, with or without dmuon.)")


def not_on_every_rank(what: str, detail: str, bound_env: str) -> str:
    """The message of a collective call ``what`` made on some ranks only (``detail``: which
    ranks did not come, or why; ``bound_env``: the variable that gives slow ranks longer)."""
    return (f"dmuon: {what} is collective on a dmuon model: {detail}: state_dict / save is "
            f"collective: call it on every rank. {SAVE_FIX} Nothing was sent; the call can be made "
            f"again on every rank. (If those ranks raised in an earlier call and took another "
            f"path, their error is the cause: see their log. A rank that is only slow to get here "
            f"can be given longer: {bound_env}=seconds.)")
