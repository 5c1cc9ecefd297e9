"""A Muon variant in a research loop, composed from dmuon's functional transforms — no copy of
``muon.update``.

    python examples/research_transforms.py

Three optimizers train the same small MLP on the same synthetic task (regress a fixed random
teacher), each a ``partition`` of a matrix route and a vector route:

* ``muon``: ``muon.transform(hp)`` for matrices, ``adamw.transform`` for vectors (dmuon's Muon);
* ``muon_3step_jordan``: the orthogonalizer swapped for a 3-step Jordan Newton–Schulz
  (``NSConfig``), everything else unchanged;
* ``muon_clipped``: a stage added — each matrix update is clipped to RMS ≤ 0.5 before the learning
  rate scales it (a user-written ``Transform`` in the optax form, ``init`` / ``update``; the same
  chain, built by a function of ``MuonHParams``, runs on a distributed model's owners as
  ``dmuon.Muon(model, transform=...)``: docs/functional/stages.md).

Exits non-zero if any loss did not fall, so it doubles as a smoke test (tests/test_transforms.py).
"""
from __future__ import annotations

import sys

import torch
from torch import nn
from torch.func import functional_call

from dmuon.functional import adamw, muon
from dmuon.functional import transforms as T
from dmuon.newton_schulz import NSConfig


def clip_update_rms(max_rms: float) -> T.Transform:
    """A stateless stage: ``u ← u · min(1, max_rms / rms(u))`` per leaf."""

    def update(updates, state, params):
        out = {n: None if u is None else u * torch.clamp(max_rms / (u.pow(2).mean().sqrt() + 1e-12),
                                                         max=1.0)
               for n, u in updates.items()}
        return out, state

    return T.Transform(lambda params: T.EmptyState(), update)


def optimizers(hp: muon.MuonHParams, ahp: adamw.AdamWHParams) -> dict[str, T.Transform]:
    def route(name: str, p: torch.Tensor) -> str:
        return "matrix" if p.ndim >= 2 else "vector"

    vec = adamw.transform(ahp)
    jordan3 = NSConfig(ns_steps=3, ns_coefficients="jordan")
    clipped = T.chain(T.trace_momentum(hp.momentum, hp.nesterov), T.orthogonalize(NSConfig()),
                      T.scale_by_shape(hp.lr_scale), clip_update_rms(0.5),
                      T.add_decayed_weights(hp.weight_decay), T.scale_by_learning_rate(hp.lr))
    return {
        "muon": T.partition({"matrix": muon.transform(hp), "vector": vec}, route),
        "muon_3step_jordan": T.partition(
            {"matrix": muon.transform(hp, orthogonalizer=jordan3), "vector": vec}, route),
        "muon_clipped": T.partition({"matrix": clipped, "vector": vec}, route),
    }


def train(opt: T.Transform, steps: int = 60, seed: int = 0) -> tuple[float, float]:
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = opt.init(params)
    x_eval = torch.randn(512, 16)
    with torch.no_grad():
        y_eval = teacher(x_eval)

    def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    first = loss(params, x_eval, y_eval).item()
    for _ in range(steps):
        x = torch.randn(128, 16)
        with torch.no_grad():
            y = teacher(x)
        leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        grads = dict(zip(leaves, torch.autograd.grad(loss(leaves, x, y), list(leaves.values()))))
        updates, state = opt.update(grads, state, params)
        params = T.apply_updates(params, updates)
    return first, loss(params, x_eval, y_eval).item()


def main() -> int:
    opts = optimizers(muon.MuonHParams(lr=0.02, weight_decay=0.01), adamw.AdamWHParams(lr=3e-3))
    ok = True
    for name, opt in opts.items():
        first, last = train(opt)
        print(f"{name:18s} eval loss {first:.5f} -> {last:.5f}")
        ok &= last < 0.5 * first
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
