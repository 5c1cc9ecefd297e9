"""Newton–Schulz of one matrix spread exactly over ``k`` ranks: the math, its flops and its collectives.

On the wide orientation ``X`` (``m x n``, ``m <= n``; a tall param is transposed) every rank ``i``
holds a **column block** ``X_i`` (``m x n_i``, ``X = [X_1 ... X_k]``) and owns a **row range**
``r_i`` (``m_i`` rows) of every ``m x m`` matrix. Two identities make the split exact:

* the Gram matrix is a sum over column blocks, ``X X^T = sum_i X_i X_i^T`` (one all-reduce), and a
  left product acts block by block, ``P X = [P X_1 ... P X_k]`` (no communication);
* a product of ``m x m`` matrices is computed by row blocks, ``(U V)[r_i, :] = U[r_i, :] V``; every
  such product in NS has a symmetric left factor that rank ``i`` holds rows of, and a right factor
  that it gets whole by an all-gather of the row blocks.

So each rank does ``1/k`` of every product (flops below sum exactly to the single-device count of
:mod:`dmuon.newton_schulz.cost`), the small ``m x m`` iteration is not repeated on every rank, and
the only traffic is ``m x m``-sized. This is the row/column block decomposition of a matrix product
(e.g. G. Golub, C. Van Loan, "Matrix Computations", 4th ed., 2013, sections 1.3 and 1.6 on
block and distributed matrix multiplication) applied to the products of the NS recurrences of
:mod:`dmuon.newton_schulz.iteration`, which are replayed here product by product.

Program (the same sequence of collectives on every rank, :func:`split_ns_program`), after
``||X||_F^2 = sum_i ||X_i||_F^2`` (all-reduce of one scalar, then ``X_0,i = X_i / (||X||_F + eps)``).
Gram sums are symmetric, so only their upper triangle travels (``m (m + 1) / 2`` elements).

* **direct**, per step: ``A = sum_i X_i X_i^T`` (all-reduce); ``Z[r_i] = b A[r_i] + c A[r_i] A``;
  all-gather ``Z``; ``X_i <- a X_i + Z X_i``.
* **Gram**, per restart segment: ``A = sum_i X_0,i X_0,i^T`` (all-reduce); per iteration
  ``Z[r_i] = b A[r_i] + c A[r_i] A`` and, with ``P = a I + Z``: all-gather ``Z``;
  ``Q[r_i] = P[r_i]`` (first of the segment) or ``Q[r_i] P``; if the segment goes on,
  ``R[r_i] = A[r_i] P`` and ``A[r_i] <- R[r_i] P``, all-gather ``A``; else all-gather ``Q`` (a
  one-iteration segment gathers ``Q = P`` instead of ``Z``). A restart and the end apply
  ``X_0,i <- Q X_0,i`` locally.

Two gathers per iteration, instead of the four a row-by-row replay of the single-device products
would need (``Z Q``, ``A Z``, ``Z R`` each want another whole factor): ``P``, ``Q`` and ``A`` are
polynomials of one symmetric matrix, so they commute: ``P Q = Q P`` and ``P A P = (A P) P``, whose
right factor ``P`` every rank has after the ``Z`` gather. The flops are the single-device ones.

Per-rank flops with ``T`` steps and ``S`` Gram segments::

    direct_i = T (4 m^2 n_i + 2 m_i m^2)         gram_i = 4 S m^2 n_i + 2 m_i m^2 (4 T - 3 S)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Generator, Literal, Optional, Sequence

import torch
from torch import Tensor

from dmuon.functional.buckets import BucketKey, dtype_str
from dmuon.newton_schulz.iteration import left_product, sym_product
from dmuon.newton_schulz.cost import gram_segments
from dmuon.functional.schedule import AllGather, AllReduce, Op, Schedule

__all__ = ["SplitLayout", "SplitCollective", "split_layout", "split_piece_flops", "split_ns_program",
           "split_piece_segments", "split_ns_schedule", "split_ns_rank", "simulate_split_ns",
           "ring_bytes_per_rank"]


def _ranges(total: int, k: int) -> tuple[tuple[int, int], ...]:
    base, extra = divmod(total, k)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return tuple(out)


@dataclass(frozen=True)
class SplitLayout:
    """How the NS of one wide ``m x n`` matrix is spread over ``k`` ranks.

    Attributes:
      m, n: short and long side (``m <= n``).
      k: number of ranks.
      col_ranges: ``k`` half-open column ranges of ``X`` (block ``i``: ``n_i`` columns), balanced.
      row_ranges: ``k`` half-open row ranges of the ``m x m`` matrices, balanced.
    """

    m: int
    n: int
    k: int
    col_ranges: tuple[tuple[int, int], ...]
    row_ranges: tuple[tuple[int, int], ...]


def split_layout(m: int, n: int, k: int) -> SplitLayout:
    """Balanced column and row ranges (the first ``n % k`` blocks one column wider, same for rows).

    Args:
      m, n: the matrix sides (either orientation; the layout is for ``min x max``).
      k: ranks, ``1 <= k <= min(m, n)`` (every rank gets a row and a column).

    Raises:
      ValueError: on a bad ``k``.
    """
    s, l = min(m, n), max(m, n)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= s:
        raise ValueError(f"split factor k must be an int in [1, min(m, n) = {s}], got {k!r}")
    return SplitLayout(s, l, k, _ranges(l, k), _ranges(s, k))


@dataclass(frozen=True)
class SplitCollective:
    """One collective of the split program.

    Attributes:
      kind: ``"all_reduce"`` (a sum) or ``"all_gather"`` (of row blocks, ``row_ranges``).
      buffer: the logical buffer: ``"norm"``, ``"gram"`` (a packed upper triangle), ``"z"``,
        ``"a"``, ``"q"``.
      numel: elements of the buffer; width: row length of a gathered ``m x width`` buffer (0 for
        all-reduces).
      acc: held in the accumulation dtype (else the compute dtype).
    """

    kind: str
    buffer: str
    numel: int
    width: int
    acc: bool


def _check_variant(variant: str) -> None:
    if variant not in ("direct", "gram"):
        raise ValueError(f"variant must be 'direct' or 'gram', got {variant!r}")


def _segment_ends(steps: int, gram_restart: Optional[int]) -> list[bool]:
    """``ends[i]``: iteration ``i`` is the last of its Gram segment."""
    return [i == steps - 1 or bool(gram_restart and (i + 1) % gram_restart == 0)
            for i in range(steps)]


def split_ns_program(m: int, steps: int, variant: str,
                     gram_restart: Optional[int] = None) -> tuple[SplitCollective, ...]:
    """The collectives of one split NS, in program order (identical on every rank).

    Args:
      m: the short side (``m x m`` matrices).
      steps: NS iterations; variant: ``"direct"`` or ``"gram"``; gram_restart: restart period
        (``None``/0: never), as :func:`~dmuon.newton_schulz.cost.gram_segments` counts it.
    """
    _check_variant(variant)
    gram = SplitCollective("all_reduce", "gram", m * (m + 1) // 2, 0, True)

    def gather(buffer: str) -> SplitCollective:
        return SplitCollective("all_gather", buffer, m * m, m, False)

    out = [SplitCollective("all_reduce", "norm", 1, 0, True)]
    if variant == "direct":
        for _ in range(steps):
            out += [gram, gather("z")]
        return tuple(out)
    ends = _segment_ends(steps, gram_restart or None)
    for i in range(steps):
        first = i == 0 or ends[i - 1]
        if first:
            out.append(gram)
        if first and ends[i]:
            out.append(gather("q"))
        else:
            out += [gather("z"), gather("q" if ends[i] else "a")]
    return tuple(out)


def split_piece_flops(layout: SplitLayout, steps: int, variant: str,
                      gram_restart: Optional[int] = None) -> tuple[int, ...]:
    """Flops of each rank's share (module docstring); they sum to the single-device count."""
    _check_variant(variant)
    m = layout.m
    seg = gram_segments(steps, gram_restart or None)
    out = []
    for (c0, c1), (r0, r1) in zip(layout.col_ranges, layout.row_ranges):
        ni, mi = c1 - c0, r1 - r0
        if variant == "direct":
            out.append(steps * (4 * m * m * ni + 2 * mi * m * m))
        else:
            out.append(4 * seg * m * m * ni + 2 * mi * m * m * (4 * steps - 3 * seg))
    return tuple(out)


def split_piece_segments(layout: SplitLayout, index: int, steps: int, variant: str,
                         gram_restart: Optional[int] = None) -> tuple[int, ...]:
    """Flops rank ``index`` computes before each collective of :func:`split_ns_program` and after
    the last one (``len(program) + 1`` entries; they sum to ``split_piece_flops(...)[index]``)."""
    _check_variant(variant)
    m = layout.m
    c0, c1 = layout.col_ranges[index]
    r0, r1 = layout.row_ranges[index]
    big, small = 2 * m * m * (c1 - c0), 2 * (r1 - r0) * m * m      # one m^2 n_i / m_i m^2 product
    seg: list[int] = []
    pend = 0

    def collective() -> None:
        nonlocal pend
        seg.append(pend)
        pend = 0

    collective()                                                     # norm
    if variant == "direct":
        for _ in range(steps):
            pend += big                                              # A_i = X_i X_i^T
            collective()                                             # gram
            pend += small                                            # Z rows
            collective()                                             # z
            pend += big                                              # X_i = a X_i + Z X_i
        return tuple(seg + [pend])
    ends = _segment_ends(steps, gram_restart or None)
    for i in range(steps):
        first = i == 0 or ends[i - 1]
        if first:
            pend += big * (2 if i > 0 else 1)                        # (restart product,) A partial
            collective()                                             # gram
        pend += small                                                # Z rows
        if first and ends[i]:
            collective()                                             # q (= P)
            continue
        collective()                                                 # z
        pend += 0 if first else small                                # Q rows = Q[r] P
        if ends[i]:
            collective()                                             # q
        else:
            pend += 2 * small                                        # R rows, A rows
            collective()                                             # a
    return tuple(seg + [pend + big])                                 # X_0,i <- Q X_0,i


def ring_bytes_per_rank(program: Sequence[SplitCollective], k: int, itemsize: int,
                        acc_itemsize: int = 4) -> float:
    """Bytes each rank sends in ring collectives of ``program`` over ``k`` ranks (a timing
    estimate: all-reduce ``2(k-1)/k P``, all-gather ``(k-1)/k P``); the schedule's own byte
    accounting (:func:`~dmuon.functional.schedule.schedule_traffic`) uses the star model instead."""
    total = 0.0
    for c in program:
        p = c.numel * (acc_itemsize if c.acc else itemsize)
        total += (2 if c.kind == "all_reduce" else 1) * (k - 1) / k * p
    return total


def split_ns_schedule(name: str, layout: SplitLayout, members: Sequence[int], shard_size: int,
                      replicate_size: int, *, steps: int = 5, variant: str = "gram",
                      gram_restart: Optional[int] = None, dtype: "torch.dtype | str" = torch.float32,
                      acc_dtype: "torch.dtype | str" = torch.float32) -> Schedule:
    """The split NS of param ``name`` as a :class:`~dmuon.functional.schedule.Schedule` on lane
    ``"split"``: one :class:`~dmuon.functional.schedule.AllReduce` / ``AllGather`` per entry of
    :func:`split_ns_program`, each waiting for the previous one, on the explicit group ``members``
    (global ranks ``r * G + s`` of blocks ``0 .. k-1``).

    Buckets are the program's logical buffers, ``BucketKey(f"nssplit:{name}:{buffer}", 0, dtype)``
    (``acc_dtype`` for ``norm`` and ``gram``); an all-gather's part ``j`` is block ``j``'s rows.
    """
    if len(members) != layout.k:
        raise ValueError(f"split of {name!r}: {len(members)} members for k = {layout.k} blocks")
    cd, ad = dtype_str(dtype), dtype_str(acc_dtype)
    ops: list[Op] = []
    for j, c in enumerate(split_ns_program(layout.m, steps, variant, gram_restart)):
        dt = ad if c.acc else cd
        key = BucketKey(f"nssplit:{name}:{c.buffer}", 0, dt)
        common = dict(id=f"split/{name}/{j}:{c.buffer}", axis="group", at=None, bucket=key,
                      offset=0, numel=c.numel, dtype=dt, lane="split", members=tuple(members),
                      waits=(ops[-1].id,) if ops else ())
        if c.kind == "all_reduce":
            ops.append(AllReduce(op="sum", **common))
        else:
            parts = tuple((r0 * c.width, (r1 - r0) * c.width) for r0, r1 in layout.row_ranges)
            ops.append(AllGather(parts=parts, **common))
    return Schedule(tuple(ops), shard_size, replicate_size)


SplitRank = Generator[Tensor, None, Tensor]
"""A rank's split NS: yields each collective's 1-D buffer (the caller runs the collective on it in
place, then resumes with ``send(None)``), returns the rank's block of the result."""


def split_ns_rank(x: Tensor, layout: SplitLayout, index: int, table: Sequence[tuple[float, float, float]],
                  *, variant: Literal["direct", "gram"], gram_restart: Optional[int] = None,
                  eps: float = 1e-7, dtype: Optional[torch.dtype] = None) -> SplitRank:
    """Rank ``index``'s part of the split NS of a wide matrix (module docstring).

    Args:
      x: this rank's column block ``X_i`` (``m x n_i``, ``layout.col_ranges[index]``), not mutated.
      layout: from :func:`split_layout`; index: the block number ``0 .. k-1``.
      table: ``(a, b, c)`` per step (:func:`~dmuon.newton_schulz.coefficients.ns_coefficient_table`).
      variant, gram_restart: as for :func:`~dmuon.newton_schulz.iteration.newton_schulz` (a
        resolved period: an int, or ``None``/0 for never).
      eps: added to the Frobenius norm; dtype: compute dtype (default ``x.dtype``).

    Yields:
      the 1-D buffer of each collective of :func:`split_ns_program`, in order: all-reduce
      buffers (a scalar, or a packed upper triangle of ``m (m + 1) / 2`` elements in row-major
      order) are to be summed over the ranks, all-gather buffers (``m x m``) hold this rank's rows
      (``layout.row_ranges[index]``) and are to be filled with every rank's.

    Returns:
      this rank's block of the result, ``m x n_i``, in ``x``'s dtype.
    """
    _check_variant(variant)
    m, k = layout.m, layout.k
    if not 0 <= index < k:
        raise ValueError(f"block index {index} outside 0..{k - 1}")
    c0, c1 = layout.col_ranges[index]
    r0, r1 = layout.row_ranges[index]
    if tuple(x.shape) != (m, c1 - c0):
        raise ValueError(f"block {index} must be {m} x {c1 - c0} (wide orientation), got "
                         f"{tuple(x.shape)}")
    cdt = x.dtype if dtype is None else dtype
    acc = torch.promote_types(torch.promote_types(x.dtype, cdt), torch.float32)
    restart = gram_restart or None

    iu = torch.triu_indices(m, m, device=x.device)

    def all_reduce_sym(t: Tensor):                      # t: (1, m, m), symmetric
        buf = t[0].to(acc)[iu[0], iu[1]]                # packed upper triangle (a new tensor)
        yield buf
        full = torch.zeros(m, m, dtype=acc, device=x.device)
        full[iu[0], iu[1]] = buf
        full = full + full.triu(1).mT                   # mirror the strict upper triangle
        return full.to(cdt).unsqueeze(0)

    def all_gather(rows: Tensor, width: int):
        buf = torch.zeros(m, width, dtype=cdt, device=x.device)
        buf[r0:r1] = rows
        yield buf.view(-1)
        return buf.unsqueeze(0)

    norm2 = torch.linalg.vector_norm(x, dtype=acc).square().reshape(1)
    yield norm2
    x0 = torch.div(x, norm2.sqrt().add_(eps)).to(cdt).unsqueeze(0)     # (1, m, n_i)
    eye_rows = torch.zeros(1, r1 - r0, m, dtype=cdt, device=x.device)
    eye_rows[0, :, r0:r1].diagonal().fill_(1)
    if variant == "direct":
        for a, b, c in table:
            am = yield from all_reduce_sym(sym_product(x0))              # A = sum X_i X_i^T
            zr = sym_product(am[:, r0:r1], am, alpha=c, beta=b, c=am[:, r0:r1])
            z = yield from all_gather(zr[0], m)
            x0 = left_product(z, x0, beta=a, c=x0)                       # X_i = a X_i + Z X_i
        return x0[0].to(x.dtype)

    ends = _segment_ends(len(table), restart)
    q = qr = am = None
    for i, (a, b, c) in enumerate(table):
        first = i == 0 or ends[i - 1]
        if first:
            if i > 0:
                x0 = left_product(q, x0)                                 # restart: X_0 <- Q X_0
            am = yield from all_reduce_sym(sym_product(x0))              # A = sum X_0,i X_0,i^T
        ar = am[:, r0:r1]
        zr = sym_product(ar, am, alpha=c, beta=b, c=ar)                  # Z rows
        if first and ends[i]:
            q = yield from all_gather(zr[0] + a * eye_rows[0], m)        # Q = P
            continue
        z = yield from all_gather(zr[0], m)
        qr = zr + a * eye_rows if first else sym_product(qr, z, beta=a, c=qr)   # Q P = Q Z + a Q
        if ends[i]:
            q = yield from all_gather(qr[0], m)
            continue
        rr = sym_product(ar, z, beta=a, c=ar)                            # R = A P = A Z + a A
        am = yield from all_gather(sym_product(rr, z, beta=a, c=rr)[0], m)   # A <- R P
    return left_product(q, x0)[0].to(x.dtype)

def simulate_split_ns(x: Tensor, layout: SplitLayout, table: Sequence[tuple[float, float, float]], *,
                      variant: Literal["direct", "gram"], gram_restart: Optional[int] = None,
                      eps: float = 1e-7, dtype: Optional[torch.dtype] = None,
                      schedule: Optional[Schedule] = None) -> Tensor:
    """Run the ``k`` ranks of a split NS in this process, their collectives executed by
    :func:`~dmuon.functional.simulate.simulate` from ``schedule`` (default: :func:`split_ns_schedule`
    on a ``k x 1`` mesh, members ``0 .. k-1``).

    Args:
      x: the whole wide matrix (``layout.m x layout.n``); the rest as :func:`split_ns_rank`.

    Returns:
      the assembled ``m x n`` result (column blocks concatenated).

    Raises:
      ValueError: a yielded buffer that does not match its op (size or dtype), or a schedule with
        a different number of collectives than the program.
    """
    from dmuon.functional.simulate import simulate

    cdt = x.dtype if dtype is None else dtype
    if schedule is None:
        acc = torch.promote_types(torch.promote_types(x.dtype, cdt), torch.float32)
        schedule = split_ns_schedule("x", layout, range(layout.k), layout.k, 1, steps=len(table),
                                     variant=variant, gram_restart=gram_restart, dtype=cdt,
                                     acc_dtype=acc)
    gens = [split_ns_rank(x[:, c0:c1], layout, i, table, variant=variant, gram_restart=gram_restart,
                          eps=eps, dtype=dtype) for i, (c0, c1) in enumerate(layout.col_ranges)]
    bufs = [next(g) for g in gens]
    outs: list[Optional[Tensor]] = [None] * layout.k
    world = schedule.world_size
    for n_op, op in enumerate(schedule.ops):
        if bufs[0] is None:
            raise ValueError(f"the schedule has {len(schedule.ops)} collectives, the program {n_op}")
        ranks: list[dict] = [{} for _ in range(world)]
        for j, g in enumerate(op.members):
            b = bufs[j]
            if b.numel() != op.numel or dtype_str(b.dtype) != op.dtype:
                raise ValueError(f"op {op.id}: block {j} yielded {b.numel()} x {b.dtype}, the op "
                                 f"moves {op.numel} x {op.dtype}")
            ranks[g] = {op.bucket: b}
        one = dataclasses.replace(op, waits=())          # run alone; order is the loop's
        simulate(Schedule((one,), schedule.shard_size, schedule.replicate_size), ranks, donate=True)
        for j, g in enumerate(gens):
            try:
                bufs[j] = g.send(None)
            except StopIteration as stop:
                bufs[j], outs[j] = None, stop.value
    if any(o is None for o in outs):
        raise ValueError("the program has more collectives than the schedule")
    return torch.cat(outs, dim=1)
