"""What a backward's gradient hooks tell the runtime (pure; the runtime's hooks feed it).

* each hook group's gradients in the current backward (:class:`GradState`): a group is
  **complete** once every one of its params got its local gradient, unless it is reused (called
  more than once in one forward: :attr:`dmuon.functional.forward_log.ForwardLog.reused`), whose
  later calls may still add, so its reduce waits for the backward's end;
* the **reduce order**: every rank launches the groups' reduces in the program's one fixed order
  (:attr:`dmuon.functional.program.StepProgram.reduce_order`), a group as soon as it and every
  group before it are complete, and at the backward's end every group not launched yet, complete
  or not (:meth:`BackwardLog.next_due`), whatever order the gradients arrive in on each rank;
* a gradient that arrives after its group's reduce was launched would be left out of it: raised.
"""
from __future__ import annotations

import enum
from typing import Mapping, Optional, Sequence

__all__ = ["GradState", "BackwardLog"]


class GradState(enum.Enum):
    """A group's gradients in the current backward (``REDUCED``: its reduce was launched)."""

    IDLE = "idle"
    ACCUMULATING = "accumulating"
    COMPLETE = "complete"
    REDUCED = "reduced"


class BackwardLog:
    """The gradient arrivals of one model's hook groups in the current backward, and the cursor
    into the fixed reduce order.

    Args:
      group_names: ``{group key: its dedicated param names}``.

    Attributes:
      order: the reduce order (empty until :meth:`set_order`, at the first forward).
      state: ``{group key: GradState}``.
    """

    def __init__(self, group_names: Mapping[str, Sequence[str]]) -> None:
        self._sizes = {k: len(v) for k, v in group_names.items()}
        self.order: tuple[str, ...] = ()
        self.state = dict.fromkeys(self._sizes, GradState.IDLE)
        self._arrived: dict[str, set[str]] = {k: set() for k in self._sizes}
        self._next = 0  # index into order of the next reduce to launch

    def set_order(self, order: Sequence[str]) -> None:
        """The program's reduce order (every group once)."""
        if sorted(order) != sorted(self._sizes):
            raise ValueError(f"the reduce order {list(order)} must name every hook group once "
                             f"({sorted(self._sizes)})")
        self.order = tuple(order)

    def arrive(self, key: str, name: str, *, defer: bool = False) -> None:
        """A local gradient of ``name`` (in group ``key``) arrived in this backward (``defer``:
        the group never completes early; the backward's end reduces it).

        Raises:
          RuntimeError: the group's reduce was already launched in this backward (the gradient
            would be left out of it).
        """
        if self.state[key] is GradState.REDUCED:
            raise RuntimeError(
                f"dmuon: a gradient of {name} arrived after the reduce of its hook group {key!r} "
                "was launched in this backward, so it would be lost (its params got gradients in "
                "two separate backward segments, e.g. reentrant activation checkpointing around a "
                "module whose weights another segment also uses). Use "
                "torch.utils.checkpoint(..., use_reentrant=False), or call the module that owns "
                "the weights in each segment.")
        arrived = self._arrived[key]
        arrived.add(name)
        self.state[key] = (GradState.COMPLETE if len(arrived) == self._sizes[key] and not defer
                           else GradState.ACCUMULATING)

    def next_due(self, every: bool = False) -> Optional[str]:
        """The next group in the reduce order whose reduce is due: complete, with every group
        before it launched (``every``: complete or not, at the backward's end); ``None`` when none
        is. The caller launches it, then calls :meth:`launched`."""
        if self._next >= len(self.order):
            return None
        key = self.order[self._next]
        return key if every or self.state[key] is GradState.COMPLETE else None

    def launched(self, key: str) -> None:
        """The reduce of ``key`` (:meth:`next_due`'s) was launched."""
        if self._next >= len(self.order) or self.order[self._next] != key:
            raise ValueError(f"launched({key!r}) out of the reduce order {self.order}")
        self.state[key] = GradState.REDUCED
        self._next += 1

    def end(self) -> None:
        """The backward ended (or raised): every group starts again from ``IDLE``."""
        self._next = 0
        for key, arrived in self._arrived.items():
            arrived.clear()
            self.state[key] = GradState.IDLE
