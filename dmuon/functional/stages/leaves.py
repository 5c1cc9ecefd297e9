"""The leaves of one update, as flat lists that stages transform in place (pure data + plumbing).

A stage's arithmetic is written once, as an in-place operation ``update_(leaves, state)`` over a
:class:`Leaves`: the params that have an update this step (the *active* leaves, in the params' leaf
order) and, per leaf, the running update. The optax form ``update(updates, state, params)`` of a
stage is derived from it (:func:`derive_update`: copies first, so no input changes), and
``dmuon.functional.muon.update`` / ``adamw.update`` run the same ``update_`` on donated buffers.

What a :class:`Leaves` holds per active leaf ``k``:

* ``params[k]`` -- ``W``; only an *applying* stage writes it (``dmuon.functional.stages.decoupled``),
  into a copy unless ``donate``;
* the update ``u = (scale[k] / divisor[k]) · updates[k] / denom[k]``: a tensor numerator, and scalars
  and a tensor denominator (Adam's ``sqrt(v̂) + ε``) left *pending* so that the applying stage folds
  them into one fused ``p + α·N`` or ``p + α·N/D`` (``α = −lr·scale/divisor``), the rounding of
  ``torch.optim``; :meth:`Leaves.materialize` multiplies them out where a stage needs the values;
* ``scratch[k]``: ``updates[k]``'s storage is this update's to overwrite (a fresh tensor, a
  converted copy, or a donated gradient); ``spare[k]``: storage a stage freed (a donated gradient
  no longer needed) that a later stage may fill instead of allocating.

States: a stage state (a NamedTuple) names its per-param fields in ``per_param``. Before ``update_``
runs, :func:`run_inplace` *opens* the state: each per-param pytree becomes the list of the active
leaves' buffers (copies unless ``donate``), which ``update_`` changes in place (it never replaces
them) and returns with its other fields (e.g. a step count) advanced; closing puts the buffers
back into the trees. Opened states slice per group of leaves, so a chain can run per device and
dtype (what foreach lists and fused kernels take).

A stage written in the optax form only (no ``update_``) runs in such a chain out of place:
:func:`derive_update_` (the inverse of :func:`derive_update`) gives it an in-place form that
calls its ``update`` on flat dicts of the active leaves; :func:`in_place_form` attaches it.

Ops: stages call list ops through ``leaves.ops``: :data:`FOREACH` (``torch._foreach_*``) or
:data:`PER_TENSOR` (the same in-place tensor methods one tensor at a time): two executions of
one formula. Inside ``torch.vmap`` (whose batching rules do not cover ``torch._foreach_*``) the
leaves use :data:`PER_TENSOR`.

What the caller who runs a chain may add (the owner of distributed matrices does;
:func:`dmuon.functional.owner_step.owner_step`): ``default_views`` (the matrix view of each leaf
where a stage names none), ``orthogonalizer_for(spec, names) -> xs -> us`` (the orthogonalizer
an ``orthogonalize`` stage runs instead of its own: an NS engine, or tensor parallelism's gathers
around it) and ``sum_hook(names, partials, dims)`` (adds each matrix's partial sums over the
owners of its slices; :meth:`Leaves.sum_partials`); ``elementwise`` (implementations of the
momentum and applying stages, :class:`dmuon.functional.muon.MuonElementwise`: fused kernels, used
by stages built without an ``impl`` of their own) and ``momentum_io`` (the
:class:`~dmuon.functional.stages.momentum.MomentumIO` of the stored momentum: the momentum stage
whose buffers it holds reads and writes them through it, chunk by chunk).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence

import optree
import torch
from torch import Tensor

from dmuon.functional.matrix_view import views_per_leaf
from dmuon.functional.stages.hparams import is_batched, is_one
from dmuon.functional.tree import PyTree, flatten, flatten_like, leaf_paths

__all__ = ["Leaves", "FOREACH", "PER_TENSOR", "derive_update", "derive_update_", "in_place_form",
           "run_inplace", "apply_inplace_",
           "default_views", "init_views"]

#: ``{leaf path: matrix view}`` that stage ``init`` s use where the stage names no view
_INIT_VIEWS: contextvars.ContextVar = contextvars.ContextVar("dmuon_init_views", default=None)


@contextlib.contextmanager
def default_views(views: Optional[Mapping[str, Any]]) -> Iterator[None]:
    """Within the block, a stage's ``init`` that names no view (``view=None, batch_dims=None``)
    sees each param through ``views[path]`` (the owner's policy views; missing: ``Batch(0)``):
    the ``init`` counterpart of ``Leaves(default_views=...)``, for states whose shape depends on
    the view (NorMuon's per-row second moment)."""
    token = _INIT_VIEWS.set(None if views is None else dict(views))
    try:
        yield
    finally:
        _INIT_VIEWS.reset(token)


def init_views(view: Any, batch_dims: Any, params: PyTree) -> list:
    """The matrix view of every leaf of ``params`` for a stage's ``init``: ``view=`` /
    ``batch_dims=`` as ``muon.update``'s, else the :func:`default_views` in effect."""
    treedef = flatten(params)[1]
    if view is None and batch_dims is None and not torch.compiler.is_compiling():
        given = _INIT_VIEWS.get()
        if given:
            names = set(leaf_paths(params))
            view = {n: v for n, v in given.items() if n in names} or None
    return views_per_leaf(view, batch_dims, params, treedef)


def _per_tensor(method: str) -> Callable[..., Any]:
    def op(xs: list[Tensor], *args: Any, **kwargs: Any) -> list[Tensor]:
        return [getattr(x, method)(*[a[k] if isinstance(a, list) else a for a in args], **kwargs)
                for k, x in enumerate(xs)]
    return op


class ListOps(NamedTuple):
    """The list ops stages call (``ops.mul_(xs, s)``, ...): one implementation of each."""

    mul_: Callable
    add_: Callable
    lerp_: Callable
    addcmul_: Callable
    addcdiv_: Callable
    div_: Callable
    sqrt: Callable
    mul: Callable


_OPS = ListOps._fields

#: List ops as ``torch._foreach_*`` calls (one launch per list on CUDA).
FOREACH = ListOps(**{o: getattr(torch, f"_foreach_{o}") for o in _OPS})
#: The same ops one tensor at a time (``x.mul_(s)``, ...): ``torch.optim``'s single-tensor path.
PER_TENSOR = ListOps(**{o: _per_tensor(o) for o in _OPS})

_LISTS = ("params", "updates", "scratch", "spare", "scale", "divisor", "denom", "index")


class Leaves:
    """The active leaves of one update (see the module docstring).

    Args:
        params: the params pytree.
        updates: a pytree with the params' structure; ``None`` leaves are inactive.
        donate: params and state buffers may be written in place (else stages write copies).
        donate_updates: updates of the param's dtype whose storage is contiguous may be
            overwritten (converted copies always may).
        ops: :data:`FOREACH` or :data:`PER_TENSOR`.
        what: the name of ``updates`` in structure errors.
        names: the params' leaf path names, if the caller has them.
        default_views: the matrix view of every leaf (params' leaf order) for stages that name
            none (``None``: ``Batch(0)``).
        orthogonalizer_for, sum_hook, elementwise, momentum_io: see the module docstring.
    """

    def __init__(self, params: PyTree, updates: PyTree, *, donate: bool = False,
                 donate_updates: bool = False, ops: Any = FOREACH, what: str = "updates",
                 names: Optional[list[str]] = None, default_views: Optional[list] = None,
                 orthogonalizer_for: Optional[Callable] = None,
                 sum_hook: Optional[Callable] = None, elementwise: Any = None,
                 momentum_io: Any = None):
        self.all_params, self._treedef = flatten(params)
        self.tree = params
        u_all = flatten_like(self.treedef, updates, what)
        self.index = [i for i, u in enumerate(u_all) if u is not None]
        self.params = [self.all_params[i] for i in self.index]
        self.updates = [u_all[i].to(dtype=p.dtype) for i, p in zip(self.index, self.params)]
        self.scratch = [u is not u_all[i] or (donate_updates and u.is_contiguous())
                        for i, u in zip(self.index, self.updates)]
        n = len(self.index)
        self.spare: list[Optional[Tensor]] = [None] * n
        self.scale = [1.0] * n
        self.divisor = [1.0] * n
        self.denom: list[Optional[Tensor]] = [None] * n
        if ops is FOREACH and any(is_batched(t) for t in self.params[:1] + self.updates[:1]):
            ops = PER_TENSOR  # vmap has no batching rules for torch._foreach_* (O(1) check)
        self.donate, self.ops, self.applied = donate, ops, False
        self._names = names
        self._views: dict = {}
        self.default_views = default_views
        self.orthogonalizer_for, self.sum_hook = orthogonalizer_for, sum_hook
        self.elementwise, self.momentum_io = elementwise, momentum_io

    def __len__(self) -> int:
        return len(self.index)

    @property
    def treedef(self) -> Any:
        """optree's spec of the params. A :class:`Leaves` built while ``torch.compile`` traces
        holds dynamo's Python stand-in for it; if a graph break hands the object to code that runs
        eagerly (the resumed frame past dynamo's recompile limit), the stand-in's dict metadata
        is not what optree's own unflatten reads (``length mismatch: [2, 1]``), so eager code
        gets a spec of ``tree`` made eagerly."""
        if not torch.compiler.is_compiling() and not isinstance(self._treedef, optree.PyTreeSpec):
            self._treedef = flatten(self.tree)[1]
        return self._treedef

    @property
    def names(self) -> list[str]:
        """Path names of the active leaves."""
        if self._names is None:
            self._names = leaf_paths(self.tree)
        return [self._names[i] for i in self.index]

    def all_views(self, view: Any, batch_dims: Any, given: Optional[list] = None) -> list:
        """The matrix view of every leaf (``view=`` / ``batch_dims=`` as ``muon.update``'s),
        computed once per spelling (``given``: already computed by the caller)."""
        if view is None and batch_dims is None and self.default_views is not None \
                and given is None:
            return self.default_views
        key = (id(view), id(batch_dims))
        if key not in self._views:
            vs = given if given is not None else views_per_leaf(view, batch_dims, self.tree,
                                                                self.treedef)
            self._views[key] = (view, batch_dims, vs)  # keeps the keys' objects alive
        return self._views[key][2]

    def views(self, view: Any, batch_dims: Any) -> list:
        """The matrix views of the active leaves."""
        vs = self.all_views(view, batch_dims)
        return [vs[i] for i in self.index]

    def materialize(self, ks: Optional[Sequence[int]] = None) -> None:
        """Multiply out the pending scalars and denominator: ``u = N·scale / divisor / D``."""
        for k in range(len(self)) if ks is None else ks:
            u, c, d, den = self.updates[k], self.scale[k], self.divisor[k], self.denom[k]
            if is_one(c) and is_one(d) and den is None:
                continue
            if not is_one(c):
                u = u * c
            if not is_one(d):
                u = u / d
            if den is not None:
                u = u / den
            self.updates[k], self.scratch[k] = u, True
            self.scale[k], self.divisor[k], self.denom[k] = 1.0, 1.0, None

    def momentum_io_of(self, buffers: Sequence[Tensor]) -> Any:
        """The caller's ``momentum_io`` if it stores exactly ``buffers`` (the active leaves'
        momentum buffers of one stage), else ``None``: the io serves the one momentum stage whose
        state holds its stored tensors, never a second one."""
        io = self.momentum_io
        return io if io is not None and io.holds(self.names, buffers) else None

    def sum_partials(self, partials: list[Tensor], dims: tuple[int, ...]) -> list[Tensor]:
        """Per active leaf ``k``, ``partials[k]`` holds sums of ``k``'s view blocks ``(B, m, n)``
        over the block dims ``dims`` (``(-1,)``: per row; ``(-2, -1)``: per matrix; ``(-2,)``: of
        per-row values over the rows) of the part of each matrix this caller holds. Returns the
        sums over the whole matrices: the partials themselves, unless a ``sum_hook`` adds those
        of the other holders (a tensor-parallel slice's owners; a collective: every holder of the
        matrices calls it in the same order)."""
        if self.sum_hook is None:
            return list(partials)
        return list(self.sum_hook(self.names, list(partials), tuple(dims)))

    def written_params(self) -> list[Tensor]:
        """The params an applying stage writes: themselves when donated, else copies."""
        return self.params if self.donate else [p.clone() for p in self.params]

    def select(self, ks: Sequence[int]) -> "Leaves":
        """The leaves ``ks`` alone (lists sliced; the tree, views and options shared)."""
        sub = object.__new__(Leaves)
        sub.__dict__.update(self.__dict__)
        for f in _LISTS:
            setattr(sub, f, [getattr(self, f)[k] for k in ks])
        return sub

    def absorb(self, sub: "Leaves", ks: Sequence[int]) -> None:
        """Take back what a stage did on ``self.select(ks)``."""
        for f in _LISTS:
            mine, theirs = getattr(self, f), getattr(sub, f)
            for j, k in enumerate(ks):
                mine[k] = theirs[j]
        self.applied = sub.applied

    # -- results ---------------------------------------------------------------------------------
    def params_tree(self) -> PyTree:
        """The params pytree after the update (inactive leaves: the input objects)."""
        out = list(self.all_params)
        for k, i in enumerate(self.index):
            out[i] = self.params[k]
        return self.treedef.unflatten(out)

    def updates_tree(self) -> PyTree:
        """The (materialized) updates in the params' dtypes; ``None`` where inactive."""
        self.materialize()
        out: list[Any] = [None] * self.treedef.num_leaves
        for k, i in enumerate(self.index):
            out[i] = self.updates[k].to(dtype=self.params[k].dtype)
        return self.treedef.unflatten(out)

    # -- states ----------------------------------------------------------------------------------
    def open(self, state: Any) -> Any:
        """``state`` with each per-param pytree replaced by the active leaves' buffers."""
        def take(tree: PyTree) -> list[Tensor]:
            flat = flatten_like(self.treedef, tree, "state")
            return [flat[i] if self.donate else flat[i].clone() for i in self.index]
        return _walk(state, lambda tree, *_: take(tree), lambda v, *_: v)

    def close(self, state: Any, opened: Any, result: Any) -> Any:
        """The new state: ``opened``'s buffers put back into ``state``'s trees, the other fields
        from ``result`` (what ``update_`` returned)."""
        def put(tree: PyTree, bufs: list[Tensor], _: Any) -> PyTree:
            flat = list(flatten_like(self.treedef, tree, "state"))
            for k, i in enumerate(self.index):
                flat[i] = bufs[k]
            return self.treedef.unflatten(flat)
        return _walk(state, put, lambda v, o, r: r, opened, result)


def _walk(state: Any, on_param: Callable, on_other: Callable, *others: Any) -> Any:
    """Map a (nested) stage state: ``on_param`` on its per-param fields (those its type names in
    ``per_param``), ``on_other`` on everything else; NamedTuples and tuples of states are walked
    (``others``: states of the same layout, walked alongside)."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        per = getattr(type(state), "per_param", ())
        fields = []
        for name, v in zip(state._fields, state):
            os_ = [getattr(o, name) for o in others]
            fields.append(on_param(v, *os_) if name in per
                          else _walk(v, on_param, on_other, *os_))
        return type(state)(*fields)
    if type(state) is tuple:
        return tuple(_walk(s, on_param, on_other, *[o[j] for o in others])
                     for j, s in enumerate(state))
    return on_other(state, *others)


def _slice(opened: Any, ks: Sequence[int]) -> Any:
    return _walk(opened, lambda bufs: [bufs[k] for k in ks], lambda v: v)


def apply_inplace_(leaves: Leaves) -> None:
    """``W ← W + u`` (optax's :func:`~dmuon.functional.transforms.apply_updates`, in place on the
    written params) for a chain that ends without an applying stage."""
    leaves.materialize()
    ps = leaves.written_params()
    if ps:
        leaves.ops.add_(ps, [u.to(dtype=p.dtype) for u, p in zip(leaves.updates, ps)])
    leaves.params, leaves.applied = ps, True


def run_inplace(transform: Any, leaves: Leaves, state: Any,
                groups: Optional[Sequence[Sequence[int]]] = None,
                transforms: Optional[Sequence[Any]] = None) -> Any:
    """Run ``transform.update_`` on ``leaves`` (all at once, or per group of leaf positions,
    ``transforms[i]`` on group ``i`` where given) and apply the result; returns the new state.
    Afterwards ``leaves.params_tree()`` is the update. With groups, the state's fields that are
    not per param (counts) are those the last group returned (every group starts from the same).
    A transform without ``update_`` (the optax form only) runs out of place: :func:`in_place_form`."""
    if transforms is None:
        transform = in_place_form(transform)  # an optax-form transform: run out of place
    else:
        transforms = [in_place_form(t) for t in transforms]
    opened = leaves.open(state)
    with _unbatched_under_vmap(leaves, opened):
        if not groups:
            result = transform.update_(leaves, opened)
        else:
            for i, ks in enumerate(groups):
                sub = leaves.select(ks)
                t = transform if transforms is None else transforms[i]
                result = t.update_(sub, _slice(opened, ks))
                if not sub.applied:
                    apply_inplace_(sub)
                leaves.absorb(sub, ks)
        if not leaves.applied:
            apply_inplace_(leaves)
    return leaves.close(state, opened, result)


@contextlib.contextmanager
def _unbatched_under_vmap(leaves: Leaves, opened: Any) -> Iterator[None]:
    """Inside ``torch.vmap``, an error of the stages' in-place writes where a param or state
    buffer is not batched (a sweep over lrs with the params closed over, or passed with
    ``in_dims=None``) becomes a ``ValueError`` that says to give them the batch dim: a batched
    value (the lr's, a gradient's) cannot be written into an unbatched tensor."""
    try:
        yield
    except RuntimeError as err:
        if torch._C._functorch.maybe_current_level() is None:
            raise
        bufs: list = []
        _walk(opened, lambda b: bufs.extend(b), lambda v: v)
        names = [n for n, p in zip(leaves.names, leaves.params) if not is_batched(p)]
        if not names and all(is_batched(b) for b in bufs):
            raise
        what = (f"the params {names[:4]}{' ...' if len(names) > 4 else ''}" if names
                else "the optimizer state's buffers")
        raise ValueError(
            f"dmuon under torch.vmap: {what} are not batched while a hyper-parameter or a "
            "gradient is, and the update writes params and state in place (vmap cannot write a "
            "batched value into an unbatched tensor). Give the params and the state the batch "
            "dim and vmap over them too: params = optree.tree_map(lambda p: p.expand(n, "
            "*p.shape).clone(), params), state = init(params) of those (or expand the state the "
            f"same way), then torch.vmap(step, in_dims=(0, 0, 0, ...)). torch said: {err}"
        ) from err


def derive_update(update_: Callable[[Leaves, Any], Any]) -> Callable[..., tuple[PyTree, Any]]:
    """The optax form ``update(updates, state, params) -> (updates, state)`` of an in-place stage:
    the same ``update_`` on copies (nothing the caller holds is written); an applying stage's
    additive update is ``W' − W``."""
    def update(updates: PyTree, state: Any, params: PyTree) -> tuple[PyTree, Any]:
        leaves = Leaves(params, updates)
        before = list(leaves.params)
        opened = leaves.open(state)
        with _unbatched_under_vmap(leaves, opened):
            result = update_(leaves, opened)
        if leaves.applied:  # an applying stage wrote (copies of) the params: W' − W
            leaves.updates = [new - old for new, old in zip(leaves.params, before)]
            leaves.scale = [1.0] * len(leaves)
            leaves.divisor, leaves.denom = [1.0] * len(leaves), [None] * len(leaves)
        return leaves.updates_tree(), leaves.close(state, opened, result)
    return update


def _shares(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` may share storage (one may be a view of the other); under
    ``torch.vmap`` (no storage to compare) assumed."""
    if is_batched(a) or is_batched(b):
        return True
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


#: Why a stage written in the optax form only cannot follow an applying stage in place.
AFTER_APPLYING = (
    "a stage written in the optax form only (no in-place update_) comes after a stage that has "
    "applied the step to the weights (decoupled_apply, hyperball_apply), which the in-place run "
    "cannot undo. Put it before that stage, or end the chain as optax chains end "
    "(T.add_decayed_weights(wd), T.scale_by_learning_rate(lr)): the run then adds the final "
    "update to the weights")


def refused_update_(reason: str) -> Callable[[Leaves, Any], Any]:
    """An in-place form that raises ``ValueError(reason)`` before any stage runs (a chain whose
    in-place run would fail part way, :func:`~dmuon.functional.transforms.chain`); ``reason``
    is its ``refused`` attribute, which :func:`in_place_refusal` reads when the optimizer is
    built."""
    def update_(leaves: Leaves, state: Any) -> Any:
        raise ValueError(reason)
    update_.refused = reason  # type: ignore[attr-defined]
    return update_


def in_place_refusal(transform: Any) -> Optional[str]:
    """Why ``transform``'s in-place form refuses to run (:func:`refused_update_`), or ``None``."""
    return getattr(transform.update_, "refused", None)


def derive_update_(update: Callable[..., tuple[PyTree, Any]]) -> Callable[[Leaves, Any], Any]:
    """The in-place form of a stage written in the optax form only (``update(updates, state,
    params) -> (updates, state)``): run out of place on the active leaves, its results put back.

    The stage sees flat ``{path name: leaf}`` dicts of the leaves that have an update this step
    (as :func:`~dmuon.functional.transforms.partition`'s inner transforms do; none at all on an
    owner of nothing), with the pending scalars multiplied out; its state's per-param fields
    (named in the state type's ``per_param``) as ``{path name: buffer}`` dicts of those leaves,
    its other fields as they are. The updates it returns replace the leaves' (in the params'
    dtypes); the per-param values it returns are copied into the buffers (so a donated state keeps
    its tensors, as after any stage). It cannot follow a stage that has applied the step to the
    params (``decoupled_apply``, ``hyperball_apply``): raises ``ValueError``."""
    def update_(leaves: Leaves, state: Any) -> Any:
        if leaves.applied:
            raise ValueError(AFTER_APPLYING)
        leaves.materialize()
        names = leaves.names
        given = _walk(state, lambda bufs: dict(zip(names, bufs)), lambda v: v)
        with torch.no_grad():
            ups, new = update(dict(zip(names, leaves.updates)), given,
                              dict(zip(names, leaves.params)))
        if not isinstance(ups, Mapping) or any(ups.get(n) is None for n in names):
            raise TypeError(
                f"an optax-form stage's update returned {type(ups).__name__} updates without a "
                f"tensor for each of {names[:4]}; in an in-place run it is given flat "
                "{path name: update} dicts of the leaves with an update, and must return one "
                "update for each")
        held: list[Tensor] = []  # the state's buffers: a later stage must not write them
        _walk(state, lambda bufs: held.extend(bufs), lambda v: v)
        for k, n in enumerate(names):
            old, p = leaves.updates[k], leaves.params[k]
            if not isinstance(ups[n], Tensor) or ups[n].shape != old.shape:
                raise ValueError(
                    f"an optax-form stage's update for {n!r} has shape "
                    f"{tuple(getattr(ups[n], 'shape', ()))}, its update's is {tuple(old.shape)}: "
                    "return one update of the update's shape per leaf (a broadcasting shape "
                    "would move every row alike)")
            u = ups[n].to(dtype=p.dtype)
            if _shares(u, p) or any(_shares(u, b) for b in held):  # (nor a param, through u)
                u = u.clone()
            leaves.scratch[k] = leaves.scratch[k] if _shares(u, old) else True
            leaves.updates[k] = u

        def put(tree: Any, bufs: list[Tensor]) -> list[Tensor]:
            if not isinstance(tree, Mapping) or any(n not in tree for n in names):
                raise TypeError(
                    "an optax-form stage's per-param state field must come back as a "
                    f"{{path name: tensor}} dict of the leaves it was given, got "
                    f"{type(tree).__name__}")
            for b, n in zip(bufs, names):
                if tree[n] is not b:
                    b.copy_(tree[n])
            return bufs
        return _walk(new, put, lambda v, *_: v, state)
    return update_


def in_place_form(transform: Any) -> Any:
    """``transform`` with an in-place form: itself when it has one, else the same transform with
    :func:`derive_update_` of its ``update`` as ``update_``, needing ``"whole_matrix"`` (it sees
    each param whole, so it cannot run on a tensor-parallel slice)."""
    if transform.update_ is not None:
        return transform
    needs = tuple(dict.fromkeys(tuple(transform.needs) + ("whole_matrix",)))
    return transform._replace(update_=derive_update_(transform.update), needs=needs)
