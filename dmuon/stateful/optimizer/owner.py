"""The owners' update of ``dmuon.Muon``: :class:`OwnerDriver`, one chain of stages (default
``variants.muon()``), one state, one step for Muon and every variant, run through
:func:`~dmuon.functional.owner_step.owner_step` with the implementations the runtime chose.
Design notes: docs/design/optimizer.md, "The owner driver"."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from dmuon.functional import muon as fmuon
from dmuon.functional import state_dtype as sd
from dmuon.functional import owner_checks as oc
from dmuon.functional import transforms as T
from dmuon.functional import variants
from dmuon.functional.matrix_view import Batch
from dmuon.functional.owner_step import group_chains, lr_wd_groups, owner_step
from dmuon.functional.stages.hparams import new_step, next_step
from dmuon.functional.stages.leaves import default_views
from dmuon.functional.state_fields import check_counts, scalar_leaves, state_fields
from dmuon.functional.step_checks import check_not_broken
from dmuon.functional.tree import get_path, replace_path
from dmuon.stateful.optimizer.state_storage import StepIO, note_conversion

__all__ = ["OwnerDriver"]


def _shapes(state: Any, fields: list) -> dict[str, dict[str, tuple[int, ...]]]:
    return {f.key: {n: tuple(t.shape) for n, t in get_path(state, f.path).items()}
            for f in fields}


class OwnerDriver:
    """The owners' chain, its state, its fields and its step (see the module docstring).

    Args:
      transform: ``None`` (Muon: ``variants.muon()``), a function ``MuonHParams -> Transform`` or
        a fixed :class:`~dmuon.functional.transforms.Transform`.
      hparams: the optimizer's Muon hyper-parameters at construction.
      rt: the model's :class:`~dmuon.stateful.runtime.state.DedicatedState`.
      storage: the optimizer's momentum storage (``None`` or the identity storage: every field in
        the master's dtype on the device).

    Raises:
      TypeError, ValueError: see :mod:`dmuon.functional.owner_checks`.
    """

    def __init__(self, transform: Any, hparams: fmuon.MuonHParams, rt: Any, storage: Any = None):
        #: another chain than Muon itself (a variant, or the user's chain)
        self.custom = not oc.is_muon(transform)
        transform = variants.muon() if transform is None else transform
        oc.check_transform(transform)
        self.transform, self.fixed = transform, isinstance(transform, T.Transform)
        self.hp0 = hparams
        self.rt = rt
        chain = self.chain(hparams)
        mults = rt.matrices.hp_mults  # the policy's, per matrix (as its views)
        oc.check_chain(chain, self.fixed, mults, rt.tp_layouts)
        views = rt.matrices.views
        meta = oc.meta_state(chain, views, {n: rt.shape[n] for n in rt.names}, rt.master_dtype)
        self.fields = state_fields(meta)
        self.local_shapes = _shapes(meta, self.fields)
        oc.check_fields(self.fields, meta, rt.shape, rt.master_dtype)
        self.full_shapes = self.local_shapes
        if rt.tp_layouts:  # the single-device shapes (the full matrices, their default views)
            from dmuon.stateful.modes.tensor_parallel import full_shape
            whole = {n: (Batch(0) if n in rt.tp_layouts else v) for n, v in views.items()}
            full = oc.meta_state(chain, whole, {n: full_shape(rt, n) for n in rt.names},
                                 rt.master_dtype)
            self.full_shapes = _shapes(full, self.fields)
        #: the storage of the ``"momentum_buffer"`` field (``None``: fp32 on the device)
        self.storage = storage if storage is not None and not storage.identity else None
        self.stored_field = next((f for f in self.fields if f.key == "momentum_buffer"
                                  and f.layout == "param"), None)
        if self.storage is not None:
            oc.check_stored_field(self.stored_field, self.storage.dtype, self.storage.offload)
        self.state = self._fresh(chain, first=True)
        #: steps in which this owner updated a matrix (``muon_step``; schedules are read at it)
        self.step_count = new_step()
        owned = {n: views[n] for n in rt.owned_names}
        #: the owned matrices' views (``None``: all plain matrices) and ``(lr_mult, wd_mult)``
        self.owned_views: Optional[dict[str, Any]] = (
            owned if any(v != Batch(0) for v in owned.values()) else None)
        self.mults = {n: mults[n] for n in rt.owned_names if n in mults}
        self.broken: Optional[str] = None  # a step failed part-way: its error, until a load
        #: the groups' chains and the key (fmuon.hparams_key) of the hyper-parameters they were
        #: built from: a variant's built again only when a value changes (a scheduler's lr)
        self.groups = list(lr_wd_groups(list(rt.owned_names), self.mults) or {(1.0, 1.0): []})
        self._built: tuple[Any, Any] = (None, None)

    def _fresh(self, chain: T.Transform, first: bool = False) -> Any:
        """The chain's state before the first step, its momentum as stored (encoded;
        offloaded)."""
        with default_views(self.rt.matrices.views):
            state = chain.init(self.rt.owned_masters())
        check_counts(state, "dmuon.Muon(transform=...)")
        if self.storage is None:
            return state
        fresh = dict(get_path(state, self.stored_field.path))
        return replace_path(state, self.stored_field.path, self.storage.store(fresh) if first
                            else self.storage.load(fresh, str(self.storage.dtype), "reset"))

    def reset(self) -> None:
        """Back to the state before the first step (a load whose dedicated section is empty:
        a checkpoint taken before the first step)."""
        self.state = self._fresh(self.chain(self.hp0))

    def chain(self, hparams: fmuon.MuonHParams) -> T.Transform:
        """The chain for ``hparams`` (a fixed Transform: itself)."""
        chain = self.transform if self.fixed else self.transform(hparams)
        oc.check_built_chain(chain)
        return chain

    # ------------------------------------------------------------------ step
    def step(self, grads: dict, params: dict, hparams: fmuon.MuonHParams, *,
             orthogonalizer: Callable[[Any], Any], elementwise: Any = None,
             sum_hook: Optional[Callable] = None, committed: Sequence[str] = ()) -> list[str]:
        """One step of the chain on this rank's owned matrices (donated); returns the names
        stepped (those with a gradient, and ``committed``: updated ahead by a speculation whose
        result the caller committed). ``orthogonalizer(spec, names)``: the NS each
        ``orthogonalize`` stage runs (the optimizer's, behind TP's gathers or split NS);
        ``elementwise``: fused momentum / apply implementations; ``sum_hook``: TP's partial
        sums. Runs on every rank every step (a chain's counts advance alike everywhere)."""
        if self.fixed:
            oc.check_fixed_hparams(hparams, self.hp0)
        stepped = [n for n, g in grads.items() if g is not None] + list(committed)
        io = None
        if self.storage is not None and stepped:  # the stored momentum, chunk by chunk
            io = StepIO(self.storage, self.stored_momentum(), params)
        _, self.state = self.run(grads, self.state, params, hparams, orthogonalizer=orthogonalizer,
                                 elementwise=elementwise, sum_hook=sum_hook, momentum_io=io)
        if stepped:
            self.step_count = next_step(self.step_count)
        return stepped

    def run(self, grads: dict, state: Any, params: dict, hparams: fmuon.MuonHParams, *,
            donate_grads: bool = True, **hooks: Any) -> tuple[dict, Any]:
        """The chain's update of ``params`` (donated) and ``state`` at this step: ``(new params,
        new state)`` (:meth:`step` on the live ones; a speculation on its copies, with
        ``donate_grads=False``: the gradients it reads are the live ones)."""
        return owner_step(
            grads, state, params,
            self.transform if self.fixed else self._chains(fmuon.at_step(hparams, self.step_count)),
            views=self.owned_views,
            mults=None if self.fixed else self.mults, donate=True, donate_grads=donate_grads,
            orthogonalizer_for=hooks.pop("orthogonalizer"), **hooks)

    def _chains(self, hparams: fmuon.MuonHParams) -> dict:
        key = fmuon.hparams_key(hparams) if isinstance(self.transform, variants.Variant) else None
        if key is None or key != self._built[0]:
            self._built = (key, group_chains(self.transform, hparams, self.groups))
        return self._built[1]

    # ------------------------------------------------------------------ fields
    def stored_momentum(self) -> dict[str, torch.Tensor]:
        """``{owned name: tensor}`` of the ``"momentum_buffer"`` field as stored (``{}``: no
        momentum stage)."""
        f = self.stored_field
        return {} if f is None else dict(get_path(self.state, f.path))

    def field_values(self, key: str) -> dict[str, torch.Tensor]:
        """``{owned name: tensor}`` of field ``key`` (the live buffers)."""
        f = next(f for f in self.fields if f.key == key)
        return dict(get_path(self.state, f.path))

    def value_of(self, key: str, masters: Mapping[str, torch.Tensor], *, view: bool = False,
                 names: Optional[Any] = None) -> dict[str, torch.Tensor]:
        """``{owned name: value}`` of field ``key``: the live buffers, except the stored momentum
        (``momentum_dtype`` / ``offload_state``), which is given exactly in its checkpoint dtype
        on the device (:meth:`MomentumStorage.values`); ``view=True`` (``optimizer.state``): the
        stored tensors themselves unless they hold an 8-bit float's data (then a decoded copy, an
        inference tensor: a write to it raises). ``names``: only those."""
        f, st = self.stored_field, self.storage
        check_not_broken(None if view else self.broken, "dmuon: a checkpoint of the optimizer")
        stored = st is not None and f is not None and key == f.key
        if stored and view and not sd.is_scaled(st.dtype):
            st.copies.synchronize()  # the stored tensors themselves
            stored = False
        vals = self.field_values(key)
        vals = vals if names is None else {n: vals[n] for n in names if n in vals}
        if not stored:
            return vals
        with torch.inference_mode(view):
            return st.values(vals, masters)

    def scalars(self) -> list[float]:
        """The chain state's counts (non-per-param tensors), as Python numbers."""
        check_counts(self.state, "the optimizer's state dict")
        return [float(t) for t in scalar_leaves(self.state, self.fields)]

    def load(self, values: Mapping[str, Mapping[str, torch.Tensor]],
             scalars: Optional[list], saved_dtype: Optional[str] = None,
             what: str = "load") -> None:
        """Install staged ``{key: {owned name: tensor}}`` and counts (copies into the buffers;
        the stored momentum re-stored from its values, converted from ``saved_dtype``, the
        checkpoint's ``momentum_dtype``, with a logged note when it differs). A stored momentum
        given for some owned matrices keeps its current values for the others."""
        for f in self.fields:
            got = values.get(f.key, {})
            if f is self.stored_field and self.storage is not None and got:
                stored = self.stored_momentum()
                kept = self.storage.values({n: t for n, t in stored.items() if n not in got},
                                           self.rt.owned_masters())
                work = {n: (got[n] if n in got else kept[n]).to(dtype=self.rt.master_dtype[n],
                                                                copy=True) for n in stored}
                self.state = replace_path(self.state, f.path,
                                          self.storage.load(work, saved_dtype, what))
                continue
            if f is self.stored_field and got:  # the default storage: converted as it copies in
                note_conversion(saved_dtype, torch.float32, what)
            live = get_path(self.state, f.path)
            for n, t in got.items():
                live[n].copy_(t)
        if scalars is not None:
            ts = scalar_leaves(self.state, self.fields)
            if len(ts) != len(scalars):
                raise ValueError(f"owner state counts: {len(scalars)} saved, {len(ts)} expected")
            for t, v in zip(ts, scalars):
                t.fill_(v)
