"""The step program: every collective of one training step of the dedicated matrices, as one
frozen value built once per model.

A dedicated model's step moves its matrices in a fixed pattern that depends only on the owner
plan, the hook groups, the dtypes and the mode, so it is data (built at the first forward, when
FSDP2's dtypes are known, and never re-planned):

===============  ====================================================  =========================
phase            what                                                  schedule
===============  ====================================================  =========================
``unshard``      forward gather of a hook group (owner column           shard-axis ``Broadcast``
                 broadcasts its bucket); Z3 groups run it again at       per bucket (or one
                 the start of their backward                             ``ShardAllGather``, or
                                                                         ``ShardCopyGather`` of
                                                                         the sharded copy)
``reduce``       backward gradient reduce, in one fixed order (the      shard-axis ``Reduce``
                 reverse of the forward order), with one presence        (or one ``ShardReduce
                 element per matrix                                      Scatter``) + replicate
                                                                         stage
``publish``      post-step HSDP / DDP publish of the new masters to     replicate-axis
                 the replicas of the owner's column                      ``Broadcast``
``tp``           tensor parallelism: the owners' NS inputs gathered to   explicit-group
                 the matrix's root and the result scattered back         ``Gather`` / ``Scatter``
===============  ====================================================  =========================

plus the checkpoint moves (:meth:`StepProgram.to_every_rank`, :meth:`StepProgram.to_columns`;
:func:`checkpoint_over_tp` for a one-rank dict under TP) over the master layout.
:meth:`StepProgram.traffic` is **the** byte count of a step: the runtime's executor counts with
the same per-op function (:func:`dmuon.functional.schedule.op_bytes`) and equals it
(``tests/test_step_program_gloo.py``); every other figure (the demo's summary, the CLI, the DDP
comparison, the projector: :mod:`dmuon.tools.step_bytes`) is a view of it.

Both drivers run it through the same phase functions (:mod:`dmuon.functional.phases`: each packs
a group's buffers and returns the schedule of its phase): the runtime's hooks at the moments
FSDP2's overlap needs, the pure step (:mod:`dmuon.functional.step`) on per-rank pytrees.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from dmuon.functional.buckets import (ROOT_GROUP, BucketKey, BucketLayout, HookGroups,
                                      bucket_layout, hook_groups)
from dmuon.functional.collectives import resolve_styles
from dmuon.functional.owner_plan import Coord
from dmuon.functional.schedule import (AllReduce, Broadcast, Schedule, publish_schedule,
                                       reduce_schedule, refresh_schedule, unshard_schedule)
from dmuon.functional.traffic import Traffic

__all__ = ["PHASES", "GroupPhases", "StepProgram", "step_program", "program_from_layouts",
           "step_traffic", "checkpoint_to_every_rank", "checkpoint_to_columns",
           "checkpoint_over_tp", "CHECKPOINT_ABSENT", "ROOT_GROUP", "check_reshard_after_forward"]

#: What a rank holding no value of an element puts in :func:`checkpoint_to_columns`' and
#: :func:`checkpoint_over_tp`'s sums: -0.0, the identity of IEEE addition (``x + -0.0`` is ``x``
#: bitwise for every ``x``, -0.0 included; ``-0.0 + 0.0`` is +0.0: a saved -0.0 would load as +0.0).
CHECKPOINT_ABSENT = -0.0

#: The per-group phases, in the order a step runs them.
PHASES = ("unshard", "reduce", "publish")


@dataclass(frozen=True)
class GroupPhases:
    """One hook group's schedules.

    Attributes:
      key: the hook-group key.  names: its matrices.
      unshard: the forward gather (Z3: also the backward re-gather).
      reduce: the backward gradient reduce (presence elements included).
      publish: the post-step publish to the replicas (empty when R == 1).
      reshard_after_forward: Z3 (freed after forward, re-gathered in backward) or Z2.
      collectives: the style of its shard-axis gathers (Z3 re-gather included) and reduce:
        ``"per_owner"`` (one broadcast / reduce per owner column's bucket), ``"per_bucket"``
        (one padded all-gather / reduce-scatter per dtype) or ``"grouped"`` (the per-owner ops
        of each phase, publish included, as one group call) or ``"sharded"`` (each rank keeps
        ``1/G`` of the group's gathered buffer; the gathers are all-gathers of those parts, and
        :attr:`refresh` makes them current after the masters changed;
        :mod:`dmuon.functional.collectives`).
      collectives_reason: why (asked for, or ``"auto"``'s cost comparison).
      zero_copy: DDP mode (``G = 1``) with every compute dtype the master's: "gathering" points
        each param at its master (no copy, no op; only a pending publish is waited).
      regather: the backward re-gather: ``unshard`` with every op renamed ``regather:<id>``
        (derived; a Z3 group runs it at the start of its backward, and so may any group gathered
        again in a backward, e.g. under activation checkpointing).
      refresh: the sharded style's copy made current from the masters (empty for the other
        styles); ``refreshed_unshard`` (derived): ``refresh`` then ``unshard``, each gather
        waiting on its dtype's refresh: the first gather after the masters changed.
    """

    key: str
    names: tuple[str, ...]
    unshard: Schedule
    reduce: Schedule
    publish: Schedule
    reshard_after_forward: bool
    collectives: str = "per_owner"
    collectives_reason: str = ""
    zero_copy: bool = False
    regather: Schedule = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    refresh: Schedule = field(default=None)  # type: ignore[assignment]
    refreshed_unshard: Schedule = field(default=None, repr=False,  # type: ignore[assignment]
                                        compare=False)

    def __post_init__(self) -> None:
        G, R = self.unshard.shard_size, self.unshard.replicate_size
        if self.regather is None:
            object.__setattr__(self, "regather", Schedule(_renamed(self.unshard, "regather:"), G, R))
        if self.refresh is None:
            object.__setattr__(self, "refresh", Schedule((), G, R))
        waits = {op.dtype: (op.id,) for op in self.refresh}
        object.__setattr__(self, "refreshed_unshard", Schedule(self.refresh.ops + tuple(
            dataclasses.replace(op, waits=op.waits + waits.get(op.dtype, ()))
            for op in self.unshard), G, R))

    def gather_schedule(self, *, regather: bool = False, refresh: bool = False) -> Schedule:
        """The gather to run: :attr:`unshard` (``regather``: :attr:`regather`), after
        :attr:`refresh` when ``refresh`` and the style has one."""
        if not (refresh and len(self.refresh)):
            return self.regather if regather else self.unshard
        if not regather:
            return self.refreshed_unshard
        return Schedule(_renamed(self.refreshed_unshard, "regather:"), self.unshard.shard_size,
                        self.unshard.replicate_size)

    def phase(self, kind: str) -> Schedule:
        if kind not in PHASES:
            raise ValueError(f"unknown phase {kind!r}; phases: {PHASES}")
        return getattr(self, kind)


def _renamed(schedule: Schedule, prefix: str) -> tuple:
    return tuple(dataclasses.replace(op, id=f"{prefix}{op.id}",
                                     waits=tuple(f"{prefix}{w}" for w in op.waits),
                                     coalesce=op.coalesce and f"{prefix}{op.coalesce}")
                 for op in schedule)


@dataclass(frozen=True)
class StepProgram:
    """Every phase of a training step as schedule data (see the module docstring).

    Attributes:
      shard_size, replicate_size: G, R of one data-parallel grid (DDP mode: G = 1, R = world).
      owners: ``{name: (s, r)}``.  hook_groups: groups in forward (static module) order.
      unshard_layout: buckets in the compute dtypes.  reduce_layout: in the reduce dtypes, with
        presence elements.  master_layout: in the master dtypes (publish, checkpoint moves).
      groups: ``{key: GroupPhases}`` in forward order.
      tp: tensor parallelism's NS gathers / scatters over the whole world (global ranks), or
        ``None`` without TP.
      splits: the split-NS units' schedules (lane ``"split"``, one per unit, in unit order:
        :func:`dmuon.functional.split_exec.split_step_schedule`; counted by :meth:`traffic`, run
        by the runtime at each step).
    """

    shard_size: int
    replicate_size: int
    owners: Mapping[str, Coord]
    hook_groups: HookGroups
    unshard_layout: BucketLayout
    reduce_layout: BucketLayout
    master_layout: BucketLayout
    groups: Mapping[str, GroupPhases]
    tp: Optional[Schedule] = None
    splits: tuple[Schedule, ...] = ()
    data_parallel: str = "fsdp"

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size

    @property
    def forward_order(self) -> tuple[str, ...]:
        return tuple(self.groups)

    @property
    def reduce_order(self) -> tuple[str, ...]:
        """The fixed order of the gradient reduces on every rank: the reverse of the static
        group order."""
        return tuple(reversed(tuple(self.groups)))

    def phase(self, kind: str, key: str) -> Schedule:
        """The schedule of phase ``kind`` of hook group ``key``."""
        return self.groups[key].phase(kind)

    def owned(self, coord: Sequence[int]) -> tuple[str, ...]:
        """The matrices ``coord = (s, r)`` owns, in hook-group order."""
        c = tuple(coord)
        return tuple(n for g in self.groups.values() for n in g.names if tuple(self.owners[n]) == c)

    def column(self, s: int) -> tuple[str, ...]:
        """The matrices whose masters shard column ``s`` holds (every rank ``(s, r)``: those whose
        owner is ``(s, r')`` for any ``r'``), in hook-group order."""
        return tuple(n for g in self.groups.values() for n in g.names if self.owners[n][0] == s)

    # ------------------------------------------------------------------ the whole step
    def step_schedule(self) -> Schedule:
        """One step's collectives in issue order on every rank: the forward gathers (forward
        order; the sharded style's refresh its copy first: the masters changed at the last step),
        the Z3 backward re-gathers (reverse order), the reduces (reduce order), the publishes
        (static order). TP's ops are :attr:`tp` (global ranks)."""
        fwd = tuple(op for k in self.forward_order for op in self.groups[k].refreshed_unshard)
        re = tuple(op for k in self.reduce_order if self.groups[k].reshard_after_forward
                   for op in self.groups[k].regather)
        red = tuple(op for k in self.reduce_order for op in self.groups[k].reduce)
        return Schedule(fwd + re + red + self.publish_all().ops, self.shard_size,
                        self.replicate_size)

    def publish_all(self) -> Schedule:
        """Every group's post-step publish, in the static group order (empty when R == 1)."""
        return Schedule(tuple(op for k in self.forward_order for op in self.groups[k].publish),
                        self.shard_size, self.replicate_size)

    def traffic(self, *, publish: bool = True) -> Traffic:
        """Bytes and collectives per lane and rank (``r * G + s``) of one step: the one count
        (``publish=False``: without the post-step publish)."""
        sched = self.step_schedule()
        if not publish:
            sched = Schedule(tuple(op for op in sched if not op.id.startswith("publish/")),
                             self.shard_size, self.replicate_size)
        total = sched.traffic()
        for sp in self.splits:
            total = total + sp.traffic()
        return total

    def rank_counters(self, coord: Sequence[int], global_rank: Optional[int] = None
                      ) -> dict[str, dict[str, int]]:
        """What the executor of rank ``coord`` counts in one step (``global_rank``: its global
        rank, for the TP lane), as ``{lane: {"collectives", "sent_bytes", "received_bytes"}}``."""
        s, r = (int(x) for x in coord)
        out = self.traffic().for_rank(r * self.shard_size + s)
        if self.tp is not None and len(self.tp):
            if global_rank is None:
                raise ValueError("rank_counters: a program with TP needs the global rank")
            out.update({k: v for k, v in self.tp.traffic().for_rank(int(global_rank)).items()
                        if k == "tp"})
        return {lane: c for lane, c in out.items() if lane != "split" or any(c.values())}

    # ------------------------------------------------------------------ checkpoint moves
    def to_every_rank(self, group: str, *, owner_only: bool = False) -> Schedule:
        """:func:`checkpoint_to_every_rank` of this program's master layout."""
        return checkpoint_to_every_rank(self.master_layout, group, owner_only=owner_only)

    def to_columns(self, group: str, *, from_replica: Optional[int] = None) -> Schedule:
        """:func:`checkpoint_to_columns` of this program's master layout."""
        return checkpoint_to_columns(self.master_layout, group, from_replica=from_replica)


def checkpoint_to_every_rank(master: BucketLayout, group: str, *,
                             owner_only: bool = False) -> Schedule:
    """Checkpoint read of ``group``'s master buckets onto every rank: (``owner_only``: values held
    by the global owner alone, e.g. momentum, are first published to its column) then each column
    broadcasts over the shard axis (each broadcast waits for its bucket's publish). Depends on the
    master layout alone (a state dict may be read before the first forward fixed the compute
    dtypes)."""
    head = tuple(_renamed(publish_schedule(master, group), "ckpt:")) if owner_only else ()
    body = tuple(dataclasses.replace(op, waits=tuple(h.id for h in head if h.bucket == op.bucket))
                 for op in _renamed(unshard_schedule(master, group), "ckpt:"))
    return Schedule(head + body, master.shard_size, master.replicate_size)


def checkpoint_over_tp(group: str, numels: Mapping[str, int], members: Sequence[int], *,
                       world_size: int) -> Schedule:
    """Checkpoint move of a load from one rank's dict under tensor parallelism, before
    :func:`checkpoint_to_columns`: the full values of ``group``'s matrices (per dtype one flat
    buffer, ``BucketKey(group, -1, dtype)`` of ``numels[dtype]`` elements) summed over the TP group
    ``members`` of the rank that holds them (its values plus :data:`CHECKPOINT_ABSENT`: a copy to
    its TP peers, each of which then cuts its slice). Run by ``members`` only (lane ``"tp"``;
    global ranks of a world of ``world_size``, as
    :func:`~dmuon.functional.tp_plan.tp_step_schedule`'s)."""
    ops = tuple(AllReduce(id=f"ckpt:tp/{BucketKey(group, -1, dt)}", axis="group", at=None,
                          bucket=BucketKey(group, -1, dt), offset=0, numel=int(n), dtype=dt,
                          lane="tp", members=tuple(int(m) for m in members), op="sum")
                for dt, n in sorted(numels.items()))
    return Schedule(ops, int(world_size), 1)


def checkpoint_to_columns(master: BucketLayout, group: str, *,
                          from_replica: Optional[int] = None) -> Schedule:
    """Checkpoint write of ``group``'s full matrices to their owner column in every replica: a
    shard-axis sum of the rows each rank holds (:data:`CHECKPOINT_ABSENT` elsewhere).

    ``from_replica``: only the ranks of this replica hold values (a load from one rank's dict:
    that rank contributes whole matrices, every other rank :data:`CHECKPOINT_ABSENT`); each
    bucket's sum is then broadcast from that replica to the others within its column (replicate
    axis, waiting on the sum; nothing more when R == 1). Exact, bitwise: every element is one
    value plus -0.0s, then copied."""
    R = master.replicate_size
    if from_replica is not None and not 0 <= int(from_replica) < R:
        raise ValueError(f"from_replica must be a replica index in [0, {R}), got {from_replica!r}")
    ops = _renamed(reduce_schedule(master, group, op="sum", replicate=False), "ckpt:")
    if from_replica is not None and R > 1:
        ops += tuple(Broadcast(id=f"ckpt:copy/{op.bucket}", axis="replicate", at=op.bucket.column,
                               bucket=op.bucket, offset=0, numel=op.numel, dtype=op.dtype,
                               lane="replicate", src=int(from_replica), waits=(op.id,))
                     for op in ops)
    return Schedule(ops, master.shard_size, R)


def check_reshard_after_forward(value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is a bool (dmuon's two modes; FSDP2's int, a reshard
    to a smaller group, has no dmuon counterpart)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"reshard_after_forward must be a bool, got {value!r}: True (Z3: gathered copies "
            "freed after forward, gathered again in backward) or False (Z2: kept until the end of "
            "backward). FSDP2's int (a reshard to a smaller group) has no dmuon counterpart: pass "
            "True to dedicate_params, and the int to fully_shard if you want it for FSDP2's params.")


def step_traffic(layout: BucketLayout, reshard_after_forward: bool = False, *,
                 publish: bool = True, collectives: Union[str, Mapping[str, str]] = "per_owner",
                 cost: Any = None) -> Traffic:
    """Bytes per lane and rank of one step of ``layout``'s matrices (the layout serves as the
    unshard, reduce and master layout): :meth:`StepProgram.traffic`.

    ``reshard_after_forward``: ``False`` (Z2): forward unshard + backward reduce; ``True`` (Z3):
    forward unshard + backward re-unshard + reduce (the root group ``""`` stays Z2, as in the
    runtime). ``publish``: add the post-step HSDP publish (nothing when R == 1). Mean sent (or
    received) per rank over shard-axis lanes: ``2(G-1)/G * P`` (Z2), ``3(G-1)/G * P`` (Z3), per
    owner; ``collectives``, ``cost``: as :func:`step_program` (per bucket: the padded parts).
    """
    check_reshard_after_forward(reshard_after_forward)
    return program_from_layouts(layout, layout, layout,
                                reshard_after_forward=reshard_after_forward,
                                collectives=collectives, cost=cost).traffic(publish=publish)


def step_program(owners: Mapping[str, Coord], shapes: Mapping[str, Sequence[int]],
                 compute_dtypes: Mapping[str, str], *, shard_size: int, replicate_size: int = 1,
                 reduce_dtypes: Optional[Mapping[str, str]] = None,
                 master_dtypes: Optional[Mapping[str, str]] = None,
                 groups: Optional[HookGroups] = None, reshard_after_forward: bool = True,
                 tp: Optional[Schedule] = None, splits: Sequence[Schedule] = (),
                 collectives: Union[str, Mapping[str, str]] = "per_owner",
                 cost: Any = None, data_parallel: str = "fsdp") -> StepProgram:
    """Build the :class:`StepProgram` of one model (pure, deterministic).

    Args:
      owners: ``{name: (s, r)}`` (``OwnerPlan.owners``).  shapes: ``{name: shape}`` of what moves
        (a TP slice's local shape).
      compute_dtypes: ``{name: dtype}`` of the gathered copies (``str(torch dtype)`` or dtype).
      reduce_dtypes: of the gradient reduces (default: the compute dtypes).
      master_dtypes: of the masters (default: fp32, or fp64 for fp64 compute).
      groups: the hook groups (default: by layer key, :func:`~dmuon.functional.buckets.hook_groups`).
      reshard_after_forward: Z3 (True) or Z2 for every group but :data:`ROOT_GROUP` (always Z2:
        gathered for the whole forward).
      tp: tensor parallelism's NS schedule (:func:`dmuon.functional.tp_plan.tp_step_schedule`).
      splits: the split units' executed NS (:attr:`StepProgram.splits`).
      data_parallel: ``"fsdp"`` or ``"ddp"`` (the mode; DDP groups whose compute dtypes are the
        masters' gather nothing: :attr:`GroupPhases.zero_copy`).
      collectives: ``"per_owner"`` (default), ``"per_bucket"``, ``"grouped"`` or ``"auto"`` for
        every group, or
        ``{group: style}`` (:mod:`dmuon.functional.collectives`; recorded per group in
        :attr:`GroupPhases.collectives` with its reason).
      cost: ``"auto"``'s link model (:class:`~dmuon.functional.collectives.LinkCost` or
        ``seconds(op, n)``).
    """
    check_reshard_after_forward(reshard_after_forward)
    G, R = int(shard_size), int(replicate_size)
    hg = groups if groups is not None else hook_groups(list(owners))
    rd = dict(reduce_dtypes) if reduce_dtypes is not None else dict(compute_dtypes)
    if master_dtypes is None:
        master_dtypes = {n: ("torch.float64" if "float64" in str(compute_dtypes.get(n))
                             else "torch.float32") for n in owners}
    return program_from_layouts(
        bucket_layout(owners, shapes, compute_dtypes, hg, G, R),
        bucket_layout(owners, shapes, rd, hg, G, R, presence=True),
        bucket_layout(owners, shapes, master_dtypes, hg, G, R),
        owners=owners, groups=hg, reshard_after_forward=reshard_after_forward, tp=tp,
        splits=splits, collectives=collectives, cost=cost, data_parallel=data_parallel)


def program_from_layouts(unshard: BucketLayout, reduce: BucketLayout, master: BucketLayout, *,
                         owners: Optional[Mapping[str, Coord]] = None,
                         groups: Optional[HookGroups] = None, reshard_after_forward: bool = True,
                         tp: Optional[Schedule] = None,
                         splits: Sequence[Schedule] = (),
                         collectives: Union[str, Mapping[str, str]] = "per_owner",
                         cost: Any = None, data_parallel: str = "fsdp") -> StepProgram:
    """The :class:`StepProgram` of three given layouts (:func:`step_program` builds them; a
    byte count over one layout passes it three times). ``collectives``, ``cost``,
    ``data_parallel``: as :func:`step_program`."""
    G, R = unshard.shard_size, unshard.replicate_size
    if owners is None:
        owners = {e.name: e.owner for b in unshard.buckets for e in b.entries}
    if groups is None:
        groups = HookGroups(order=unshard.groups, members=tuple(
            (k, tuple(sorted(e.name for b in unshard.buckets_of(k) for e in b.entries)))
            for k in unshard.groups))
    z3 = {key: reshard_after_forward and key != ROOT_GROUP for key in unshard.groups}
    mdt = {e.name: b.key.dtype for b in master.buckets for e in b.entries}
    styles = resolve_styles(unshard, reduce, collectives, z3=z3, cost=cost, master=master)
    phases = {
        key: GroupPhases(key=key, names=groups.names(key),
                         unshard=unshard_schedule(unshard, key, style=styles[key].style),
                         reduce=reduce_schedule(reduce, key, style=styles[key].style),
                         publish=publish_schedule(master, key, style=styles[key].style),
                         reshard_after_forward=z3[key], collectives=styles[key].style,
                         collectives_reason=styles[key].reason,
                         refresh=(refresh_schedule(unshard, key) if styles[key].style == "sharded"
                                  else None),
                         zero_copy=data_parallel == "ddp" and G == 1 and all(
                             mdt[e.name] == b.key.dtype for b in unshard.buckets_of(key)
                             for e in b.entries))
        for key in unshard.groups}
    return StepProgram(G, R, dict(owners), groups, unshard, reduce, master, phases, tp,
                       tuple(splits), data_parallel)
