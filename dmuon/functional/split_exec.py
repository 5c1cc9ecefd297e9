"""Split Newton–Schulz as the optimizer executes it: the owner's matrix, its blocks' trip to the
split group and back, and the math of every member (pure; the runtime's executor runs the
collectives).

A split unit (:class:`~dmuon.functional.split_plan.SplitUnit`) keeps the matrix's master, momentum
and update on one rank, its **owner** (block 0's rank, :func:`~dmuon.functional.split_plan.
runtime_owners`): forward broadcasts, gradient reduces, checkpoints and the element-wise Muon stages
are those of any dedicated matrix. Only its Newton–Schulz is spread over the unit's ``k`` members:

1. ``Scatter`` (from the owner) of the NS input's column blocks of the wide orientation (``X`` or,
   for a tall param, ``X^T``), packed block after block: member ``i`` gets ``X_i`` (``m x n_i``);
2. the collectives of :func:`~dmuon.functional.split_ns.split_ns_schedule` (norm and Gram
   all-reduces, row-block all-gathers), each member computing its share with
   :func:`~dmuon.functional.split_ns.split_ns_rank`;
3. ``Gather`` (to the owner) of the result blocks, which the owner assembles (and transposes back).

All on lane ``"split"``, explicit groups ``unit.members``, each op waiting for the previous one:
:func:`split_step_schedule`. The extra traffic against the planned block ownership is the scatter
and the gather, ``(k - 1)/k`` of the matrix each, out of and into the owner; the plan charges it
(:func:`~dmuon.functional.split_plan.split_unit_cost`).

Numerics: the split pieces compute in the NS compute dtype when it is fp32 or fp64 (exact against
single-device NS, fp64 <= 1e-12); a half-precision compute dtype (the CUDA engine's fp16 default)
is raised to fp32 for split units, so the fp16 range lift does not apply to them
(:func:`split_ns_settings`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Generator, Iterable, Mapping, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from dmuon.functional.buckets import BucketKey, dtype_str
from dmuon.functional.schedule import Gather, Op, Schedule, Scatter
from dmuon.functional.split_ns import SplitLayout, split_ns_rank, split_ns_schedule
from dmuon.newton_schulz.coefficients import ns_coefficient_table
from dmuon.newton_schulz.cost import choose_ns_variant
from dmuon.newton_schulz.iteration import default_ns_dtype, resolve_gram_restart

__all__ = ["SplitSettings", "split_ns_settings", "split_step_schedule", "split_unit_rank",
           "simulate_split_step", "SplitStepRank", "SplitMember", "split_member", "run_split_units",
           "split_orthogonalizer"]


@dataclass(frozen=True)
class SplitSettings:
    """What one split unit computes (resolved as single-device NS resolves it for the shape).

    Attributes:
      table: ``(a, b, c)`` per step; variant: ``"direct"`` / ``"gram"``; gram_restart: its period
      (``None``: never); eps: of the normalization; dtype: compute dtype; acc_dtype: of the
      all-reduced norm and Gram sums.
    """

    table: tuple[tuple[float, float, float], ...]
    variant: str
    gram_restart: Optional[int]
    eps: float
    dtype: torch.dtype
    acc_dtype: torch.dtype


def split_ns_settings(config: object, m: int, n: int, input_dtype: torch.dtype,
                      device_type: str) -> SplitSettings:
    """The settings single-device NS with ``config`` (an
    :class:`~dmuon.newton_schulz.config.NSConfig`) uses on an ``m x n`` matrix of ``input_dtype``
    on ``device_type``: the same table, eps, Gram restart and ``"auto"`` variant choice; a half
    compute dtype becomes fp32 (module docstring)."""
    cdt = config.ns_dtype or default_ns_dtype(torch.device(device_type))
    if cdt in (torch.float16, torch.bfloat16):
        cdt = torch.float32
    restart = resolve_gram_restart(config.ns_gram_restart, cdt) or None
    steps = int(config.ns_steps)
    table = tuple(tuple(float(v) for v in row) for row in ns_coefficient_table(
        config.ns_coefficients, steps, safety=float(config.ns_safety)))
    variant = choose_ns_variant(min(m, n), max(m, n), steps, gram_restart=restart)
    acc = torch.promote_types(torch.promote_types(input_dtype, cdt), torch.float32)
    return SplitSettings(table, variant, restart, float(config.ns_eps), cdt, acc)


def _parts(layout: SplitLayout) -> tuple[tuple[int, int], ...]:
    out, at = [], 0
    for c0, c1 in layout.col_ranges:
        out.append((at, layout.m * (c1 - c0)))
        at += layout.m * (c1 - c0)
    return tuple(out)


def split_step_schedule(unit: object, shard_size: int, replicate_size: int,
                        settings: SplitSettings, input_dtype: "torch.dtype | str") -> Schedule:
    """The executed split NS of ``unit`` (a :class:`~dmuon.functional.split_plan.SplitUnit`) as
    one schedule on lane ``"split"``: the owner's ``Scatter`` of the input blocks, the split
    program, the ``Gather`` of the result blocks (module docstring)."""
    lay, members, name = unit.layout, tuple(unit.members), unit.param
    xd = dtype_str(input_dtype)
    parts = _parts(lay)
    core = split_ns_schedule(name, lay, members, shard_size, replicate_size,
                             steps=len(settings.table), variant=settings.variant,
                             gram_restart=settings.gram_restart, dtype=settings.dtype,
                             acc_dtype=settings.acc_dtype).ops
    common = dict(axis="group", at=None, offset=0, numel=lay.m * lay.n, dtype=xd, lane="split",
                  members=members, parts=parts)
    scatter = Scatter(id=f"split/{name}/x", bucket=BucketKey(f"nssplit:{name}:x", 0, xd), src=0,
                      **common)
    first = dataclasses.replace(core[0], waits=(scatter.id,))
    gather = Gather(id=f"split/{name}/y", bucket=BucketKey(f"nssplit:{name}:y", 0, xd), dst=0,
                    waits=(core[-1].id,), **common)
    return Schedule((scatter, first) + tuple(core[1:]) + (gather,), shard_size, replicate_size)


SplitStepRank = Generator[tuple[Op, Tensor], None, Optional[Tensor]]
"""A member's executed split NS: yields ``(op, buffer)`` for each op of
:func:`split_step_schedule` (the caller runs the op on the 1-D buffer in place, then resumes with
``send(None)``); returns the NS result on the owner, ``None`` on the other members."""


def split_unit_rank(unit: object, schedule: Schedule, index: int, x: Optional[Tensor],
                    settings: SplitSettings, *, input_dtype: torch.dtype,
                    device: "torch.device | str" = "cpu") -> SplitStepRank:
    """Member ``index``'s part of the executed split NS of ``unit`` (module docstring).

    Args:
      unit: the split unit; schedule: its :func:`split_step_schedule`.
      index: this rank's block (``0``: the owner).
      x: the owner's NS input (the param's 2-D shape; ``None`` on the other members). The owner
        passes zeros when the matrix has no gradient this step (the members cannot know; the
        result is then discarded).
      settings: :func:`split_ns_settings`; input_dtype: the dtype of ``x`` (every member knows it
        from the plan); device: of the members' buffers.
    """
    lay, dim = unit.layout, unit.dim
    ops = schedule.ops
    scatter, core, gather = ops[0], ops[1:-1], ops[-1]
    o, cnt = scatter.parts[index]
    if index == 0:
        if x is None or x.dim() != 2:
            raise ValueError(f"split NS of {unit.param!r}: the owner needs its 2-D NS input")
        wide = x.mT if dim == 0 else x
        if tuple(wide.shape) != (lay.m, lay.n):
            raise ValueError(f"split NS of {unit.param!r}: input {tuple(x.shape)} does not match "
                             f"the plan's {lay.m} x {lay.n} (wide orientation)")
        buf = torch.cat([wide[:, c0:c1].reshape(-1) for c0, c1 in lay.col_ranges]).to(input_dtype)
        yield scatter, buf
        mine = buf[o:o + cnt]
    else:
        mine = torch.empty(cnt, dtype=input_dtype, device=device)
        yield scatter, mine
    block = mine.view(lay.m, cnt // lay.m)
    gen = split_ns_rank(block, lay, index, settings.table, variant=settings.variant,
                        gram_restart=settings.gram_restart, eps=settings.eps, dtype=settings.dtype)
    out = next(gen)
    for op in core:
        yield op, out
        try:
            out = gen.send(None)
        except StopIteration as stop:
            out = stop.value
    result = out.reshape(-1)
    if index != 0:
        yield gather, result.contiguous()
        return None
    full = torch.empty(lay.m * lay.n, dtype=input_dtype, device=result.device)
    full[o:o + cnt].copy_(result)
    yield gather, full
    blocks = [full[a:a + k].view(lay.m, k // lay.m) for a, k in gather.parts]
    wide_out = torch.cat(blocks, dim=1)
    return (wide_out.mT if dim == 0 else wide_out).contiguous()


def simulate_split_step(unit: object, x: Tensor, settings: SplitSettings, *,
                        shard_size: Optional[int] = None, replicate_size: int = 1) -> Tensor:
    """Run every member of ``unit``'s executed split NS in this process, each op executed by the
    simulator (:func:`~dmuon.functional.simulate.simulate`); returns the owner's result."""
    from dmuon.functional.simulate import simulate

    world = max(unit.members) + 1
    G = shard_size or world
    R = max(replicate_size, -(-world // G))
    sched = split_step_schedule(unit, G, R, settings, x.dtype)
    gens = [split_unit_rank(unit, sched, i, x if i == 0 else None, settings, input_dtype=x.dtype)
            for i in range(unit.k)]
    cur = [next(g) for g in gens]
    result: Optional[Tensor] = None
    for op in sched.ops:
        ranks: list[dict] = [{} for _ in range(G * R)]
        widened = {}                     # a Gather / Scatter member's own part, in a whole buffer
        for j, g in enumerate(op.members):
            got, buf = cur[j]
            if got.id != op.id:
                raise ValueError(f"member {j} is at op {got.id}, the schedule at {op.id}")
            if isinstance(op, (Gather, Scatter)) and j != op.root:
                o, k = op.parts[j]
                whole = torch.zeros(op.offset + op.numel, dtype=buf.dtype)
                whole[o:o + k].copy_(buf)
                widened[j], buf = (buf, whole), whole
            ranks[g] = {op.bucket: buf}
        simulate(Schedule((dataclasses.replace(op, waits=()),), G, R), ranks, donate=True)
        for j, (part, whole) in widened.items():
            o, k = op.parts[j]
            part.copy_(whole[o:o + k])
        for j, g in enumerate(gens):
            try:
                cur[j] = g.send(None)
            except StopIteration as stop:
                cur[j] = (op, None)
                if j == 0:
                    result = stop.value
    if result is None:
        raise ValueError("the owner's split NS returned no result")
    return result


class SplitMember(NamedTuple):
    """One split unit as this rank runs it: ``unit`` (its blocks' slots as global ranks),
    ``index`` (this rank's block; 0: the owner), ``schedule`` (:func:`split_step_schedule`),
    ``settings``, the NS input dtype ``dtype`` and ``singles`` (each op of the schedule as a
    schedule of its own, built once: :func:`split_member`)."""

    unit: object
    index: int
    schedule: Schedule
    settings: SplitSettings
    dtype: torch.dtype
    singles: Mapping[str, Schedule]


def split_member(unit: object, index: int, schedule: Schedule, settings: SplitSettings,
                 dtype: torch.dtype) -> SplitMember:
    """The :class:`SplitMember` of ``unit`` for this rank's block ``index``."""
    singles = {op.id: Schedule((dataclasses.replace(op, waits=()),), schedule.shard_size,
                               schedule.replicate_size) for op in schedule}
    return SplitMember(unit, index, schedule, settings, dtype, singles)


def run_split_units(members: Sequence[SplitMember], inputs: Mapping[str, Tensor], run: Callable,
                    device: "torch.device | str") -> dict[str, Tensor]:
    """Run every split unit this rank is a member of, in unit order, each op through ``run``
    (``run(schedule, buffers)``, collective: every member runs its units in the plan's order).
    ``inputs``: the owner's 2-D NS inputs by param name (an owner whose matrix has no input this
    step sends zeros, the members cannot know; its result is dropped). Returns the owner's
    results for the names in ``inputs``."""
    out: dict[str, Tensor] = {}
    for m in members:
        x = None
        if m.index == 0:
            x = inputs.get(m.unit.param)
            if x is None:
                x = torch.zeros(m.unit.shape, dtype=m.dtype, device=device)
        gen = split_unit_rank(m.unit, m.schedule, m.index, x, m.settings, input_dtype=m.dtype,
                              device=device)
        try:
            op, buf = next(gen)
            while True:
                run(m.singles[op.id], {op.bucket: buf})
                op, buf = gen.send(None)
        except StopIteration as stop:
            if m.index == 0 and m.unit.param in inputs:
                out[m.unit.param] = stop.value
    return out


def split_orthogonalizer(inner: Callable[[list], Sequence[Tensor]], input_names: Sequence[str],
                         owned: Iterable[str], run_units: Callable[[dict], dict]
                         ) -> Callable[[list], list]:
    """``inner`` with the NS inputs of this rank's split matrices (``owned``; named by
    ``input_names``, one per input) taken out and run through ``run_units`` (``{name: 2-D input}
    -> {name: result}``, e.g. :func:`run_split_units` bound to this rank's units) first."""
    owned = set(owned)

    def orthogonalize(xs: list) -> list:
        if len(xs) != len(input_names):
            raise RuntimeError(f"dmuon split NS: {len(xs)} NS inputs for {len(input_names)} "
                               "names (internal error)")
        split = {n: i for i, n in enumerate(input_names) if n in owned}
        for n, i in split.items():
            if xs[i].dim() != 3 or xs[i].shape[0] != 1:
                raise RuntimeError(f"dmuon split NS: {n!r} has NS input {tuple(xs[i].shape)}, "
                                   "not one matrix (internal error)")
        got = run_units({n: xs[i][0] for n, i in split.items()})
        plain = [i for i in range(len(xs)) if input_names[i] not in split]
        outs = list(inner([xs[i] for i in plain])) if plain else []
        result: list = [None] * len(xs)
        for k, i in enumerate(plain):
            result[i] = outs[k]
        for n, i in split.items():
            result[i] = got[n].unsqueeze(0)
        return result

    return orthogonalize
