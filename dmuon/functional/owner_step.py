"""One owner's update of the matrices it owns, from their averaged gradients: Muon
(:func:`dmuon.functional.muon.update`, with the policy's matrix views and ``(lr_mult, wd_mult)``
groups) or any :class:`~dmuon.functional.transforms.Transform` chain.

``dmuon.Muon.step`` runs it on every owner (donating, with its NS engine and fused stages);
``verify_step``'s reference and the pure distributed step (:mod:`dmuon.functional.step`) run it on
gathered or simulated trees: one function, so the distributed update and its references cannot
drift apart.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from torch import Tensor

from dmuon.functional import muon as fmuon
from dmuon.functional import transforms as T
from dmuon.functional.stages.hparams import next_step

__all__ = ["owner_step", "lr_wd_groups", "Update"]

Update = Any  # fmuon.MuonHParams | T.Transform


def lr_wd_groups(names: Sequence[str], mults: Optional[Mapping[str, tuple[float, float]]]
                 ) -> dict[tuple[float, float], list[str]]:
    """``names`` grouped by their ``(lr_mult, wd_mult)`` (``(1, 1)`` when absent), in order."""
    groups: dict[tuple[float, float], list[str]] = {}
    for n in names:
        groups.setdefault(tuple((mults or {}).get(n, (1.0, 1.0))), []).append(n)
    return groups


def owner_step(grads: Mapping[str, Optional[Tensor]], state: Any, params: Mapping[str, Tensor],
               update: Update = fmuon.MuonHParams(), *,
               views: Optional[Mapping[str, Any]] = None,
               mults: Optional[Mapping[str, tuple[float, float]]] = None,
               **update_kwargs: Any) -> tuple[dict[str, Tensor], Any]:
    """One owner's update of the matrices it owns.

    Args:
      grads: ``{name: averaged gradient or None}`` (None: skipped, params and state unchanged).
      state: a :class:`~dmuon.functional.muon.MuonState` for ``params`` (``None``: a fresh one),
        or the chain's state when ``update`` is a Transform.
      params: ``{name: master}``.
      update: :class:`~dmuon.functional.muon.MuonHParams` (Muon, the fused donating update), or a
        :class:`~dmuon.functional.transforms.Transform` (any chain, applied with
        :func:`~dmuon.functional.transforms.apply_updates`).
      views: ``{name: matrix view}`` (Muon; absent: the matrix itself).
      mults: ``{name: (lr_mult, wd_mult)}`` of the per-param policy (Muon): one
        :func:`~dmuon.functional.muon.update` per distinct pair, with ``lr·lr_mult`` and
        ``weight_decay·wd_mult``; the state's ``step`` advances once.
      **update_kwargs: passed to :func:`~dmuon.functional.muon.update` (``donate``,
        ``donate_grads``, ``orthogonalize``, ``elementwise``); ``orthogonalize_for(params,
        grads)`` instead of ``orthogonalize``: the orthogonalizer of each update's sub-trees
        (one that must know which matrices its inputs are, e.g. tensor parallelism's gathers).

    Returns:
      ``(new params, new state)``.
    """
    params = dict(params)
    grads = {n: grads.get(n) for n in params}
    if isinstance(update, T.Transform):
        if mults and any(m != (1.0, 1.0) for m in mults.values()):
            raise ValueError("owner_step: lr / wd multipliers apply to Muon's hyper-parameters; "
                             "a Transform chain carries its own learning rate")
        if state is None:
            state = update.init(params)
        updates, state = update.update(grads, state, params)
        return T.apply_updates(params, updates), state
    if not isinstance(update, fmuon.MuonHParams):
        raise TypeError(f"owner_step: update must be a MuonHParams or a Transform, got "
                        f"{type(update).__name__}")
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


def _views(views: Optional[Mapping[str, Any]], params: Mapping[str, Tensor]) -> Optional[dict]:
    if not views:
        return None
    got = {n: views[n] for n in params if n in views}
    return got or None
