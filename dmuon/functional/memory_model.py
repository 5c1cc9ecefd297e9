"""Per-rank memory of the dedicated matrices, phase by phase, from the step program (pure).

What a rank ``(s, r)`` holds for the dedicated matrices (FSDP2's own params and AdamW's moments are
not modelled here):

* **masters** — every master of its shard column (the column's master buckets), always;
* **state** — the owner's optimizer state of the matrices it owns (Muon: one momentum buffer per
  matrix, in ``momentum_dtype``: :func:`~dmuon.functional.state_dtype.state_nbytes`, e.g. fp32
  4 bytes per element, bf16 2, fp8 1 plus a 4-byte scale per matrix), always; with
  ``offload_state`` it is held in host memory (``host_state``) and counts on the device only
  from its hook group's reduce in backward to the step (its staging buffers: each group's copy
  starts when its reduce is issued, up to ``prefetch_bytes``), plus, in the step, one chunk of
  decoded working momentum (``chunk_bytes``; a narrow ``momentum_dtype`` on the device too);
* **gathered** — the unshard buckets of the hook groups gathered at a time: Z3 holds the group it
  runs plus the one it prefetches (forward and backward), and the root group for the whole forward;
  Z2 holds every group from its forward until its gradient reduce in backward;
* **reduce** — the gradient buckets: those of its own column are kept from a group's reduce to the
  step (the owner's averaged gradients), a group's other buckets only while its reduce runs;
* **copies** — the sharded style (``collectives="sharded"``): the rank's ``1/G`` of each such
  group's gathered buffer in the compute dtype, always;
* **staging** — a group moved per bucket (``collectives="per_bucket"``,
  :mod:`dmuon.functional.collectives`) stages its all-gather in ``G`` padded parts and its
  reduce-scatter in ``G + 1`` while the collective runs: the largest such staging is added to the
  forward (all-gather) and backward (all-gather + reduce-scatter) peaks.

:func:`rank_memory` gives the peak of each phase (``between_steps``, ``forward``, ``backward``,
``step``); :func:`check_memory` raises :class:`MemoryBudgetError` naming the rank and phase that
exceed a budget, so an over-budget plan is refused before any process starts.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from typing import Any, Optional

import torch

from dmuon.functional.program import ROOT_GROUP, StepProgram
from dmuon.functional.schedule import ShardBuckets, ShardCopy, ShardReduceScatter
from dmuon.functional.specs import dtype_from_str
from dmuon.functional.state_dtype import (STEP_CHUNK_BYTES, check_state_dtype, chunk_peak,
                                          state_nbytes)

__all__ = ["RankMemory", "MemoryBudgetError", "rank_memory", "check_memory",
           "owner_state_bytes"]


class RankMemory(NamedTuple):
    """Bytes one rank holds for the dedicated matrices.

    Attributes:
      masters, state: held always on the device (``state`` with ``offload_state``: the 8-bit
        floats' per-matrix scales only).
      phases: ``{phase: peak bytes}`` for ``between_steps``, ``forward``, ``backward``, ``step``
        (masters and state included).
      host_state: the owner's state in host memory (offload).
    """

    masters: int
    state: int
    phases: Mapping[str, int]
    host_state: int = 0

    @property
    def peak(self) -> int:
        return max(self.phases.values())


class MemoryBudgetError(ValueError):
    """A plan whose per-rank memory exceeds the budget (the message names rank, phase, bytes)."""


def _bytes(buckets) -> int:
    return sum(b.nbytes for b in buckets)


def owner_state_bytes(numels: Mapping[str, int], momentum_dtype: Any = None, *,
                      working: Any = "torch.float32") -> int:
    """Bytes of the Muon state of the matrices ``{name: numel}`` one owner holds, stored in
    ``momentum_dtype`` (what ``dmuon.Muon(momentum_dtype=...)`` allocates; ``working``: the
    masters' dtype, which fp32 state follows)."""
    w = dtype_from_str(working)
    return state_nbytes(sum(numels.values()), momentum_dtype, matrices=len(numels), working=w)


def rank_memory(program: StepProgram, coord: Sequence[int], *, state_itemsize: Optional[int] = None,
                prefetch: bool = True, momentum_dtype: Any = None,
                offload_state: bool = False, chunk_bytes: Optional[int] = STEP_CHUNK_BYTES,
                prefetch_bytes: Optional[int] = None) -> RankMemory:
    """The per-phase peak bytes of rank ``coord = (s, r)`` (see the module docstring).

    Args:
      program: the model's step program.  coord: the rank's ``(s, r)``.
      state_itemsize: bytes per element of the owner's state (overrides ``momentum_dtype``).
      prefetch: the forward / backward prefetch of the next group (the runtime's default).
      momentum_dtype, offload_state: ``dmuon.Muon``'s options of the same names.
      chunk_bytes, prefetch_bytes: the optimizer's step chunk budget and (offload) cap on the
        copies the backward starts ahead (``MomentumStorage.chunk_bytes`` / ``prefetch_bytes``).

    Raises:
      ValueError: ``coord`` outside the program's mesh, ``state_itemsize < 1``, ``chunk_bytes < 0``.
    """
    s, r = (int(x) for x in coord)
    G, R = program.shard_size, program.replicate_size
    if not (0 <= s < G and 0 <= r < R):
        raise ValueError(f"rank_memory: coord {tuple(coord)} is outside the mesh "
                         f"(s < {G}, r < {R})")
    if (state_itemsize is not None and state_itemsize < 1) or (chunk_bytes is not None
                                                                and chunk_bytes < 0):
        raise ValueError(f"rank_memory: state_itemsize must be >= 1 and chunk_bytes >= 0, got "
                         f"{state_itemsize} and {chunk_bytes}")
    masters = _bytes(b for b in program.master_layout.buckets if b.key.column == s)
    owned = set(program.owned((s, r)))
    entries = [(e, b.key.dtype) for b in program.master_layout.buckets for e in b.entries
               if e.name in owned]
    if state_itemsize is not None:
        state = sum(e.numel for e, _ in entries) * state_itemsize
    else:
        state = sum(owner_state_bytes({e.name: e.numel}, momentum_dtype, working=dt)
                    for e, dt in entries)
    # during the step: one chunk of decoded working momentum (a narrow dtype; fp32 offloaded:
    # the staging buffer is the working one); offloaded, the staging copies of the data
    narrow = check_state_dtype(momentum_dtype) != torch.float32
    chunk = chunk_peak([e.numel * _itemsize(dt) for e, dt in entries], chunk_bytes)
    working = chunk if narrow else 0
    data = {e.name: (e.numel * state_itemsize if state_itemsize is not None else
                     state_nbytes(e.numel, momentum_dtype, matrices=0, working=dtype_from_str(dt)))
            for e, dt in entries}
    scales = state - sum(data.values())  # the 8-bit floats' scales stay on the device
    cap = prefetch_bytes if offload_state and prefetch_bytes is not None else None
    staged_of: dict[str, int] = {}  # per hook group: its owned momentum data (offloaded)
    if offload_state:
        for b in program.master_layout.buckets:
            staged_of[b.key.group] = staged_of.get(b.key.group, 0) + sum(
                data.get(e.name, 0) for e in b.entries)

    def staged(groups: Sequence[str]) -> int:  # copies started for these groups (capped)
        total = sum(staged_of.get(k, 0) for k in groups)
        return total if cap is None else min(total, cap)

    all_data = sum(data.values())
    # the step starts with what the backward staged (all, or the cap plus a chunk ahead)
    step_extra = working + ((all_data if cap is None else min(all_data, cap + 2 * chunk))
                            if offload_state else 0)
    host = all_data if offload_state else 0
    state = scales if offload_state else state
    order = [k for k in program.forward_order if k != ROOT_GROUP]
    un = {k: _bytes(program.unshard_layout.buckets_of(k)) for k in program.forward_order}
    red_own = {k: _bytes(b for b in program.reduce_layout.buckets_of(k) if b.key.column == s)
               for k in program.forward_order}
    red_all = {k: _bytes(program.reduce_layout.buckets_of(k)) for k in program.forward_order}
    root = un.get(ROOT_GROUP, 0)
    z3 = {k: program.groups[k].reshard_after_forward for k in order}
    window = 2 if prefetch else 1

    def held_z3(i: int, ks: list[str]) -> int:  # a Z3 group and the ones it prefetches
        return sum(un[k] for k in ks[i:i + window] if z3[k])

    stage = {k: tuple(sum(_staging(op, program.shard_size) for op in program.phase(ph, k))
                      for ph in ("unshard", "reduce")) for k in program.forward_order}
    z2_all = sum(un[k] for k in order if not z3[k])
    forward = max((held_z3(i, order) for i in range(len(order))), default=0) + z2_all + root
    back = list(reversed(order))
    backward = 0
    for i, k in enumerate(back):  # group k's backward: its reduce launches at its end
        kept = sum(red_own[j] for j in back[:i])                      # earlier reduces, held
        gathered = held_z3(i, back) + sum(un[j] for j in back[i:] if not z3[j]) + root
        backward = max(backward, kept + gathered + red_all[k] + staged(back[:i]))
    copies = sum(op.nbytes for k in program.forward_order for op in program.groups[k].unshard
                 if isinstance(op, ShardCopy))  # (the sharded style's parts, kept)
    base = masters + state + copies
    fwd_stage = max((a for a, _ in stage.values()), default=0)
    bwd_stage = max((a + b for a, b in stage.values()), default=0)
    phases = {"between_steps": base, "forward": base + forward + fwd_stage,
              "backward": base + backward + bwd_stage, "step": base + sum(red_own.values()) + step_extra}
    return RankMemory(masters, state, phases, host)


def _staging(op: Any, G: int) -> int:
    """Bytes of the staging tensors of a per-bucket op (0 for the per-owner ops, in place)."""
    if not isinstance(op, ShardBuckets):
        return 0
    return (G + (1 if isinstance(op, ShardReduceScatter) else 0)) * op.nbytes


def _itemsize(dtype: Any) -> int:
    return dtype_from_str(dtype).itemsize


def check_memory(program: StepProgram, budget_bytes: int, **kw) -> dict[tuple[int, int], RankMemory]:
    """Every rank's :func:`rank_memory`; raise if any phase of any rank exceeds ``budget_bytes``.

    Raises:
      MemoryBudgetError: naming each rank and phase over the budget and by how much.
    """
    G, R = program.shard_size, program.replicate_size
    out = {(s, r): rank_memory(program, (s, r), **kw) for r in range(R) for s in range(G)}
    over = [(c, ph, b) for c, m in out.items() for ph, b in m.phases.items() if b > budget_bytes]
    if over:
        worst = sorted(over, key=lambda x: -x[2])[:6]
        raise MemoryBudgetError(
            f"the plan needs more than the budget of {budget_bytes} bytes per rank for the "
            "dedicated matrices: " + "; ".join(f"rank {c} in {ph}: {b} bytes (+{b - budget_bytes})"
                                               for c, ph, b in worst)
            + ". Use more ranks (a larger shard group), Z3 (reshard_after_forward=True), or "
            "smaller hook groups.")
    return out
