"""One owner's update of the matrices it owns, from their averaged gradients: Muon
(:func:`dmuon.functional.muon.update`, with the policy's matrix views and ``(lr_mult, wd_mult)``
groups) or any chain of stages (a :class:`~dmuon.functional.transforms.Transform`, or a function
``hparams -> Transform`` such as :mod:`dmuon.functional.variants`' NorMuon), run in place with the
owner's views and hooks.

``dmuon.Muon.step`` runs it on every owner (donating, with its NS engine and fused stages);
``verify_step``'s reference and the pure distributed step (:mod:`dmuon.functional.step`) run it on
gathered or simulated trees: one function, so the distributed update and its references cannot
drift apart.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

from torch import Tensor

from dmuon.functional import muon as fmuon
from dmuon.functional import transforms as T
from dmuon.functional.matrix_view import Batch
from dmuon.functional.stages.hparams import is_schedule, next_step
from dmuon.functional.stages.leaves import Leaves, default_views, run_inplace
from dmuon.functional.tree import leaf_paths

__all__ = ["owner_step", "lr_wd_groups", "group_chains", "GroupChains", "Update"]

Update = Any  # fmuon.MuonHParams | T.Transform


def lr_wd_groups(names: Sequence[str], mults: Optional[Mapping[str, tuple[float, float]]]
                 ) -> dict[tuple[float, float], list[str]]:
    """``names`` grouped by their ``(lr_mult, wd_mult)`` (``(1, 1)`` when absent), in order."""
    groups: dict[tuple[float, float], list[str]] = {}
    for n in names:
        groups.setdefault(tuple((mults or {}).get(n, (1.0, 1.0))), []).append(n)
    return groups


def owner_step(grads: Mapping[str, Optional[Tensor]], state: Any, params: Mapping[str, Tensor],
               update: Update = fmuon.MuonHParams(), *, transform: Any = None,
               views: Optional[Mapping[str, Any]] = None,
               mults: Optional[Mapping[str, tuple[float, float]]] = None,
               **update_kwargs: Any) -> tuple[dict[str, Tensor], Any]:
    """One owner's update of the matrices it owns.

    Args:
      grads: ``{name: averaged gradient or None}`` (None: skipped, params and state unchanged).
      state: a :class:`~dmuon.functional.muon.MuonState` for ``params`` (``None``: a fresh one),
        or the chain's state when a chain runs.
      params: ``{name: master}``.
      update: :class:`~dmuon.functional.muon.MuonHParams` (Muon, the fused donating update; with
        ``transform``, the hyper-parameters the chain is built from), a
        :class:`~dmuon.functional.transforms.Transform` (a fixed chain), or the chains of the
        ``(lr_mult, wd_mult)`` groups, already built (:class:`GroupChains`).
      transform: a function ``hparams -> Transform`` (a :class:`~dmuon.functional.variants.Variant`
        or your own): the chain, built from ``update`` for each ``(lr_mult, wd_mult)`` group.
      views: ``{name: matrix view}`` (absent: the matrix itself); a chain's stages that name no
        view see these (and their ``init``, through
        :func:`~dmuon.functional.stages.leaves.default_views`).
      mults: ``{name: (lr_mult, wd_mult)}`` of the per-param policy: one update per distinct
        pair, with ``lr·lr_mult`` and ``weight_decay·wd_mult``; the state's counts advance once.
      **update_kwargs: Muon: passed to :func:`~dmuon.functional.muon.update` (``donate``,
        ``donate_grads``, ``orthogonalize``, ``elementwise``); ``orthogonalize_for(params,
        grads)`` instead of ``orthogonalize``: the orthogonalizer of each update's sub-trees
        (one that must know which matrices its inputs are, e.g. tensor parallelism's gathers).
        A chain: ``donate``, ``donate_grads``, ``orthogonalizer_for(spec, names)``,
        ``sum_hook(names, partials, dims)``, ``elementwise`` and ``momentum_io``
        (:class:`~dmuon.functional.stages.leaves.Leaves`).
        A chain runs in place (:func:`~dmuon.functional.stages.leaves.run_inplace`; a stage
        written in the optax form only runs out of place within it): without
        ``donate`` on copies, so no input changes.

    Returns:
      ``(new params, new state)``.
    """
    params = dict(params)
    grads = {n: grads.get(n) for n in params}
    if isinstance(update, (T.Transform, GroupChains)) or transform is not None:
        return _chain_step(grads, state, params, update, transform, views, mults, update_kwargs)
    if not isinstance(update, fmuon.MuonHParams):
        raise TypeError(f"owner_step: update must be a MuonHParams or a Transform, got "
                        f"{type(update).__name__} (a variant of dmuon.functional.variants goes "
                        "in transform=, with the MuonHParams as update)")
    if state is None:
        state = fmuon.init(params)
    update = fmuon.at_step(update, state.step)  # schedules: their values at this step
    ortho_for = update_kwargs.pop("orthogonalize_for", None)

    def run(g: dict, st: fmuon.MuonState, p: dict, hp: fmuon.MuonHParams):
        kw = dict(update_kwargs)
        if ortho_for is not None:
            kw["orthogonalize"] = ortho_for(p, g)
        return fmuon.update(g, st, p, hp, view=_views(views, p), **kw)

    groups = lr_wd_groups(list(params), mults)
    if len(groups) == 1 and (1.0, 1.0) in groups:
        new_p, new_s = run(grads, state, params, update)
        return dict(new_p), new_s
    new_params, momentum = dict(params), dict(state.momentum)
    for (lm, wm), names in groups.items():
        sub = fmuon.MuonState(state.step, {n: momentum[n] for n in names})
        sp, sub = run({n: grads[n] for n in names}, sub, {n: params[n] for n in names},
                      update._replace(lr=update.lr * lm, weight_decay=update.weight_decay * wm))
        new_params.update(sp)
        momentum.update(sub.momentum)
    return new_params, fmuon.MuonState(next_step(state.step), momentum)


def _scaled(v: Any, m: float) -> Any:
    """Hyper-parameter ``v`` times ``m`` (a schedule stays one)."""
    if m == 1.0:
        return v
    if is_schedule(v):
        return lambda t: v(t) * m
    return v * m


class GroupChains(dict):
    """``{(lr_mult, wd_mult): Transform}``: the chains of an owner's groups, built
    (:func:`group_chains`); :func:`owner_step` runs them as given."""


def group_chains(transform: Any, update: fmuon.MuonHParams,
                 groups: Iterable[tuple[float, float]]) -> GroupChains:
    """The chain of each ``(lr_mult, wd_mult)`` group: ``transform`` (a function ``hparams ->
    Transform``) built from ``update`` with ``lr·lr_mult`` and ``weight_decay·wd_mult``."""
    if not isinstance(update, fmuon.MuonHParams):
        raise TypeError(f"owner_step: with transform=, update must be the MuonHParams the "
                        f"chain is built from, got {type(update).__name__}")
    return GroupChains({key: transform(update._replace(
        lr=_scaled(update.lr, key[0]), weight_decay=_scaled(update.weight_decay, key[1])))
        for key in groups})


def _chain_step(grads: dict, state: Any, params: dict, update: Update, transform: Any,
                views: Optional[Mapping[str, Any]], mults: Any, kw: dict) -> tuple[dict, Any]:
    """:func:`owner_step` for a chain: in place, per ``(lr_mult, wd_mult)`` group."""
    donate, donate_grads = kw.pop("donate", False), kw.pop("donate_grads", False)
    hooks = {k: kw.pop(k, None) for k in ("orthogonalizer_for", "sum_hook", "elementwise",
                                          "momentum_io")}
    if kw:
        raise TypeError(f"owner_step: a chain takes donate, donate_grads, {sorted(hooks)}; got "
                        f"{sorted(kw)}")
    groups = lr_wd_groups(list(params), mults) or {(1.0, 1.0): []}  # (an owner of nothing)
    if isinstance(update, GroupChains):
        missing = [key for key in groups if key not in update]
        if missing:
            raise ValueError(f"owner_step: no chain given for the (lr_mult, wd_mult) groups "
                             f"{missing}: build them with group_chains(transform, hparams, groups)")
        chains = {key: update[key] for key in groups}
    elif transform is None:
        if len(groups) > 1 or (1.0, 1.0) not in groups:
            raise ValueError("owner_step: lr / wd multipliers apply to Muon's hyper-parameters; "
                             "a Transform chain carries its own learning rate (pass a function "
                             "hparams -> Transform as transform= to have them applied)")
        chains = {(1.0, 1.0): update}
    else:
        chains = group_chains(transform, update, groups)
    first = next(iter(chains.values()))
    names = leaf_paths(params)
    vs = [views.get(n, Batch(0)) for n in names] if views else None
    if state is None:
        with default_views(views):
            state = first.init(params)
    leaves = Leaves(params, grads, donate=donate, donate_updates=donate_grads, what="grads",
                    names=names, default_views=vs, **hooks)
    active = [names[i] for i in leaves.index]
    parts = [([k for k, n in enumerate(active) if n in set(ns)], chains[key])
             for key, ns in groups.items()]
    parts = [(ks, c) for ks, c in parts if ks]
    if len(parts) <= 1:
        new = run_inplace(parts[0][1] if parts else first, leaves, state)
    else:
        new = run_inplace(None, leaves, state, [ks for ks, _ in parts], [c for _, c in parts])
    return dict(leaves.params_tree()), new


def _views(views: Optional[Mapping[str, Any]], params: Mapping[str, Tensor]) -> Optional[dict]:
    if not views:
        return None
    got = {n: views[n] for n in params if n in views}
    return got or None
