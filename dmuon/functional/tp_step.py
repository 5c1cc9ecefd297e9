"""Tensor parallelism's part of an owner's step (pure): what the owners of one matrix's TP slices
exchange, as schedule ops a runner executes (the runtime's ``executor.run``; every member of the
TP group calls the same functions with the same names, in the same order).

* :func:`tp_orthogonalizer` — Newton–Schulz of the full matrix: the slices' NS inputs gathered to
  the matrix's root (the step program's ``tp`` ``Gather``), NS there with the other inputs, each
  owner's slice of the result scattered back (the ``tp`` ``Scatter``);
* :func:`group_max` — the elementwise MAX of a vector over the TP group (an 8-bit momentum's
  whole-matrix absmax from its slices'), NaN where any member holds a NaN;
* :func:`tp_sum_partials` — the partial sums a variant's stage takes over each slice (row norms),
  added over the TP group where the slice misses part of what they sum.

The last two are ``AllReduce`` ops on lane ``"tp_reduce"`` over the group's members, counted like
every other op (:func:`dmuon.functional.schedule.op_bytes`), apart from the ``"tp"`` lane of the
step program's gathers and scatters.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from dmuon.functional.buckets import BucketKey
from dmuon.functional.schedule import AllReduce, Gather, Schedule

__all__ = ["tp_orthogonalizer", "max_keeping_nan", "group_max", "group_sum", "tp_sum_partials",
           "grad_agreement_vector", "grad_agreement_verdict"]

#: ``run(schedule, buffers)``: executes a schedule on this rank's buffers (collective)
Runner = Callable[[Schedule, dict], None]


def _matrix(op) -> str:
    return op.bucket.group[len("tp:"):]


def _phase(tp: Schedule, ranks: tuple, active: Mapping[str, int]) -> tuple[Schedule, Schedule]:
    """The ``tp`` gathers and scatters of the TP group ``ranks`` for the matrices with an NS input
    this step (the same on every member: the group agrees on its gradients first)."""
    ops = [op for op in tp if ranks == tuple(op.members) and _matrix(op) in active]
    gathers = Schedule(tuple(op for op in ops if isinstance(op, Gather)), tp.shard_size, 1)
    scatters = Schedule(tuple(dataclasses.replace(op, waits=()) for op in ops
                              if not isinstance(op, Gather)), tp.shard_size, 1)
    return gathers, scatters


def tp_orthogonalizer(inner: Callable[[list], Sequence[Tensor]], input_names: Sequence[str], *,
                      tp: Schedule, ranks: Sequence[int], index: int, roots: Mapping[str, int],
                      dims: Mapping[str, int], run: Runner) -> Callable[[list], list]:
    """``inner`` (an orthogonalizer of full matrices) behind the TP group's gathers and scatters.

    Args:
      inner: the owner's NS, ``xs -> us``.
      input_names: the matrix of each input (a TP slice's name, or a matrix without TP).
      tp: the step program's ``tp`` schedule.  ranks: this rank's TP group (global ranks, in TP
        order).  index: this rank's position in it.
      roots: ``{TP-sliced name: root index}`` of the matrices this group owns.
      dims: ``{TP-sliced name: sliced dim}`` (0: rows, 1: columns).
      run: the runner.
    """
    ranks, T = tuple(ranks), len(ranks)

    def span(op) -> slice:
        o, k = op.parts[index]
        return slice(o, o + k)

    def orthogonalize(xs: list) -> list:
        if len(xs) != len(input_names):
            raise RuntimeError(f"dmuon TP step: {len(xs)} NS inputs for {len(input_names)} "
                               "names (internal error)")
        slots = {n: i for i, n in enumerate(input_names) if n in dims}
        gathers, scatters = _phase(tp, ranks, slots)
        bufs: dict = {}
        for op in gathers:  # the root holds every part; the others their own part
            n = _matrix(op)
            x = xs[slots[n]].contiguous()
            if roots[n] == index:
                bufs[op.bucket] = torch.empty(op.numel, dtype=x.dtype, device=x.device)
                bufs[op.bucket][span(op)].copy_(x.view(-1))
            else:
                bufs[op.bucket] = x.view(-1)
        run(gathers, bufs)
        mine = [op for op in gathers if roots[_matrix(op)] == index]
        full = [torch.cat([bufs[op.bucket][o:o + k].view(xs[slots[_matrix(op)]].shape)
                           for o, k in op.parts], dim=1 + dims[_matrix(op)]) for op in mine]
        plain = [i for i, n in enumerate(input_names) if n not in dims]
        outs = list(inner([xs[i] for i in plain] + full)) if plain or full else []
        result: list = [None] * len(xs)
        for k, i in enumerate(plain):
            result[i] = outs[k]
        for op, out in zip(mine, outs[len(plain):]):  # the root's parts of NS(full)
            for j, c in enumerate(out.chunk(T, dim=1 + dims[_matrix(op)])):
                o, k = op.parts[j]
                bufs[op.bucket][o:o + k].copy_(c.reshape(-1))
        for op in scatters:
            n = _matrix(op)
            if roots[n] != index:
                bufs[op.bucket] = torch.empty_like(xs[slots[n]]).view(-1)
        run(scatters, bufs)
        for op in scatters:
            n = _matrix(op)
            shape = xs[slots[n]].shape
            result[slots[n]] = (bufs[op.bucket][span(op)] if roots[n] == index
                                else bufs[op.bucket]).view(shape)
        return result

    return orthogonalize


def group_sum(flat: Tensor, ranks: Sequence[int], world: int, run: Runner, *,
              op: str = "sum", name: str = "sum") -> Tensor:
    """``flat`` (1-D) reduced over the group ``ranks`` with ``op`` in place (one ``AllReduce`` on
    lane ``"tp_reduce"``, run by ``run``); returns it."""
    key = BucketKey(f"tp-{name}", 0, str(flat.dtype))
    ar = AllReduce(id=f"tp-{name}", axis="group", at=None, bucket=key, offset=0,
                   numel=flat.numel(), dtype=str(flat.dtype), lane="tp_reduce",
                   members=tuple(int(r) for r in ranks), op=op)
    run(Schedule((ar,), int(world), 1), {key: flat})
    return flat


def max_keeping_nan(values: Tensor, all_reduce_max: Callable[[Tensor], None]) -> Tensor:
    """The elementwise MAX of ``values`` (floating) over ranks through ``all_reduce_max`` (an
    in-place MAX all-reduce of a 1-D tensor), NaN wherever any rank holds a NaN: a MAX
    all-reduce alone may drop it (gloo keeps the other operand), so NaNs travel as flags."""
    v = values.reshape(-1)
    both = torch.cat([torch.nan_to_num(v, nan=0.0, posinf=math.inf, neginf=-math.inf),
                      torch.isnan(v).to(v.dtype)])
    all_reduce_max(both)
    k = v.numel()
    out = torch.where(both[k:] > 0, torch.full_like(both[:k], math.nan), both[:k])
    return out.reshape(values.shape)


def group_max(values: Tensor, ranks: Sequence[int], world: int, run: Runner) -> Tensor:
    """:func:`max_keeping_nan` over the group ``ranks``: one ``AllReduce`` (``"max"``) op on lane
    ``"tp_reduce"``, run by ``run``."""
    return max_keeping_nan(values, lambda t: group_sum(t, ranks, world, run, op="max",
                                                       name="max"))


def tp_sum_partials(names: Sequence[str], partials: list, block_dims: Sequence[int],
                    dims: Mapping[str, int], ranks: Sequence[int], world: int,
                    run: Runner) -> list:
    """A variant stage's ``sum_hook`` (:meth:`dmuon.functional.stages.leaves.Leaves.
    sum_partials`): each TP slice's partial sums over block dims ``block_dims`` added over the TP
    group where the slice misses part of what they sum (a row slice, ``dims[n] == 0``, misses
    rows: block dim -2; a column slice misses columns: -1); one SUM per dtype, in the leaves'
    order. Matrices without TP (not in ``dims``) are whole: their sums pass through."""
    out = list(partials)
    summed = {d if d < 0 else d - 3 for d in block_dims}
    picks = [k for k, n in enumerate(names)
             if n in dims and (-2 if dims[n] == 0 else -1) in summed]
    by: dict = {}
    for k in picks:
        by.setdefault(out[k].dtype, []).append(k)
    for ks in by.values():
        flat = group_sum(torch.cat([out[k].reshape(-1) for k in ks]), ranks, world, run)
        at = 0
        for k in ks:
            n = out[k].numel()
            out[k] = flat[at:at + n].view(out[k].shape)
            at += n
    return out


def grad_agreement_vector(grads: Mapping[str, "Tensor | None"], sliced: Sequence[str],
                          replicated: Sequence[str]) -> list[float]:
    """What a TP group's members agree on before a step, as one vector for a MAX all-reduce: per
    TP-sliced matrix whether this member has its gradient; per matrix TP does not shard (whose
    gradients must be the same on every member) the fp64 sum of its gradient's absolute values
    (-1: none) and its negation (the MAX of both gives the max and the min), and a NaN flag and
    its negation (a MAX all-reduce may drop a NaN: it travels as a flag)."""
    sums = [(-1.0 if grads.get(n) is None else
             float(grads[n].detach().abs().sum(dtype=torch.float64))) for n in replicated]
    nans = [float(math.isnan(x)) for x in sums]
    sums = [0.0 if math.isnan(x) else x for x in sums]
    return ([float(grads.get(n) is not None) for n in sliced] + sums + [-x for x in sums]
            + nans + [-x for x in nans])


def grad_agreement_verdict(got: Sequence[float], sliced: Sequence[str],
                           replicated: Sequence[str]) -> tuple[list[str], list[str]]:
    """From :func:`grad_agreement_vector`'s MAX over the group: ``(the TP-sliced matrices some
    member has a gradient of (a member without one steps zeros), the unsharded matrices whose
    gradients differ across the members (beyond a relative 1e-6, or NaN on some only))``."""
    k, r = len(sliced), len(replicated)
    present = [n for n, h in zip(sliced, got[:k]) if h]
    hi, lo = got[k:k + r], [-x for x in got[k + r:k + 2 * r]]
    nan_hi, nan_lo = got[k + 2 * r:k + 3 * r], [-x for x in got[k + 3 * r:]]
    bad = [n for n, a, b, na, nb in zip(replicated, hi, lo, nan_hi, nan_lo)
           if na != nb or a - b > 1e-6 * max(abs(a), abs(b), 1e-30)]
    return present, bad
