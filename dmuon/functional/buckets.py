"""Hook groups and the flat bucket layout of dedicated parameters (pure data, built once at setup).

Mesh model: ``G`` = shard size, ``R`` = replicate size, rank coordinates ``(s, r)`` and global rank
``r * G + s`` (a DeviceMesh of shape ``(R, G)`` with dims ``("replicate", "shard")``; 1-D means R = 1).
Every dedicated matrix has an owner ``(s_o, r_o)``. In HSDP its master copy lives on all ranks
``(s_o, *)`` of its shard column; only ``(s_o, r_o)`` runs Newton–Schulz.

Hook group
    A string key; the hooks of one module boundary (by default the ``layers.N`` / ``blocks.N``
    ancestor) move all dedicated params of its group together. Groups have an order (forward order).

Bucket
    Per ``(group, shard column s, dtype)`` one flat 1-D buffer holding every param of the group whose
    owner is ``(s, r)`` for any ``r``. Entries ``(name, offset, numel, shape, owner)`` are sorted by
    ``(r, name)`` so each ``r``'s entries form one contiguous range (``Bucket.ranges``), which lets the
    second (replicate-axis) stage of the HSDP gradient reduce and the post-step publish address one
    sub-range per owner ``r``.

Design decision on dtypes: a group may mix dtypes; buckets are keyed by dtype as well
(``BucketKey(group, column, dtype)``), so one bucket always has one dtype and no casts happen.

Alignment: with ``align = k`` every entry offset and every per-``r`` range start is a multiple of
``k`` elements (gaps are padding, never read); the default ``align = 1`` packs densely, so the bucket
numel equals the params' numel and the byte accounting of a schedule equals the params' bytes.

Presence elements (gradient reduces, ``presence=True``): each per-``r`` range ends with one element
per entry of that ``r``, which the sender sets to 1 when it holds a gradient for the param and 0
when it does not (a param used on some ranks only, e.g. an MoE expert that got no token there). The
reduce averages them with the gradients, in the same collective, so the owner learns whether *any*
rank had a gradient (then the zeros of the others count in the average, as DDP's
``find_unused_parameters``) or none did (then the update skips the param, as a single-device
optimizer skips ``grad is None``). They add one element per matrix to the bucket.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from dmuon.functional.module_paths import ancestors
from dmuon.functional.owner_plan import Coord
from dmuon.functional.specs import dtype_from_str, layer_key_from_name

GroupKeySpec = Union[Callable[[str], "str | None"], Mapping[str, str], None]

__all__ = [
    "Coord", "HookGroups", "hook_groups", "default_group_key", "ROOT_GROUP", "boundary_groups",
    "BucketKey", "BucketEntry", "Bucket",
    "BucketLayout", "bucket_layout", "dtype_str", "to_torch_dtype", "dtype_itemsize",
]


#: The hook group of params under no boundary module (gathered for the whole forward: never Z3).
ROOT_GROUP = ""


def default_group_key(name: str) -> str:
    """Default hook-group key of a parameter name: its layer key, else its parent module path.

    The layer key is :func:`dmuon.functional.specs.layer_key_from_name` (so groups agree with the
    owner plan's layer keys); a name with no layer key gets its parent module path (``""`` for a
    top-level param).
    """
    key = layer_key_from_name(name)
    if key is None:
        key = name.rsplit(".", 1)[0] if "." in name else ""
    return key


@dataclass(frozen=True)
class HookGroups:
    """An ordered partition of dedicated param names into hook groups.

    Attributes:
      order: group keys in forward order.
      members: ``(group, names)`` pairs in ``order``; names sorted.
    """

    order: tuple[str, ...]
    members: tuple[tuple[str, tuple[str, ...]], ...]
    _of: Mapping[str, str] = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        of = {n: g for g, names in self.members for n in names}
        object.__setattr__(self, "_of", of)

    def group_of(self, name: str) -> str:
        """The group key of ``name``; ``KeyError`` naming the param if it is not grouped."""
        try:
            return self._of[name]
        except KeyError:
            raise KeyError(f"param {name!r} is in no hook group; pass it to hook_groups()") from None

    def names(self, group: str) -> tuple[str, ...]:
        """The sorted param names of ``group``."""
        for g, names in self.members:
            if g == group:
                return names
        raise KeyError(f"unknown hook group {group!r}; known: {list(self.order)}")

    def as_mapping(self) -> dict[str, str]:
        """``{name: group}``."""
        return dict(self._of)


def hook_groups(names: Sequence[str], key: GroupKeySpec = None, *,
                order: Sequence[str] | None = None) -> HookGroups:
    """Group dedicated param names by hook group.

    Args:
      names: dedicated param names (fully-qualified).
      key: ``name -> group key`` as a callable or a mapping (e.g. from walking the module tree with the
        hook-boundary predicate); ``None`` uses :func:`default_group_key`. A callable returning ``None``
        falls back to :func:`default_group_key`.
      order: forward order of group keys; every group must appear in it (extra keys are ignored).
        ``None``: order of first appearance in ``names``.

    Returns:
      A :class:`HookGroups`.

    Raises:
      ValueError: duplicate names, a name missing from a mapping, or a group missing from ``order``.
    """
    names = list(names)
    if len(set(names)) != len(names):
        raise ValueError("hook_groups: duplicate param names")
    groups: dict[str, list[str]] = {}
    for n in names:
        if key is None:
            g = default_group_key(n)
        elif isinstance(key, Mapping):
            if n not in key:
                raise ValueError(f"hook_groups: param {n!r} missing from the group mapping")
            g = key[n]
        else:
            g = key(n)
            if g is None:
                g = default_group_key(n)
        groups.setdefault(str(g), []).append(n)
    if order is None:
        ordered = list(groups)
    else:
        pos = {g: i for i, g in enumerate(order)}
        missing = [g for g in groups if g not in pos]
        if missing:
            raise ValueError(f"hook_groups: groups {missing} are not in the given order list")
        ordered = sorted(groups, key=pos.__getitem__)
    return HookGroups(order=tuple(ordered),
                      members=tuple((g, tuple(sorted(groups[g]))) for g in ordered))


def boundary_groups(aliases: Mapping[str, Sequence[str]],
                    accepts: Optional[Callable[[str], bool]],
                    module_order: Sequence[str]) -> HookGroups:
    """The hook groups of ``dedicate_params``: each param is moved by the hooks of its hook
    boundary, the lowest (deepest) module path above it that ``accepts`` (``None``: its layer key,
    :func:`dmuon.functional.specs.layer_key_from_name`), else the root group (:data:`ROOT_GROUP`).

    Args:
      aliases: ``{name: every name of that param}`` of the dedicated params, in order (a tied param,
        shared by several modules, has several: under different boundaries it goes to the root
        group, gathered for the whole forward).
      accepts: ``module path -> bool``, the hook-boundary predicate on the module at that path.
      module_order: the model's module paths in ``named_modules()`` order (the groups' order).
    """
    def boundary(name: str) -> str:
        if accepts is None:
            key = layer_key_from_name(name)
            return key if key is not None else ROOT_GROUP
        # the lowest (deepest) accepted ancestor first
        return next((path for path in ancestors(name) if accepts(path)), ROOT_GROUP)

    keys = {}
    for n, names in aliases.items():
        bounds = {boundary(a) for a in names}
        keys[n] = bounds.pop() if len(bounds) == 1 else ROOT_GROUP
    pos = {m: i for i, m in enumerate(module_order)}
    return hook_groups(list(aliases), keys,
                       order=sorted(set(keys.values()), key=lambda k: pos.get(k, -1)))


# ---------------------------------------------------------------------------------------------
# dtypes as strings (plans and layouts are plain data, hashable and printable)

def dtype_str(dtype: "torch.dtype | str") -> str:
    """``torch.float32`` or ``"float32"`` or ``"torch.float32"`` -> ``"torch.float32"``."""
    return str(to_torch_dtype(dtype))


#: Parse a dtype given as ``torch.dtype`` or its string; ``ValueError`` if unknown (the one parser:
#: :func:`dmuon.functional.specs.dtype_from_str`).
to_torch_dtype = dtype_from_str


def dtype_itemsize(dtype: "torch.dtype | str") -> int:
    """Bytes per element."""
    return to_torch_dtype(dtype).itemsize


# ---------------------------------------------------------------------------------------------
# bucket layout

class BucketKey(NamedTuple):
    """Identifies one flat bucket: hook group, shard column ``s`` of the owners, dtype string."""

    group: str
    column: int
    dtype: str

    def __str__(self) -> str:
        return f"{self.group or '<root>'}|s{self.column}|{self.dtype.replace('torch.', '')}"


@dataclass(frozen=True)
class BucketEntry:
    """One param inside a bucket: elements ``[offset, offset + numel)`` viewed as ``shape``.

    ``flag``: the offset of its presence element in a layout built with ``presence=True`` (1 where a
    rank holds a gradient for the param, 0 where it does not; averaged by the reduce, so the owner
    sees > 0 iff any rank had one), ``-1`` otherwise."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    owner: Coord
    flag: int = -1


@dataclass(frozen=True)
class Bucket:
    """A flat buffer of one ``(group, column, dtype)``.

    Attributes:
      key: the :class:`BucketKey`.
      entries: sorted by ``(owner r, name)``.
      numel: total elements (including alignment padding).
      ranges: ``(r, offset, numel)`` for every replicate index ``r`` that owns entries here, in ``r``
        order; the range covers exactly that ``r``'s entries (plus padding between them).
    """

    key: BucketKey
    entries: tuple[BucketEntry, ...]
    numel: int
    ranges: tuple[tuple[int, int, int], ...]

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.key.dtype)

    def range_of(self, r: int) -> tuple[int, int]:
        """``(offset, numel)`` of owner replica ``r``'s entries; ``(0, 0)`` if it owns none here."""
        for rr, off, n in self.ranges:
            if rr == r:
                return off, n
        return 0, 0

    def entry(self, name: str) -> BucketEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(f"param {name!r} not in bucket {self.key}")


@dataclass(frozen=True)
class BucketLayout:
    """All buckets of the dedicated params, for mesh ``(R, G)``.

    Attributes:
      shard_size: G.  replicate_size: R.
      groups: hook-group keys in forward order (only groups that hold at least one param).
      buckets: every bucket, ordered by (group order, column, dtype).
    """

    shard_size: int
    replicate_size: int
    groups: tuple[str, ...]
    buckets: tuple[Bucket, ...]
    # ``{group: its buckets}``, built once (the runtime looks groups up every hook); derived data,
    # so it takes no part in ``__init__``, equality, hashing or ``repr``
    _by_group: Mapping[str, tuple[Bucket, ...]] = field(
        default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        by_group: dict[str, list[Bucket]] = {g: [] for g in self.groups}
        for b in self.buckets:
            if b.key.group in by_group:
                by_group[b.key.group].append(b)
        object.__setattr__(self, "_by_group", {g: tuple(bs) for g, bs in by_group.items()})

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size

    def bucket(self, key: BucketKey) -> Bucket:
        for b in self.buckets:
            if b.key == key:
                return b
        raise KeyError(f"no bucket {key}")

    def buckets_of(self, group: str) -> tuple[Bucket, ...]:
        """Buckets of one hook group (columns ascending, then dtype)."""
        try:
            return self._by_group[group]
        except KeyError:
            raise KeyError(f"unknown hook group {group!r}; known: {list(self.groups)}") from None

    def locate(self, name: str) -> tuple[BucketKey, BucketEntry]:
        """Which bucket holds ``name`` and where."""
        for b in self.buckets:
            for e in b.entries:
                if e.name == name:
                    return b.key, e
        raise KeyError(f"param {name!r} is in no bucket")

    def nbytes(self, group: str | None = None) -> int:
        """Bytes of all buckets (or of one group's), padding included."""
        bs = self.buckets if group is None else self.buckets_of(group)
        return sum(b.nbytes for b in bs)

    def table(self) -> str:
        """Readable listing of the layout."""
        lines = [f"BucketLayout G={self.shard_size} R={self.replicate_size} "
                 f"groups={len(self.groups)} buckets={len(self.buckets)} bytes={self.nbytes()}"]
        for b in self.buckets:
            lines.append(f"  bucket {b.key}: numel={b.numel} ranges={list(b.ranges)}")
            for e in b.entries:
                lines.append(f"    [{e.offset:>10}, +{e.numel:>9}) {e.name} {tuple(e.shape)} "
                             f"owner={e.owner}")
        return "\n".join(lines)


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def bucket_layout(owners: Mapping[str, Coord], shapes: Mapping[str, Sequence[int]],
                  dtypes: "Mapping[str, torch.dtype | str]", groups: "HookGroups | Mapping[str, str]",
                  shard_size: int, replicate_size: int = 1, *, align: int = 1,
                  presence: bool = False) -> BucketLayout:
    """Lay out every dedicated param in flat buckets, one per (hook group, owner column, dtype).

    Args:
      owners: ``name -> (s, r)`` owner coordinate (e.g. ``OwnerPlan.owners``); its keys are the
        dedicated params.
      shapes: ``name -> shape`` for every owned name.
      dtypes: ``name -> dtype`` (``torch.dtype`` or its string) of the communicated tensor.
      groups: a :class:`HookGroups` or a plain ``name -> group`` mapping (then ordered by first
        appearance in ``owners``).
      shard_size: G >= 1.  replicate_size: R >= 1.
      align: every entry offset and every per-``r`` range start is a multiple of ``align`` elements.
      presence: append one presence element per entry at the end of its ``r``'s range (see the
        module docstring); the entries' ``flag`` give their offsets.

    Returns:
      A :class:`BucketLayout`; deterministic for equal inputs.

    Raises:
      ValueError: an owner outside the mesh, a missing shape/dtype/group, ``align < 1``.
    """
    if shard_size < 1 or replicate_size < 1:
        raise ValueError(f"mesh sizes must be >= 1, got G={shard_size}, R={replicate_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if not isinstance(groups, HookGroups):
        groups = hook_groups(list(owners), dict(groups))
    per: dict[BucketKey, list[tuple[int, str]]] = {}
    for name, coord in owners.items():
        s, r = int(coord[0]), int(coord[1])
        if not (0 <= s < shard_size and 0 <= r < replicate_size):
            raise ValueError(f"owner {coord} of {name!r} is outside the mesh G={shard_size}, "
                             f"R={replicate_size}")
        if name not in shapes or name not in dtypes:
            raise ValueError(f"param {name!r} needs a shape and a dtype")
        key = BucketKey(groups.group_of(name), s, dtype_str(dtypes[name]))
        per.setdefault(key, []).append((r, name))
    gpos = {g: i for i, g in enumerate(groups.order)}
    keys = sorted(per, key=lambda k: (gpos[k.group], k.column, k.dtype))
    buckets = []
    for key in keys:
        entries, ranges, off = [], [], 0
        by_r: dict[int, list[str]] = {}
        for r, name in sorted(per[key]):
            by_r.setdefault(r, []).append(name)
        for r, names in by_r.items():
            off = _round_up(off, align)
            start, mine = off, []
            for name in names:
                shape = tuple(int(d) for d in shapes[name])
                n = math.prod(shape)
                off = _round_up(off, align)
                mine.append([name, off, n, shape])
                off += n
            for item in mine:
                flag = off if presence else -1
                off += 1 if presence else 0
                entries.append(BucketEntry(item[0], item[1], item[2], item[3], (key.column, r),
                                           flag))
            ranges.append((r, start, off - start))
        buckets.append(Bucket(key, tuple(entries), off, tuple(ranges)))
    used = [g for g in groups.order if any(k.group == g for k in keys)]
    return BucketLayout(shard_size, replicate_size, tuple(used), tuple(buckets))
