"""Hyper-parameters as values or schedules, and the step count as a tensor (pure).

Every hyper-parameter a stage documents as a :data:`Hyper` may be

* a Python ``float`` (checked against its range when the stage is built),
* a 0-d tensor (a value ``torch.compile`` traces as an input, not a constant, and ``torch.vmap``
  can batch: an lr / weight-decay sweep), or
* a function of the step, ``h(count) -> float | 0-d tensor``, where ``count`` is the number of
  updates the stage has done before this one (a 0-d ``float64`` tensor holding an integer: ``0``
  at the first update, optax's ``count``; float64 so that ``lr0 * (1 - t / T)`` computes in double
  precision, as the Python floats of a float schedule would). A stage with a scheduled hyper-parameter keeps that count in its state,
  :class:`ScheduleState` ``(count, inner)``; a stage without one keeps its plain state (so the
  states of float-only chains, and their arithmetic, are what they were).

Tensors and the values of schedules are not range-checked when traced or batched (a check
would read their values); concrete tensors are.

Step counts are 0-d ``float64`` CPU tensors (:func:`new_step`, :func:`next_step`): a count that is a
Python int would be a constant to ``torch.compile`` (a recompile per step) and could not be
carried through ``torch.vmap``.

References:
    M. Hessel et al. "Optax", 2020 (``scale_by_schedule``, ``inject_hyperparams``: a schedule is
    a function of the update count).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor

__all__ = ["Hyper", "ScheduleState", "new_step", "next_step", "as_step", "concrete_count",
           "is_schedule", "value_at", "check_hyper", "is_one", "is_batched", "traced",
           "register_state"]

#: A hyper-parameter: a float, a 0-d tensor, or a function of the update count.
Hyper = Union[float, Tensor, Callable[[Tensor], Any]]


def register_state(cls: type) -> type:
    """Class decorator: let ``torch.load(weights_only=True)`` rebuild this state NamedTuple
    (``torch.serialization.add_safe_globals``). Every state type of dmuon's functional core is
    registered when its module is imported; register your own stage's states the same way."""
    torch.serialization.add_safe_globals([cls])
    return cls


@register_state
class ScheduleState(NamedTuple):
    """State of a stage with a scheduled hyper-parameter: ``count`` (updates done, a 0-d float64
    tensor) and the stage's own state ``inner``."""

    count: Tensor
    inner: Any


def new_step() -> Tensor:
    """A step count of 0: a 0-d ``float64`` CPU tensor."""
    return torch.zeros((), dtype=torch.float64)


def as_step(step: Any) -> Tensor:
    """``step`` as a 0-d tensor (an int, as older states hold, becomes a float64 one)."""
    return step if isinstance(step, Tensor) else torch.tensor(float(int(step)), dtype=torch.float64)


def next_step(step: Any) -> Tensor:
    """``step + 1`` as a 0-d tensor (a new tensor; the input is not written)."""
    return as_step(step) + 1


def traced() -> bool:
    """True while ``torch.compile`` traces (values of tensors are not available)."""
    return bool(torch.compiler.is_compiling())


def is_batched(t: Any) -> bool:
    """True for a tensor inside a ``torch.func`` transform (``vmap`` batches it); False while
    ``torch.compile`` traces."""
    if traced() or not isinstance(t, Tensor):
        return False
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


def concrete_count(step: Any) -> Optional[int]:
    """The step as a Python int where its value may be read (eager, not batched), else ``None``."""
    if not isinstance(step, Tensor):
        return int(step)
    if traced() or is_batched(step):
        return None
    return int(step)


def is_schedule(v: Any) -> bool:
    """A function of the step (not a value)."""
    return callable(v) and not isinstance(v, Tensor)


def value_at(v: Any, count: Any) -> Any:
    """The value of hyper-parameter ``v`` at update ``count``: a schedule's value is a Python
    float where it can be read without a device sync (eager, not batched, a CPU scalar), so an
    eager schedule runs the arithmetic of the float it equals; traced or batched it stays a
    tensor (``torch.compile`` keeps it a graph input)."""
    if not is_schedule(v):
        return v
    out = v(count)
    if isinstance(out, Tensor) and out.numel() == 1 and out.device.type == "cpu" \
            and not traced() and not is_batched(out):
        return float(out)
    return out


def is_one(x: Any) -> bool:
    """``x`` is the Python number 1 (a tensor never is: its value is not read)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 1


def check_hyper(name: str, v: Any, *, lo: float = 0.0, hi: Optional[float] = None,
                hi_open: bool = True, where: str = "") -> Any:
    """Validate a :data:`Hyper` and return it (floats as ``float``).

    Args:
      name: the hyper-parameter's name (in messages).  v: its value.
      lo, hi: the allowed range ``[lo, hi)`` (``hi_open=False``: ``[lo, hi]``; ``hi=None``: no upper
        bound, finite).  where: the stage, for messages.

    Raises:
      TypeError: not a number, 0-d floating tensor or callable.
      ValueError: a float, or a concrete tensor, out of range.
    """
    at = f"{where}: " if where else ""
    if is_schedule(v):
        return v
    if isinstance(v, Tensor):
        if v.ndim != 0 or not v.is_floating_point():
            raise TypeError(f"{at}{name} as a tensor must be a 0-d float tensor, got shape "
                            f"{tuple(v.shape)} {v.dtype}")
        if traced() or is_batched(v) or v.device.type == "meta":
            return v
        _check_range(name, float(v), lo, hi, hi_open, at)
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{at}{name} must be a float, a 0-d tensor or a function of the step "
                        f"count, got {type(v).__name__} {v!r}")
    _check_range(name, float(v), lo, hi, hi_open, at)
    return float(v)


def _check_range(name: str, x: float, lo: float, hi: Optional[float], hi_open: bool,
                 at: str) -> None:
    # comparisons only (no math.isfinite): a float that torch.compile traces as a symbol (a
    # value that changes between calls) is checked by guards, with no graph break
    ok = x >= lo and x < math.inf and (hi is None or (x < hi if hi_open else x <= hi))
    if not ok:
        rng = f"[{lo}, {hi}{')' if hi_open else ']'}" if hi is not None else f">= {lo}, finite"
        raise ValueError(f"{at}{name} must be in {rng}, got {x!r}")
