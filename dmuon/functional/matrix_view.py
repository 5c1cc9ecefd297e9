"""Matrix views: how a parameter tensor is seen as batches of matrices (pure).

Muon orthogonalizes matrices. A *view* maps a parameter (or its gradient / update) of ``shape`` to
one or more blocks, each a ``(B, m, n)`` tensor of ``B`` independent ``m x n`` matrices, and back:
``view.from_blocks(view.to_blocks(x), shape)`` is ``x`` exactly (the same values, bitwise).
Newton–Schulz runs on every matrix of every block, the learning-rate shape scale ``s(m, n)`` is
taken per block, and the plan's cost model sums the blocks' NS costs.

Named rules (each a frozen, hashable dataclass; ``str(view)`` is its canonical spelling, part of the
plan fingerprint):

* :class:`Batch` ``(dims)`` — the first ``dims`` dims index independent matrices:
  ``B = prod(shape[:dims])``, ``m = shape[dims]``, ``n = prod(shape[dims + 1:])``. ``Batch(1)`` is
  one matrix per expert of an ``(E, out, in)`` stack; ``Batch(0)`` is one matrix (a 2-D weight
  itself; a convolution kernel ``(out, in, kh, kw)`` *flattened* to ``out x (in·kh·kw)``).
  ``batch_dims=k`` anywhere in dmuon is exactly ``Batch(k)``.
* :class:`Heads` ``(heads, axis)`` — a 2-D weight split into ``heads`` equal heads: ``axis="rows"``
  (q/k/v projections ``(h·d, H)`` → ``(h, d, H)``), ``axis="cols"`` (the output projection
  ``(H, h·d)`` → ``(h, H, d)``).
* :class:`Split` ``(sizes, axis)`` — a fused 2-D weight cut into its parts along rows (``qkv_proj``
  rows ``q | k | v``, ``gate_up_proj`` rows ``gate | up``) or columns; consecutive parts of equal
  size form one block. A ≥3-D param is a stack of such weights, each cut the same way (MoE
  experts' fused ``(E, 2I, H)`` ``gate_up_proj``: ``2E`` matrices of ``(I, H)``).
* :class:`Transposed` ``(inner)`` — a 2-D weight stored as ``(in, out)`` (GPT-2's ``Conv1D``) seen
  as its transpose ``(out, in)``, then by ``inner`` (default ``Batch(0)``): the shape scale sees
  ``m = out``, ``n = in``, and a fused ``c_attn`` can be split, ``Transposed(Split((H, H, H)))``.
* :class:`Sliced` ``(dim, parts)`` — the param is one of ``parts`` equal slices, along ``dim``, of a
  2-D matrix (its tensor-parallel shard; dmuon sets it, users do not pick it). Its block is the
  *full* matrix: the shape scale and the cost are the full matrix's; ``to_blocks`` gives the slice
  itself, and the orthogonalizer must assemble the slices and return this slice of ``NS(full)``
  (:mod:`dmuon.stateful.modes.tensor_parallel`). Plain Newton–Schulz of the slice alone would be a
  different update, so :func:`needs_assembly` lets the NS paths refuse it.

The NS of a view is the NS of each of its matrices; the update written back has the param's shape.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence, Union

import torch
from torch import Tensor

from dmuon.newton_schulz.matrix_shape import as_matrix_shape

__all__ = ["MatrixView", "Batch", "Heads", "Split", "Transposed", "Sliced", "VIEW_RULES", "as_view",
           "views_per_leaf", "describe_view", "needs_assembly", "refuse_plain_ns"]

#: The rule names, as ``str(view)`` starts and as error messages list them.
VIEW_RULES = ("batch", "heads", "split", "transposed")

BlockShape = tuple[int, int, int]


def _shape(shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {dims} has a negative size")
    return dims


def _two_d(view: Any, shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"matrix view {view} needs a 2-D param, got shape {shape}; use Batch(k) "
                         "for stacks of matrices")
    return shape


def _axis(axis: str) -> str:
    if axis not in ("rows", "cols"):
        raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}")
    return axis


class MatrixView:
    """Base of the view rules: ``blocks(shape)``, ``to_blocks(x)``, ``from_blocks(us, shape)``."""

    def blocks(self, shape: Sequence[int]) -> tuple[BlockShape, ...]:
        """The ``(B, m, n)`` of each block of a param of ``shape`` (raises ``ValueError`` if the
        view does not fit the shape)."""
        raise NotImplementedError

    def to_blocks(self, x: Tensor) -> list[Tensor]:
        """``x`` (the param's shape) as its blocks; each block is contiguous and is either a view
        of ``x`` (when ``x`` is contiguous and the rule only reshapes) or a fresh copy."""
        raise NotImplementedError

    def from_blocks(self, us: Sequence[Tensor], shape: Sequence[int]) -> Tensor:
        """The exact inverse of :meth:`to_blocks`: blocks of ``blocks(shape)`` shapes → a tensor of
        ``shape``."""
        raise NotImplementedError

    def matrices(self, shape: Sequence[int]) -> int:
        """Number of matrices NS runs on (the sum of the blocks' ``B``)."""
        return sum(b for b, _, _ in self.blocks(shape))


@dataclass(frozen=True)
class Batch(MatrixView):
    """``dims`` leading batch dims (``Batch(0)``: one matrix, ≥3-D flattened; module docstring)."""

    dims: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.dims, bool) or not isinstance(self.dims, int) or self.dims < 0:
            raise ValueError(f"Batch(dims) needs an int >= 0, got {self.dims!r}")

    def __str__(self) -> str:
        return f"batch({self.dims})"

    def blocks(self, shape):
        if torch.compiler.is_compiling():  # traced once: no memo (dynamo warns on lru_cache)
            return _batch_blocks.__wrapped__(tuple(shape), self.dims)
        return _batch_blocks(tuple(shape), self.dims)

    def to_blocks(self, x):
        return [x.reshape(self.blocks(x.shape)[0]).contiguous()]

    def from_blocks(self, us, shape):
        (u,) = us
        return u.reshape(tuple(shape))


@functools.lru_cache(maxsize=1024)
def _batch_blocks(shape: tuple[int, ...], dims: int) -> tuple[BlockShape, ...]:
    """``Batch(dims).blocks(shape)``, memoized: a pure function of two hashable values, asked
    per matrix and step (an invalid shape raises every time: exceptions are not cached)."""
    return (as_matrix_shape(_shape(shape), dims),)


@dataclass(frozen=True)
class Heads(MatrixView):
    """A 2-D weight as ``heads`` equal heads along ``axis`` (``"rows"``: q/k/v, ``"cols"``: o)."""

    heads: int
    axis: str = "rows"

    def __post_init__(self) -> None:
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads < 1:
            raise ValueError(f"Heads(heads) needs an int >= 1, got {self.heads!r}")
        _axis(self.axis)

    def __str__(self) -> str:
        return f"heads({self.heads},{self.axis})"

    def blocks(self, shape):
        m, n = _two_d(self, _shape(shape))
        size = m if self.axis == "rows" else n
        if size % self.heads:
            raise ValueError(f"view {self}: the {self.axis} of shape {(m, n)} ({size}) do not "
                             f"divide into {self.heads} heads")
        d = size // self.heads
        return ((self.heads, d, n),) if self.axis == "rows" else ((self.heads, m, d),)

    def to_blocks(self, x):
        (b,) = self.blocks(x.shape)
        if self.axis == "rows":
            return [x.reshape(b).contiguous()]
        m = x.shape[0]
        return [x.reshape(m, self.heads, b[2]).permute(1, 0, 2).contiguous()]

    def from_blocks(self, us, shape):
        (u,) = us
        m, n = shape
        if self.axis == "rows":
            return u.reshape(m, n)
        return u.permute(1, 0, 2).reshape(m, n)


def _runs(sizes: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(start, count, size)`` of each run of equal consecutive sizes."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for s in sizes:
        if out and out[-1][2] == s:
            a, c, _ = out[-1]
            out[-1] = (a, c + 1, s)
        else:
            out.append((start, 1, s))
        start += s
    return out


@dataclass(frozen=True)
class Split(MatrixView):
    """A fused weight as its parts of ``sizes`` along ``axis`` (module docstring); a ≥3-D param
    is a stack of such fused matrices (its leading dims index them: MoE experts' ``(E, 2I, H)``
    ``gate_up_proj``), each split the same way, the parts of each matrix kept together."""

    sizes: tuple[int, ...]
    axis: str = "rows"

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"Split(sizes) needs a non-empty tuple of ints >= 1, got {self.sizes!r}")
        object.__setattr__(self, "sizes", sizes)
        _axis(self.axis)

    def __str__(self) -> str:
        return f"split({'+'.join(map(str, self.sizes))},{self.axis})"

    def _lead(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(matrices in the stack, m, n)``."""
        if len(shape) < 2:
            raise ValueError(f"matrix view {self} needs a matrix (or a stack of them), got shape "
                             f"{shape}")
        b = 1
        for d in shape[:-2]:
            b *= d
        return b, shape[-2], shape[-1]

    def blocks(self, shape):
        lead, m, n = self._lead(_shape(shape))
        size = m if self.axis == "rows" else n
        if sum(self.sizes) != size:
            raise ValueError(f"view {self}: the parts sum to {sum(self.sizes)} but the {self.axis} "
                             f"of shape {tuple(shape)} are {size}")
        return tuple((lead * c, s, n) if self.axis == "rows" else (lead * c, m, s)
                     for _, c, s in _runs(self.sizes))

    def to_blocks(self, x):
        lead, m, n = self._lead(tuple(x.shape))
        self.blocks(x.shape)
        x = x.reshape(lead, m, n)
        out = []
        for a, c, s in _runs(self.sizes):
            if self.axis == "rows":
                out.append(x[:, a:a + c * s].reshape(lead * c, s, n).contiguous())
            else:
                out.append(x[:, :, a:a + c * s].reshape(lead, m, c, s).permute(0, 2, 1, 3)
                           .reshape(lead * c, m, s).contiguous())
        return out

    def from_blocks(self, us, shape):
        import torch
        shape = tuple(shape)
        lead, m, n = self._lead(shape)
        if self.axis == "rows":
            full = torch.cat([u.reshape(lead, -1, n) for u in us], dim=1)
        else:
            full = torch.cat([u.reshape(lead, -1, m, u.shape[-1]).permute(0, 2, 1, 3)
                              .reshape(lead, m, -1) for u in us], dim=2)
        return full.reshape(shape)


@dataclass(frozen=True)
class Transposed(MatrixView):
    """A 2-D weight stored ``(in, out)`` seen as ``(out, in)``, then by ``inner``."""

    inner: MatrixView = Batch(0)

    def __post_init__(self) -> None:
        if not isinstance(self.inner, MatrixView) or isinstance(self.inner, Transposed):
            raise ValueError(f"Transposed(inner) needs a non-transposed MatrixView, got {self.inner!r}")

    def __str__(self) -> str:
        return f"transposed({self.inner})"

    def blocks(self, shape):
        a, b = _two_d(self, _shape(shape))
        return self.inner.blocks((b, a))

    def to_blocks(self, x):
        self.blocks(x.shape)
        return self.inner.to_blocks(x.t().contiguous())

    def from_blocks(self, us, shape):
        a, b = shape
        return self.inner.from_blocks(us, (b, a)).t().contiguous()


@dataclass(frozen=True)
class Sliced(MatrixView):
    """Slice ``i`` of ``parts`` equal slices of a 2-D ``(M, N)`` matrix along ``dim`` (0: rows,
    1: columns): a param of shape ``(M/parts, N)`` or ``(M, N/parts)``. ``blocks`` reports the full
    matrix ``(1, M, N)``; ``to_blocks`` / ``from_blocks`` move the slice itself as ``(1, m, n)``."""

    dim: int
    parts: int

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or isinstance(self.parts, bool) or not isinstance(self.parts, int) \
                or self.parts < 1:
            raise ValueError(f"Sliced(dim, parts) needs dim 0 or 1 and an int parts >= 1, got "
                             f"({self.dim!r}, {self.parts!r})")

    def __str__(self) -> str:
        return f"sliced({self.dim}, {self.parts})"

    def full_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """The full matrix's ``(M, N)`` for a slice of ``shape``."""
        m, n = _two_d(self, _shape(shape))
        return (m * self.parts, n) if self.dim == 0 else (m, n * self.parts)

    def blocks(self, shape):
        return ((1,) + self.full_shape(shape),)

    def to_blocks(self, x):
        self.blocks(x.shape)
        return [x.reshape((1,) + tuple(x.shape)).contiguous()]

    def from_blocks(self, us, shape):
        (u,) = us
        return u.reshape(tuple(shape))


def needs_assembly(view: MatrixView) -> bool:
    """True for a view whose blocks are slices of a larger matrix (:class:`Sliced`): its NS input
    must be assembled from every slice first."""
    return isinstance(view, Sliced)


def refuse_plain_ns(views: Sequence[MatrixView], names: Sequence[str]) -> None:
    """Raise ``ValueError`` if any view needs assembly: plain Newton–Schulz of a slice alone is
    not the slice of the full matrix's NS (pass an orthogonalizer that assembles them)."""
    bad = [n for n, v in zip(names, views) if needs_assembly(v)]
    if bad:
        raise ValueError(
            f"params {bad[:4]} are seen through a Sliced view (slices of a larger matrix, e.g. a "
            "tensor-parallel shard): Newton–Schulz must run on the assembled matrix. Pass an "
            "orthogonalize= / orthogonalizer= that gathers the slices and returns each one's part "
            "of NS(full) (dmuon.Muon does this over the TP group), or use the full matrices.")


ViewLike = Union[MatrixView, int]


def as_view(v: ViewLike) -> MatrixView:
    """A :class:`MatrixView` from a view or an int ``k`` (``batch_dims=k``, i.e. ``Batch(k)``)."""
    if isinstance(v, MatrixView):
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return Batch(v)
    raise TypeError(f"a matrix view must be a dmuon.functional.matrix_view rule ({', '.join(VIEW_RULES)}) "
                    f"or an int (batch dims), got {v!r}")


def describe_view(view: MatrixView, shape: Sequence[int]) -> str:
    """Human spelling for plan tables: ``"matrix"``, ``"flatten"``, ``"batch(1) 4x(16x16)"``..."""
    blocks = view.blocks(shape)
    if isinstance(view, Batch) and view.dims == 0:
        return "matrix" if len(tuple(shape)) == 2 else f"flatten {blocks[0][1]}x{blocks[0][2]}"
    return f"{view} " + "+".join(f"{b}x({m}x{n})" for b, m, n in blocks)




def views_per_leaf(view: Any, batch_dims: Any, params: Any, treedef: Any) -> list[MatrixView]:
    """One :class:`MatrixView` per param leaf, from ``update``'s ``view=`` / ``batch_dims=``.

    Precedence: ``view=`` (one view, a params-shaped pytree of views, or ``{path: view}``; missing
    leaves get ``Batch(0)``) and ``batch_dims=`` (the same forms with ints) are two spellings of
    one option; giving both raises ``ValueError``. ``batch_dims=k`` is ``view=Batch(k)``; an int
    inside ``view=`` also means ``Batch(k)``.
    """
    from dmuon.functional.tree import per_leaf_option

    if view is not None and batch_dims is not None:
        raise ValueError("give the matrix views as view= or as batch_dims=, not both "
                         "(batch_dims=k is view=Batch(k); dmuon.functional.matrix_view)")
    if view is None:
        bd = per_leaf_option(batch_dims, params, treedef, default=0, what="batch_dims",
                             is_value=lambda v: isinstance(v, int) and not isinstance(v, bool))
        made: dict[int, MatrixView] = {}  # views are frozen: one per distinct k, shared by its
        out: list[MatrixView] = []        # leaves (asked per step: no new view per leaf)
        for k in bd:
            if isinstance(k, int) and not isinstance(k, bool):
                k = int(k)
                if k not in made:
                    made[k] = Batch(k)
                out.append(made[k])
            else:
                out.append(as_view(k))
        return out
    vs = per_leaf_option(view, params, treedef, default=Batch(0), what="view",
                         is_value=lambda v: isinstance(v, MatrixView))
    return [as_view(v) for v in vs]
