"""The step as phases: one pure function per phase of a hook group's step, each taking the
:class:`~dmuon.functional.program.StepProgram`, this rank's trees and the buffers the caller
donates, and returning the schedule to run on them (and, once it ran, the trees it produced).

Both drivers call these functions: the pure step (:func:`dmuon.functional.step.rank_step` /
:func:`~dmuon.functional.step.world_step`, compositions of them) and the runtime's hooks
(:class:`dmuon.stateful.runtime.param_group.DedicatedParamGroup`, the gradient ledger), which run
the returned schedules on the executor's streams at the moments FSDP2's overlap needs. The
schedules are the program's own (built once per model): a phase does no planning.

=====================================  ===========================================================
phase                                  what
=====================================  ===========================================================
:func:`gather` / :func:`gathered`      forward gather of group ``key`` (``regather=True``: Z3's
                                       backward re-gather, the same ops named as in
                                       :meth:`~dmuon.functional.program.StepProgram.step_schedule`):
                                       this rank's column's masters, cast to the compute dtypes,
                                       into the unshard buffers (:func:`gather_buffers`); then
                                       every full matrix as a view
:func:`reduce` / :func:`reduced`       backward gradient reduce: local gradients (zeros and
                                       presence 0 where a rank has none) into the reduce buffers;
                                       then the owner's averaged views and presence elements
:func:`accumulate` / :func:`resolve`   the owner's accounting: several reduces (several synced
                                       backwards before a step) summed, FSDP2's divide factor
                                       applied (a scale the caller passes), presence resolved
                                       with one batched host read -> ``{owned name: grad | None}``
:func:`owner_step`                     the owner's update (:mod:`dmuon.functional.owner_step`)
:func:`publish` / :func:`published`    post-step publish of the new masters to the replicas of
                                       their column
=====================================  ===========================================================

Buffers are ``{BucketKey: 1-D tensor}`` in the bucket's dtype; a phase writes only the entries it
names (``where`` of :mod:`dmuon.functional.packing`) and returns views, so the caller decides where
buffers live (the runtime's pools and streams, or plain tensors in the simulator).
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from dmuon.functional.buckets import BucketKey, to_torch_dtype
from dmuon.functional.owner_step import owner_step
from dmuon.functional.packing import pack_, presence, unpack, zero_buffers
from dmuon.functional.program import StepProgram
from dmuon.functional.schedule import COPY_COLUMN, Schedule, ShardCopy

__all__ = ["Runner", "ReducedGrad", "OwnerGrad", "gather_buffers", "gathered_storage", "gather",
           "gathered", "reduce", "reduced",
           "accumulate", "resolve", "owner_step", "publish", "published"]

Buffers = Mapping[BucketKey, Tensor]
#: ``run(schedule, buffers)``: execute ``schedule`` on this rank's ``{bucket key: 1-D tensor}``
#: buffers in place and return when done (the runtime's ``Executor.run``; a runner is collective:
#: every rank calls it with the same schedules in the same order).
Runner = Callable[[Schedule, dict], None]


class ReducedGrad(NamedTuple):
    """An averaged gradient this rank owns, read from one reduce's buffers (:func:`reduced`).

    ``present_here``: the owner itself had a local gradient (then some rank had one for sure).
    ``flag``: the reduce's 0-d presence element (> 0 iff any rank had one); read on the host only
    when no reduce had ``present_here`` (:func:`resolve`), so dense models never sync for it.
    """

    name: str
    grad: Tensor
    present_here: bool
    flag: Optional[Tensor]


class OwnerGrad(NamedTuple):
    """The owner's gradient of one matrix, summed over the reduces since the last step
    (:func:`accumulate`).

    ``present``: the owner had a local gradient in one of them. ``flags``: otherwise, their
    presence elements.
    """

    grad: Tensor
    present: bool
    flags: tuple[Tensor, ...]


def _column(s: int):
    return lambda b, e: b.key.column == s  # noqa: E731


# ------------------------------------------------------------------ gather
def gather_buffers(program: StepProgram, key: str, device: "torch.device | str" = "cpu"
                   ) -> dict[BucketKey, Tensor]:
    """Zeroed buffers of hook group ``key``'s gather: one 1-D tensor per bucket of the program's
    unshard layout. The sharded style (:class:`~dmuon.functional.schedule.ShardCopy`) adds per
    dtype the group's flat buffer, of which those buckets are views, and this rank's copy (the
    caller keeps the copy between steps; the flat buffer may be freed with the buckets)."""
    g = program.groups[key]
    ops = [op for op in g.unshard if isinstance(op, ShardCopy)]
    if not ops:
        return zero_buffers(program.unshard_layout.buckets_of(key), device)
    out: dict[BucketKey, Tensor] = {}
    for op in ops:
        dt = to_torch_dtype(op.dtype)
        flat = out[op.bucket] = torch.zeros(len(op.sizes) * op.numel, dtype=dt, device=device)
        out[op.copy_key] = torch.zeros(op.numel, dtype=dt, device=device)
        for k, at, n in zip(op.keys, op.starts, op.sizes):
            if k is not None:
                out[k] = flat.narrow(0, at, n)
    return out


def gathered_storage(buffers: Buffers) -> list[Tensor]:
    """The tensors of :func:`gather_buffers` whose storage holds the gathered matrices (what a
    reshard may free; not the sharded style's copies, nor views)."""
    return [t for k, t in buffers.items() if t._base is None and k.column != COPY_COLUMN]


def gather(program: StepProgram, key: str, coord: Sequence[int], masters: Mapping[str, Tensor],
           buffers: Buffers, *, regather: bool = False, refresh: bool = True) -> Schedule:
    """The forward gather of hook group ``key`` on rank ``coord = (s, r)``.

    Writes the masters of column ``s`` (cast to the compute dtypes) into ``buffers`` (donated:
    :func:`gather_buffers`; the other columns' buckets are what the schedule fills) and returns
    the schedule to run on them: the group's unshard (``regather``: Z3's backward re-gather, the
    same ops renamed as in :meth:`~dmuon.functional.program.StepProgram.step_schedule`). Read the
    result with :func:`gathered` once it ran.

    The sharded style gathers the ranks' copies (``buffers`` holds this rank's between steps):
    ``refresh`` (the masters changed since the copies were made; the default, right for fresh
    buffers) writes the masters and makes the copies current first; otherwise nothing is written.
    """
    g = program.groups[key]
    if refresh or not len(g.refresh):
        pack_(program.unshard_layout.buckets_of(key), buffers, masters, where=_column(coord[0]))
    return g.gather_schedule(regather=regather, refresh=refresh)


def gathered(program: StepProgram, key: str, buffers: Buffers) -> dict[str, Tensor]:
    """``{name: full matrix}`` of hook group ``key`` after its gather ran (views of ``buffers``,
    in the compute dtypes)."""
    return unpack(program.unshard_layout.buckets_of(key), buffers)


# ------------------------------------------------------------------ reduce
def reduce(program: StepProgram, key: str, coord: Sequence[int],
           grads: Mapping[str, Optional[Tensor]], buffers: Buffers
           ) -> tuple[Schedule, dict[str, bool]]:
    """The backward gradient reduce of hook group ``key`` on rank ``coord``.

    Writes this rank's local gradients into ``buffers`` (donated: one 1-D tensor per bucket of the
    group in the program's reduce layout; a matrix absent or ``None`` in ``grads`` sends zeros and
    presence 0, so the average counts it as zero).

    Returns:
      tuple: ``(the group's reduce schedule, {owned name: this rank had a local gradient})``
      (the second is what :func:`reduced` needs back).
    """
    buckets = program.reduce_layout.buckets_of(key)
    sent = pack_(buckets, buffers, grads)
    c = tuple(coord)
    return program.groups[key].reduce, {e.name: sent[e.name] for b in buckets for e in b.entries
                                        if e.owner == c}


def reduced(program: StepProgram, key: str, coord: Sequence[int], buffers: Buffers,
            owned_here: Mapping[str, bool]) -> list[ReducedGrad]:
    """After group ``key``'s reduce ran: one :class:`ReducedGrad` per matrix rank ``coord`` owns
    (views of ``buffers``), in layout order. ``owned_here``: :func:`reduce`'s second result."""
    buckets = program.reduce_layout.buckets_of(key)
    c = tuple(coord)
    mine = lambda b, e: e.owner == c  # noqa: E731
    flags = presence(buckets, buffers, where=mine)
    return [ReducedGrad(n, v, owned_here[n], flags.get(n))
            for n, v in unpack(buckets, buffers, where=mine).items()]


# ------------------------------------------------------------------ the owner's accounting
def accumulate(held: Optional[OwnerGrad], new: ReducedGrad, scale: Optional[float] = None, *,
               donate: bool = False) -> OwnerGrad:
    """Add one reduce's averaged gradient to what the owner holds for that matrix.

    Args:
      held: the sum of the earlier reduces since the last step (``None``: none).
      new: this reduce's :class:`ReducedGrad`.
      scale: multiplies ``new.grad`` first (``None``: 1): FSDP2's divide factor, which the caller
        reads from FSDP2's state (``dmuon.compat.fsdp_info.mean_to_fsdp_scale``: a mean over the
        data-parallel ranks turned into what ``set_gradient_divide_factor`` asks for).
      donate: write in place into ``new.grad`` and ``held.grad`` (the runtime's buffers), else new
        tensors (the same values, bit for bit).
    """
    g = new.grad
    if scale is not None:
        g = g.mul_(scale) if donate else g * scale
    if held is not None:
        g = held.grad.add_(g) if donate else held.grad + g
    flags = () if held is None else held.flags
    if not new.present_here and new.flag is not None:
        flags = flags + (new.flag,)
    return OwnerGrad(g, new.present_here or (held is not None and held.present), flags)


def resolve(held: Mapping[str, Optional[OwnerGrad]], names: Iterable[str]
            ) -> dict[str, Optional[Tensor]]:
    """``{name: the owner's gradient, or None}`` for each of ``names`` (the owned matrices):
    ``None`` where nothing is held or no rank had a gradient (a single-device optimizer skips
    ``grad is None``). Presence is known without a host read where the owner had a local gradient
    itself; the other matrices' presence elements are read in one batch (one host sync on CUDA,
    in steps where that happens)."""
    unsure = [n for n, h in held.items() if h is not None and not h.present]
    absent: set[str] = set()
    if unsure:
        got = torch.stack([torch.stack(held[n].flags).amax() for n in unsure]).tolist()
        absent = {n for n, f in zip(unsure, got) if not f > 0}
    out: dict[str, Optional[Tensor]] = {}
    for n in names:
        h = held.get(n)
        out[n] = h.grad if h is not None and n not in absent else None
    return out


# ------------------------------------------------------------------ publish
def publish(program: StepProgram, coord: Sequence[int], buffers: Buffers,
            masters: Optional[Mapping[str, Tensor]] = None, *, key: Optional[str] = None
            ) -> Schedule:
    """The post-step publish of rank ``coord``'s column: each owner broadcasts its new masters to
    the other ranks of its column (empty when R == 1).

    Args:
      buffers: the master buffers (donated: one 1-D tensor per master bucket of column ``s``).
      masters: the new masters to write into them first (``None``: the buffers hold them already,
        as the runtime's masters are views of its master buffers).
      key: one hook group (the runtime launches one per group), or ``None``: every group, in the
        static group order.
    """
    layout = program.master_layout
    if masters is not None:
        buckets = layout.buckets if key is None else layout.buckets_of(key)
        pack_(buckets, buffers, masters, where=_column(coord[0]))
    return program.publish_all() if key is None else program.groups[key].publish


def published(program: StepProgram, coord: Sequence[int], buffers: Buffers) -> dict[str, Tensor]:
    """``{name: master}`` of rank ``coord``'s column after its publish ran (views of
    ``buffers``)."""
    return unpack(program.master_layout.buckets, buffers, where=_column(coord[0]))
