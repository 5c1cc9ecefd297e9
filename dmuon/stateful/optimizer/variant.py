"""``dmuon.Muon(..., transform=...)``: a chain of functional stages run on the owners.

:class:`VariantRunner` is what the optimizer holds when ``transform`` is given: the chain (a
:class:`~dmuon.functional.transforms.Transform`, or a function ``hparams -> Transform`` such as
:mod:`dmuon.functional.variants`' NorMuon, rebuilt from ``param_groups[0]`` at every step), its
state on this rank's owned matrices (the truth, ``Muon.variant_state``), and the per-param fields
of that state by name (:class:`Field`: ``"momentum_buffer"`` for a momentum stage's buffers, the
field's own name otherwise), which the state views and state dicts carry like momentum
(:mod:`dmuon.stateful.checkpoint.optimizer_state_dict`).

Each step runs :func:`dmuon.functional.owner_step.owner_step` with the chain, the policy's views
and ``(lr_mult, wd_mult)``, donated masters and gradients, the optimizer's NS (engine or
functional, and tensor parallelism's gathers around it) as every ``orthogonalize`` stage's, and
tensor parallelism's partial-sum reduction (:meth:`~dmuon.stateful.modes.tensor_parallel.TPStep.
sum_partials`) as the stages' ``sum_hook``.

**State options** (``momentum_dtype``, ``offload_state``): they apply to the momentum stage's
buffers, the field ``"momentum_buffer"`` (layout ``"param"``, the big one), kept between steps as
the optimizer's :class:`~dmuon.stateful.optimizer.state_storage.MomentumStorage` keeps plain
Muon's momentum (its encode / decode / offload, one definition). Each step decodes (offloaded:
copies in) that field to the master's dtype (:meth:`MomentumStorage.step_io`, the whole field at
once: a variant's step is not chunked), runs the chain on it, and encodes it back (offloaded:
copies it back), so the variant equals the one-process chain that rounds its momentum after each
update (:func:`~dmuon.functional.state_dtype.round_trip`). The other fields (a second momentum
stage's ``"momentum_buffer.1"``, NorMuon's per-row ``"second_moment"``) stay in the master's
dtype on the device. A chain without a momentum stage and a non-default option raises here.

Checked at construction, the same on every rank: the chain builds from the hyper-parameters; a
stage's needs (:data:`dmuon.functional.stages.NEEDS`) that an owner of a tensor-parallel slice
cannot serve raise naming the quantity and the matrices; per-param state fields must be the
param's shape (layout ``"param"``) or 1-D no larger than it (``"rows"``, ``"matrices"``), floating,
in a dtype the master holds exactly.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

from dmuon.functional import muon as fmuon
from dmuon.functional import transforms as T
from dmuon.functional.tree import get_path, replace_path
from dmuon.functional.matrix_view import Batch
from dmuon.functional.owner_step import owner_step
from dmuon.functional import state_dtype as sd
from dmuon.functional.state_dtype import checkpoint_dtype
from dmuon.functional.stages.leaves import default_views

__all__ = ["VariantRunner", "Field", "state_fields", "LAYOUTS"]

#: per-param state layouts: the param's shape; one value per row / per matrix of its view (1-D)
LAYOUTS = ("param", "rows", "matrices")


class Field(NamedTuple):
    """One per-param field of a chain state: its state-dict ``key``, its ``path`` in the state
    (tuple indices and field names), its ``layout`` (:data:`LAYOUTS`)."""

    key: str
    path: tuple
    layout: str


def state_fields(state: Any) -> list[Field]:
    """The per-param fields of ``state`` (NamedTuples naming them in ``per_param``), in walk
    order; a :class:`~dmuon.functional.transforms.MomentumState`'s buffers are
    ``"momentum_buffer"``, as plain Muon's; a name used twice gets ``".1"``, ``".2"``..."""
    found: list[tuple[str, tuple, str]] = []

    def walk(s: Any, path: tuple) -> None:
        if isinstance(s, tuple) and hasattr(s, "_fields"):
            per = getattr(type(s), "per_param", ())
            lay = getattr(type(s), "layouts", {})
            for name in s._fields:
                if name in per:
                    key = "momentum_buffer" if isinstance(s, T.MomentumState) else name
                    found.append((key, path + (name,), lay.get(name, "param")))
                else:
                    walk(getattr(s, name), path + (name,))
        elif type(s) is tuple:
            for j, x in enumerate(s):
                walk(x, path + (j,))
        elif isinstance(s, dict) and not any(isinstance(v, torch.Tensor) for v in s.values()):
            for k in sorted(s):
                walk(s[k], path + (k,))

    walk(state, ())
    seen: dict[str, int] = {}
    out = []
    for key, path, lay in found:
        j = seen.get(key, 0)
        seen[key] = j + 1
        out.append(Field(key if j == 0 else f"{key}.{j}", path, lay))
    return out


def scalar_leaves(state: Any, fields: list[Field]) -> list[torch.Tensor]:
    """The tensors of ``state`` outside its per-param fields (step counts), in walk order."""
    skip = {f.path for f in fields}
    out: list[torch.Tensor] = []

    def walk(s: Any, path: tuple) -> None:
        if path in skip:
            return
        if isinstance(s, torch.Tensor):
            out.append(s)
        elif isinstance(s, tuple) and hasattr(s, "_fields"):
            for name in s._fields:
                walk(getattr(s, name), path + (name,))
        elif isinstance(s, tuple):
            for j, x in enumerate(s):
                walk(x, path + (j,))
        elif isinstance(s, dict):
            for k in sorted(s):
                walk(s[k], path + (k,))

    walk(state, ())
    return out


def _tp_lacks(layouts: Mapping[str, Any]) -> dict[str, list[str]]:
    """``{quantity: [matrices]}`` an owner of a TP slice cannot serve (module docstring)."""
    lacks: dict[str, list[str]] = {}
    for n, lay in layouts.items():
        lacks.setdefault("whole_matrix", []).append(n)
        if lay.dim == 1:
            lacks.setdefault("whole_rows", []).append(n)
    return lacks


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable: not the same
        return False


class VariantRunner:
    """The optimizer's chain, its state and its fields (see the module docstring).

    Args:
      transform: a :class:`~dmuon.functional.transforms.Transform` (fixed: its hyper-parameters
        are its own) or a function ``MuonHParams -> Transform``.
      hparams: the optimizer's Muon hyper-parameters at construction.
      rt: the model's :class:`~dmuon.stateful.runtime.state.DedicatedState`.
      storage: the optimizer's momentum storage (``momentum_dtype``, ``offload_state``; ``None``
        or the identity storage: every field in the master's dtype on the device).

    Raises:
      ValueError: a non-default ``storage`` and a chain without a momentum stage.
    """

    def __init__(self, transform: Any, hparams: fmuon.MuonHParams, rt: Any,
                 storage: Any = None):
        if not (isinstance(transform, T.Transform) or callable(transform)):
            raise TypeError(f"dmuon.Muon: transform must be a dmuon.functional.transforms."
                            f"Transform or a function MuonHParams -> Transform (e.g. dmuon."
                            f"functional.variants.normuon()), got {type(transform).__name__}")
        self.transform, self.fixed = transform, isinstance(transform, T.Transform)
        self.hp0 = hparams
        chain = self.chain(hparams)
        if chain.update_ is None:
            raise TypeError("dmuon.Muon: the transform has no in-place form (a stage without "
                            "update_); the owners run chains in place")
        if self.fixed and any(m != (1.0, 1.0) for m in rt.hp_mults.values()):
            raise ValueError("dmuon.Muon: the policy sets lr_mult / wd_mult, but a fixed Transform "
                             "carries its own learning rate; pass a function hparams -> Transform")
        lacks = _tp_lacks(rt.tp_layouts)
        bad = {q: lacks[q] for q in chain.needs if q in lacks}
        if bad:
            q, ns = next(iter(bad.items()))
            raise ValueError(
                f"dmuon.Muon: the transform needs {q!r} of each matrix, which the owner of a "
                f"tensor-parallel slice does not hold ({len(ns)} matrices, e.g. {ns[:3]}: "
                f"{'row and column' if q == 'whole_matrix' else 'column'} slices). Leave those "
                "matrices out of TP, or use a stage that works on sums "
                "(Leaves.sum_partials: 'row_sums', 'matrix_sums').")
        self.views = {n: rt.views[n] for n in rt.names}
        metas = {n: torch.empty(rt.shape[n], dtype=rt.master_dtype[n], device="meta")
                 for n in rt.names}
        with default_views(self.views):
            meta_state = chain.init(metas)
        self.fields = state_fields(meta_state)
        self.local_shapes = {f.key: {n: tuple(t.shape) for n, t in
                                     get_path(meta_state, f.path).items()} for f in self.fields}
        self._check_fields(meta_state, rt)
        self.full_shapes = self.local_shapes
        if rt.tp_layouts:  # the single-device shapes (the full matrices, their default views)
            from dmuon.stateful.modes.tensor_parallel import full_shape
            full = {n: torch.empty(full_shape(rt, n), dtype=rt.master_dtype[n], device="meta")
                    for n in rt.names}
            views = {n: (Batch(0) if n in rt.tp_layouts else v) for n, v in self.views.items()}
            with default_views(views):
                full_state = chain.init(full)
            self.full_shapes = {f.key: {n: tuple(t.shape) for n, t in
                                        get_path(full_state, f.path).items()} for f in self.fields}
        #: the storage of the ``"momentum_buffer"`` field (``None``: fp32 on the device)
        self.master_dtype = {n: rt.master_dtype[n] for n in rt.names}
        self.storage = storage if storage is not None and not storage.identity else None
        self.stored_field = next((f for f in self.fields if f.key == "momentum_buffer"
                                  and f.layout == "param"), None)
        if self.storage is not None and self.stored_field is None:
            raise ValueError(
                f"dmuon.Muon: momentum_dtype={self.storage.dtype}, offload_state="
                f"{self.storage.offload} apply to the momentum stage's buffers, and this "
                "transform= has no momentum stage (no 'momentum_buffer' state field); nothing "
                "would be stored differently. Drop those options, or add T.trace_momentum(...) "
                "to the chain.")
        with default_views(self.views):
            self.state = chain.init(rt.owned_masters())
        if self.storage is not None:  # the momentum as stored (encoded; offloaded)
            self.state = replace_path(self.state, self.stored_field.path,
                                      self.storage.store(self.stored_momentum()))

    def chain(self, hparams: fmuon.MuonHParams) -> T.Transform:
        """The chain for ``hparams`` (a fixed Transform: itself)."""
        chain = self.transform if self.fixed else self.transform(hparams)
        if not isinstance(chain, T.Transform):
            raise TypeError(f"dmuon.Muon: transform(hparams) must return a Transform, got "
                            f"{type(chain).__name__}")
        return chain

    def _check_fields(self, state: Any, rt: Any) -> None:
        for f in self.fields:
            if f.layout not in LAYOUTS:
                raise ValueError(f"dmuon.Muon: state field {f.key!r} has layout {f.layout!r}; "
                                 f"one of {LAYOUTS}")
            for n, t in get_path(state, f.path).items():
                shape, numel = tuple(rt.shape[n]), 1
                for d in shape:
                    numel *= d
                ok = tuple(t.shape) == shape if f.layout == "param" else \
                    (t.ndim == 1 and t.numel() <= numel)
                wide = rt.master_dtype[n]
                fits = t.dtype.is_floating_point and (t.dtype == wide or torch.finfo(
                    t.dtype).bits < torch.finfo(wide).bits)
                if not (ok and fits):
                    raise ValueError(
                        f"dmuon.Muon: state field {f.key!r} of {n!r} is {tuple(t.shape)} "
                        f"{t.dtype}; a {f.layout!r} field must be "
                        + ("the param's shape " + str(shape) if f.layout == "param"
                           else f"1-D with at most {numel} values")
                        + f", floating, in a dtype the master ({wide}) holds")

    def step(self, grads: dict, params: dict, hparams: fmuon.MuonHParams, opt: Any) -> None:
        """One step of the chain on this rank's owned matrices (donated), with the optimizer
        ``opt``'s views, multipliers, NS and TP hooks."""
        from dmuon.newton_schulz.config import NSConfig
        rt, tp = opt.dedicated_state, opt._tp

        def orthogonalizer_for(spec: Any, names: list) -> Callable:
            """A stage's NS: the optimizer's (engine or functional) for an ``NSConfig``, the
            stage's own callable otherwise; behind TP's gathers."""
            base = opt._ns.for_config(rt.device.type, spec) if isinstance(spec, NSConfig) \
                else spec
            return tp.orthogonalizer(base, names, rt.program) if tp is not None else base
        if self.fixed and not all(_same(a, b) for a, b in zip(hparams, self.hp0)):
            raise RuntimeError(
                "dmuon.Muon.step: param_groups[0]'s Muon hyper-parameters changed (an lr "
                "scheduler?), but the transform is a fixed Transform with its own; nothing was "
                "updated. Pass a function hparams -> Transform (e.g. dmuon.functional.variants."
                "normuon()) so the chain is built from param_groups[0] each step, or schedule "
                "inside the chain.")
        update = self.transform if self.fixed else hparams
        state, io, stored = self.state, None, {}
        if self.storage is not None and self.stored_field is not None:
            # the stored momentum decoded (offloaded: copied in) to the masters' dtype, whole
            stored = self.stored_momentum()
            io = self.storage.step_io(stored, params)
            names = list(stored)
            state = replace_path(state, self.stored_field.path,
                                 dict(zip(names, io.load(names, [stored[n] for n in names]))))
        _, state = owner_step(
            grads, state, params, update, transform=None if self.fixed else self.transform,
            views=opt._views, mults=None if self.fixed else opt._hp_mults, donate=True,
            donate_grads=True, orthogonalizer_for=orthogonalizer_for,
            sum_hook=tp.sum_partials if tp is not None else None)
        if io is not None:  # encoded back (offloaded: copied back): those that stepped
            work = get_path(state, self.stored_field.path)
            done = [n for n in stored if grads.get(n) is not None]
            io.store(done, [stored[n] for n in done], [work[n] for n in done])
            state = replace_path(state, self.stored_field.path, stored)
        self.state = state

    def stored_momentum(self) -> dict[str, torch.Tensor]:
        """``{owned name: tensor}`` of the ``"momentum_buffer"`` field as stored (``{}``: no
        momentum stage)."""
        f = self.stored_field
        return {} if f is None else dict(get_path(self.state, f.path))

    def value_of(self, key: str, masters: Mapping[str, torch.Tensor], *, view: bool = False,
                 names: Optional[Any] = None) -> dict[str, torch.Tensor]:
        """``{owned name: value}`` of field ``key``: the live buffers, except the stored momentum
        (``momentum_dtype`` / ``offload_state``), which is given exactly in its checkpoint dtype
        on the device (:meth:`MomentumStorage.values`); ``view=True`` (``optimizer.state``): as
        plain Muon's view, the stored tensors themselves unless they hold an 8-bit float's data
        (then a decoded copy, an inference tensor: a write to it raises). ``names``: only those."""
        f = self.stored_field
        if self.storage is None or f is None or key != f.key:
            vals = self.field_values(key)
        elif view and not sd.is_scaled(self.storage.dtype):
            self.storage.synchronize()
            vals = self.stored_momentum()
        else:
            st = self.stored_momentum()
            if names is not None:
                st = {n: st[n] for n in names if n in st}
            with torch.inference_mode(view):
                return self.storage.values(st, masters)
        return vals if names is None else {n: vals[n] for n in names if n in vals}

    def field_values(self, key: str) -> dict[str, torch.Tensor]:
        """``{owned name: tensor}`` of field ``key`` (the live buffers)."""
        f = next(f for f in self.fields if f.key == key)
        return dict(get_path(self.state, f.path))

    def scalars(self) -> list[float]:
        """The state's counts (non-per-param tensors), as Python numbers."""
        return [float(t) for t in scalar_leaves(self.state, self.fields)]

    def load(self, values: Mapping[str, Mapping[str, torch.Tensor]],
             scalars: Optional[list], saved_dtype: Optional[str] = None,
             what: str = "load") -> None:
        """Install staged ``{key: {owned name: tensor}}`` and counts (copies into the buffers;
        the stored momentum re-stored from its values, converted from ``saved_dtype``, the
        checkpoint's ``momentum_dtype``, with a logged note when it differs)."""
        for f in self.fields:
            got = values.get(f.key, {})
            if f is self.stored_field and self.storage is not None and got:
                names = list(self.stored_momentum())
                if set(got) != set(names):  # stage_fields stages every owned matrix
                    raise ValueError(f"variant state {f.key!r}: {sorted(set(names) - set(got))[:3]}"
                                     " missing from the staged values")
                work = {n: got[n].to(dtype=self.master_dtype[n], copy=True) for n in names}
                self.state = replace_path(self.state, f.path,
                                          self.storage.load(work, saved_dtype, what))
                continue
            if f is self.stored_field and got:  # the default storage: converted as it copies in
                from dmuon.stateful.optimizer.state_storage import note_conversion
                note_conversion(saved_dtype, torch.float32, what)
            live = get_path(self.state, f.path)
            for n, t in got.items():
                live[n].copy_(t)
        if scalars is not None:
            ts = scalar_leaves(self.state, self.fields)
            if len(ts) != len(scalars):
                raise ValueError(f"variant counts: {len(scalars)} saved, {len(ts)} expected")
            for t, v in zip(ts, scalars):
                t.fill_(v)


# ------------------------------------------------------------------ state dicts
def _tp_rule(layout: str, lay: Any) -> Optional[int]:
    """How a TP slice's field makes the full one: the dim to concatenate along, or ``None`` (every
    TP rank holds the full field: a per-matrix value, or the rows of a column slice)."""
    if lay is None or layout == "matrices" or (layout == "rows" and lay.dim == 1):
        return None
    return lay.dim if layout == "param" else 0


def layout_of(optimizer: Any, key: str) -> str:
    """The layout of state-dict key ``key`` of a dedicated matrix (``"param"`` for Muon's
    ``momentum_buffer`` and a ``master``)."""
    var = getattr(optimizer, "_variant", None)
    if var is None:
        return "param"
    return next((f.layout for f in var.fields if f.key == key), "param")


def gather_fields(optimizer: Any, group: str) -> dict[str, dict[str, torch.Tensor]]:
    """Collective: ``{name: {key: full tensor}}`` of every field of the matrices of hook group
    ``group``, on every rank (the owners' values through the checkpoint transfer's buckets, a
    field smaller than its param in the first elements of the param's entry; TP slices
    assembled)."""
    import torch.distributed as dist

    var, rt = optimizer._variant, optimizer.dedicated_state
    tr = rt.checkpoint_transfer
    out: dict[str, dict[str, torch.Tensor]] = {}
    masters = rt.owned_masters()
    for f in var.fields:  # the stored momentum: its exact values (checkpoint dtype)
        mine = var.value_of(f.key, masters, names=rt.hook_groups.names(group))
        got = tr.to_every_rank(group, mine, owner_only=True)
        for n, t in got.items():
            shape = var.local_shapes[f.key][n]
            numel = 1
            for d in shape:
                numel *= d
            v = t.reshape(-1)[:numel].view(shape).clone()
            rule = _tp_rule(f.layout, rt.tp_layouts.get(n))
            if rule is not None:
                parts = [torch.empty_like(v) for _ in range(rt.tp_layouts[n].parts)]
                dist.all_gather(parts, v.contiguous(), group=rt.mesh_groups.tp_group)
                v = torch.cat(parts, dim=rule)
            if f is var.stored_field and var.storage is not None:  # bf16 for bf16 / 8-bit
                v = v.to(checkpoint_dtype(var.storage.dtype, v.dtype))
            out.setdefault(n, {})[f.key] = v
    return out


def local_field(rt: Any, layout: str, n: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full field value of matrix ``n`` (its TP slice's)."""
    lay = rt.tp_layouts.get(n)
    rule = _tp_rule(layout, lay)
    if rule is None:
        return full
    return full.chunk(lay.parts, dim=rule)[rt.mesh_groups.tp_index]


def stage_fields(optimizer: Any, ded: Mapping[str, Mapping[str, Any]], move: Callable, *,
                 rank0: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """Collective: ``{key: {owned name: tensor}}`` staged from the dedicated entries ``ded``
    (validated): ``"param"`` fields (full tensors or ``Shard(0)`` rows) through the checkpoint
    transfer to the owner columns (``move(group, key, part)`` -> ``{name: value}`` of this
    rank's column; ``part``: this rank's piece of a full value, ``None``: its TP slice), the
    others (full tensors on every rank) taken by their owner. ``rank0``: only rank 0 holds the
    values; the others move too (each rank's piece, 1-D, in the first elements of its matrix)."""
    var, rt = optimizer._variant, optimizer.dedicated_state
    tr = rt.checkpoint_transfer
    owned = set(rt.owned_names)
    out: dict[str, dict[str, torch.Tensor]] = {f.key: {} for f in var.fields}
    for f in var.fields:
        if f.layout == "param" or rank0:
            part = None if f.layout == "param" else \
                (lambda n, v, lay=f.layout: local_field(rt, lay, n, v).reshape(-1))
            for group in tr.each_group():
                full = move(group, f.key, part)
                for n, t in full.items():
                    if n in owned and f.layout == "param":
                        out[f.key][n] = t.clone()
                    elif n in owned:  # a smaller field: its first elements
                        live = var.field_values(f.key)[n]
                        out[f.key][n] = t.reshape(-1)[:live.numel()].view(live.shape).to(
                            dtype=live.dtype, copy=True)
            continue
        for n in rt.names:
            v = ded[n][f.key]
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            if n in owned:
                out[f.key][n] = local_field(rt, f.layout, n, v).to(
                    device=rt.device, dtype=var.field_values(f.key)[n].dtype)
    return out


def refuse_variant(optimizer: Any, what: str) -> None:
    """Raise ``NotImplementedError`` (the same on every rank: every rank builds the optimizer with
    the same ``transform``) where a path does not carry a variant's state yet."""
    if getattr(optimizer, "_variant", None) is not None:
        raise NotImplementedError(
            f"{what} does not carry the state of a dmuon.Muon(transform=...) variant yet; nothing "
            "was changed. Use Muon.state_dict() / load_state_dict (torch's protocol, DCP) or "
            "dmuon.get_optimizer_state_dict / set_optimizer_state_dict, which save and restore "
            "the variant's state by name at any topology.")
