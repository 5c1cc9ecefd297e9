"""Shared pieces of the user-path review tests (``test_user_paths_review*.py``): the single-device
twin of ``dmuon.Muon`` and the comparison of a distributed run's full state dict with it."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from models import make_batches, muon_predicate
from stateful_harness import HP

#: fp64 multi-step runs equal one process to this (max abs difference of any weight)
TOL = 1e-10


class RefMuon(torch.optim.Optimizer):
    """One process: ``dmuon.Muon``'s two param groups over a plain model, read at every step
    (``predicate``: the params on Muon; the rest on ``torch.optim.AdamW`` itself, whose per-param
    step counts dmuon's AdamW group keeps)."""

    def __init__(self, model: torch.nn.Module, predicate: Callable[[str, Any], bool] = muon_predicate):
        from dmuon.functional import adamw as fadamw
        from dmuon.functional import muon as fmuon
        self.fm, self.fa = fmuon, fadamw
        self.mats = {n: p for n, p in model.named_parameters() if predicate(n, p)}
        self.rest = {n: p for n, p in model.named_parameters() if n not in self.mats}
        muon = dict(lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                    weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                    ns_coefficients="polar_express", ns_eps=1e-7, ns_dtype=torch.float64,
                    lr_scale="moonlight")
        adamw = dict(lr=HP["adamw_lr"], betas=HP["adamw_betas"], eps=HP["adamw_eps"],
                     weight_decay=HP["adamw_weight_decay"])
        super().__init__([dict(params=list(self.mats.values()), name="muon", **muon),
                          dict(params=list(self.rest.values()), name="adamw", **adamw)],
                         defaults={})
        self.ms = fmuon.init({n: p.detach() for n, p in self.mats.items()})
        self.adamw = torch.optim.AdamW(list(self.rest.values()), foreach=False, **adamw) \
            if self.rest else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        g0, g1 = self.param_groups
        hp = self.fm.MuonHParams(**{k: g0[k] for k in self.fm.MuonHParams._fields})
        _, self.ms = self.fm.update({n: p.grad for n, p in self.mats.items()}, self.ms,
                                    {n: p.data for n, p in self.mats.items()}, hp, donate=True)
        if self.adamw is not None:
            self.adamw.param_groups[0].update({k: g1[k] for k in ("lr", "betas", "eps",
                                                                  "weight_decay")})
            self.adamw.step()
        return loss


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between ``a`` and ``b``: tensors, lists of numbers, or dicts
    of those with equal keys (nested)."""
    if isinstance(b, dict):
        assert set(a) == set(b), set(a) ^ set(b)
        return max(max_abs_diff(a[k], v) for k, v in b.items())
    if isinstance(b, list):
        assert len(a) == len(b), (a, b)
        return max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    return float((a - b).abs().max())


def check_path(results: list, paths: dict, key: str) -> dict:
    """Every rank's ``results[rank][key]`` (a path's ``sd`` and ``extra``) equals the path run in
    one process (``paths[key]`` without ``dist``) within ``TOL``; returns that reference."""
    ref = paths[key](dict(rank=0, world=1, dist=False))
    for rank, r in enumerate(results):
        got = r[key]
        assert "error" not in got, (key, rank, got.get("error"))
        for part in ("sd", "extra"):
            worst = max_abs_diff(got[part], ref[part])
            assert worst <= TOL, f"{key} rank {rank} {part}: max abs diff {worst:.3g}"
    return ref


def reference_run(make: Callable[[], torch.nn.Module], loop: Callable[..., Any], steps: int,
                  batch: int) -> dict:
    """``loop`` on one process with :class:`RefMuon` over ``make()``: ``{"sd", "extra"}``."""
    model = make()
    extra = loop(model, RefMuon(model), make_batches(steps, batch),
                 dict(rank=0, world=1, dist=False))
    return {"sd": {k: v.detach().clone() for k, v in model.state_dict().items()}, "extra": extra}


def assert_state_equal(results: list, key: str, ref: dict,
                       keys: Optional[Iterable[str]] = None) -> None:
    """Every rank's full state dict of path ``key`` equals ``ref["sd"]`` to :data:`TOL` (over
    ``keys`` only, when given), with the same names and no error recorded."""
    keys = None if keys is None else set(keys)
    for rank, r in enumerate(results):
        got = r[key]
        assert "error" not in got, (key, rank, got.get("error"))
        assert set(got["sd"]) == set(ref["sd"]), key
        worst = max(float((got["sd"][k] - v).abs().max()) for k, v in ref["sd"].items()
                    if keys is None or k in keys)
        assert worst <= TOL, f"{key} rank {rank}: max abs diff {worst:.3g}"


def matrices_model(model: torch.nn.Module, env: dict, world: int, z3: bool = True) -> tuple:
    """``(model, optimizer)`` for a model whose 2-D params are all Muon matrices: dmuon on a gloo
    mesh of ``world`` ranks (``env["dist"]``; ``env["rank"]``; ``model.layers`` the hook groups,
    collectives bounded at 10 s), else :class:`RefMuon` in one process."""
    if not env["dist"]:
        return model, RefMuon(model, lambda n, p: p.ndim == 2)
    import datetime

    import dmuon
    from stateful_harness import build_dmuon
    return build_dmuon(env["rank"], world, model, model.layers,
                       {"z3": z3, "predicate": lambda n, p: p.ndim == 2},
                       options=dmuon.DedicateOptions(timeout=datetime.timedelta(seconds=10)))
