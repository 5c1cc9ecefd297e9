"""What the hook groups' forwards tell the runtime (pure; the runtime's hooks feed it).

* the **forward order**: each rank records its first forward's order of hook groups; the runtime
  gathers every rank's :meth:`ForwardLog.proposal` once and :meth:`ForwardLog.agree` keeps it where
  all ranks proposed the same, else the static group order (every rank prefetches one group);
* **reused** groups: called more than once in one forward (also under ``no_grad``: reentrant
  checkpointing runs its segments so, and each segment's backward gives them a gradient), so their
  reduce waits for the end of the backward; once reused, always;
* what counts **per forward** starts again at the model's forward, at each backward's end and at
  each step (:meth:`ForwardLog.new_forward`): a forward that bypasses the model's own hooks (a
  method registered with ``register_fsdp_forward_method`` that calls the blocks) still runs the
  blocks' hooks.
"""
from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["ForwardLog"]


class ForwardLog:
    """The forward order and per-forward counts of one model's hook groups.

    Attributes:
      order: the forward order (the static group order until :meth:`agree`).
      final: the order was agreed (or fell back) across ranks.
      reused: groups once called more than once in one forward.
    """

    def __init__(self, static_order: Sequence[str]) -> None:
        self.order: list[str] = list(static_order)
        self.final = False
        self.reused: set[str] = set()
        self._seen: dict[str, None] = {}  # the first forward's order (an ordered set)
        self._calls: dict[str, int] = {}  # calls of each group in the current forward
        self._group_seen = False

    def new_forward(self) -> None:
        """A new forward starts: the per-forward counts start again."""
        self._calls.clear()
        self._group_seen = False

    def note(self, key: str) -> None:
        """Group ``key``'s forward (not a recomputation)."""
        self._calls[key] = self._calls.get(key, 0) + 1
        if self._calls[key] > 1:
            self.reused.add(key)
        if not self.final:
            self._seen.setdefault(key)

    def first_group(self) -> bool:
        """True at the first hook group of a forward (then False until :meth:`new_forward`)."""
        first, self._group_seen = not self._group_seen, True
        return first

    def proposal(self) -> tuple[str, ...]:
        """This rank's order to agree on: its first forward's, then the groups it did not call in
        the static order."""
        return (*self._seen, *(k for k in self.order if k not in self._seen))

    def agree(self, proposals: Sequence[tuple[str, ...]]) -> bool:
        """Fix the order from every rank's :meth:`proposal` (the same list on every rank): theirs
        where all are equal (returns True), else the static order (False)."""
        self.final = True
        if len(set(proposals)) == 1:
            self.order = list(proposals[0])
            return True
        return False

    def next_group(self, key: str, backward: bool = False) -> Optional[str]:
        """The group after ``key`` in the agreed order (before it, ``backward=True``); ``None``
        before the agreement, at either end, or for an unknown key."""
        if not self.final or key not in self.order:
            return None
        j = self.order.index(key) + (-1 if backward else 1)
        return self.order[j] if 0 <= j < len(self.order) else None
