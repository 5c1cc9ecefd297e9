"""Stages written in the optax form only (``init`` / ``update``, no in-place ``update_``) and the
Muon chains that use them, for tests/test_optax_stages.py and the slow tier's 2-rank run
(tests/variant_worker.py): the clip of ``examples/research_transforms.py`` as the example defines
it, and a stage with per-param state."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dmuon.functional import transforms as T
from dmuon.functional.stages import register_state
from dmuon.newton_schulz import NSConfig

ROOT = Path(__file__).resolve().parents[1]


def research_example() -> Any:
    """``examples/research_transforms.py`` as a module."""
    spec = importlib.util.spec_from_file_location("research_transforms",
                                                  ROOT / "examples" / "research_transforms.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: the clip's bound: below the RMS of Muon's scaled update here, so the clip binds
CLIP_RMS = 0.02


def clipped(hp: Any) -> T.Transform:
    """Muon with the example's optax-form clip before the learning rate, ending as optax chains
    end (``add_decayed_weights``, ``scale_by_learning_rate``): the example's ``muon_clipped``
    chain, its NS settings taken from ``hp``."""
    return T.chain(T.trace_momentum(hp.momentum, hp.nesterov),
                   T.orthogonalize(NSConfig.from_hparams(hp)), T.scale_by_shape(hp.lr_scale),
                   research_example().clip_update_rms(CLIP_RMS),
                   T.add_decayed_weights(hp.weight_decay), T.scale_by_learning_rate(hp.lr))


def unclipped(hp: Any) -> T.Transform:
    """:func:`clipped` without the clip (to show that the clip binds)."""
    return T.chain(T.trace_momentum(hp.momentum, hp.nesterov),
                   T.orthogonalize(NSConfig.from_hparams(hp)), T.scale_by_shape(hp.lr_scale),
                   T.add_decayed_weights(hp.weight_decay), T.scale_by_learning_rate(hp.lr))


@register_state
class SecondMomentState(NamedTuple):
    """Per param, the running mean of the squared update (declared per param, so dmuon.Muon saves
    and restores it per matrix)."""

    nu: Any
    per_param = ("nu",)


def scale_by_second_moment(beta: float = 0.9, eps: float = 1e-8) -> T.Transform:
    """``ν ← β·ν + (1 − β)·u²``, ``u ← u / (sqrt(ν) + ε)``, written in the optax form only."""

    def init(params):
        return SecondMomentState({n: torch.zeros_like(p) for n, p in params.items()})

    def update(updates, state, params):
        nu = {n: state.nu[n] if u is None else beta * state.nu[n] + (1 - beta) * u * u
              for n, u in updates.items()}
        out = {n: None if u is None else u / (nu[n].sqrt() + eps) for n, u in updates.items()}
        return out, SecondMomentState(nu)

    return T.Transform(init, update)


def second_moment(hp: Any) -> T.Transform:
    """Muon with the stateful optax-form stage after NS, then dmuon's applying stage."""
    return T.chain(T.trace_momentum(hp.momentum, hp.nesterov),
                   T.orthogonalize(NSConfig.from_hparams(hp)), scale_by_second_moment(),
                   T.scale_by_shape(hp.lr_scale), T.decoupled_apply(hp.lr, hp.weight_decay))


#: the chains tests/variant_worker.py runs by name
CHAINS = {"optax_clip": clipped, "optax_second_moment": second_moment}


def optax_run(chain: T.Transform, grads_per_step: list, params: dict) -> tuple[dict, Any]:
    """One process, the optax form as the example's loop runs it: ``chain.update`` then
    ``apply_updates``, over ``grads_per_step`` (``{name: grad or None}`` each)."""
    state = chain.init(params)
    for grads in grads_per_step:
        updates, state = chain.update(grads, state, params)
        params = T.apply_updates(params, updates)
    return params, state


def counting(as_tensor: bool) -> Any:
    """``hp -> Transform``: Muon with an optax-form stage that counts its calls, in a Python int
    (``as_tensor=False``: refused, a checkpoint could not restore it) or a 0-d tensor."""

    def count_calls() -> T.Transform:
        def init(params):
            return {"count": torch.zeros((), dtype=torch.int64) if as_tensor else 0}

        def update(updates, state, params):
            return updates, {"count": state["count"] + 1}

        return T.Transform(init, update)

    def chain(hp: Any) -> T.Transform:
        return T.chain(T.trace_momentum(hp.momentum, hp.nesterov), count_calls(),
                       T.orthogonalize(NSConfig.from_hparams(hp)), T.scale_by_shape(hp.lr_scale),
                       T.add_decayed_weights(hp.weight_decay), T.scale_by_learning_rate(hp.lr))

    return chain
