"""Muon's variants as chains of stages: NorMuon, Muon-Hyperball (MuonH) and their chain NorMuonH.

A :class:`Variant` builds its chain from Muon's hyper-parameters,
``variant(MuonHParams(...)) -> Transform``, so the same object runs

* in one process: ``chain = variants.normuon()(MuonHParams(lr=0.02))`` with
  :func:`~dmuon.functional.transforms.update_params` (in place) or ``chain.update`` +
  :func:`~dmuon.functional.transforms.apply_updates` (optax form);
* distributed: ``dmuon.Muon(model, 0.02, transform=variants.normuon())`` builds the chain from
  ``param_groups[0]`` at every step (so ``torch.optim.lr_scheduler`` and the policy's
  ``lr_mult`` / ``wd_mult`` apply) and runs it on each owner
  (:func:`~dmuon.functional.owner_step.owner_step`).

The chains (``μ``, ``lr``, ``λ``, the NS settings and ``s(m, n)`` from :class:`MuonHParams`)::

    muon()              momentum → NS → s(m, n) → W·(1 − lr·λ) − lr·u          (Muon itself)
    normuon()           momentum → NS → row norm → s(m, n) → W·(1 − lr·λ) − lr·u
    muon_hyperball()    momentum → NS → W ← R·normalize(W − lr·R·û)            (λ must be 0)
    normuon_hyperball() momentum → NS → row norm → W ← R·normalize(W − lr·R·û) (λ must be 0)

(:func:`~dmuon.functional.stages.row_norm.scale_by_row_norm`: NorMuon's per-row second moment,
Li et al. 2025; :func:`~dmuon.functional.stages.hyperball.hyperball_apply`: Wen et al. 2025 /
NVIDIA Emerging-Optimizers' ``MuonHyperball``.) Momentum is dmuon's sum form (``b ← μ·b + g``,
Nesterov ``g + μ·b``): the papers' EMA ``(1 − μ)``-scaled buffer gives the same NS input up to that
factor, which NS removes. Any other chain of stages works the same way: pass a function
``hp -> Transform`` (or a Transform) as ``dmuon.Muon(transform=...)``.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from dmuon.functional import muon as fmuon
from dmuon.functional import transforms as T
from dmuon.functional.stages.hyperball import hyperball_apply
from dmuon.functional.stages.row_norm import scale_by_row_norm
from dmuon.newton_schulz.config import NSConfig

__all__ = ["Variant", "muon", "normuon", "muon_hyperball", "normuon_hyperball"]


class Variant(NamedTuple):
    """A Muon variant: ``name``, and ``build(hparams, view, batch_dims) -> Transform`` with its
    own options bound. Call it: ``variant(hparams=MuonHParams(), *, view=None, batch_dims=None)``
    (views as :func:`dmuon.functional.muon.update`'s; on an owner the policy's views apply)."""

    name: str
    build: Callable[..., T.Transform]
    options: dict

    def __call__(self, hparams: fmuon.MuonHParams = fmuon.MuonHParams(), *, view: Any = None,
                 batch_dims: Any = None) -> T.Transform:
        fmuon.validate_hparams(hparams)
        return self.build(hparams, view, batch_dims, **self.options)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"variants.{self.name}({opts})"


def _front(hp: fmuon.MuonHParams, view: Any, bd: Any, mu_dtype: Any) -> list[T.Transform]:
    """Momentum (kept in ``mu_dtype``) and Newton–Schulz: the stages every variant starts with."""
    return [T.trace_momentum(hp.momentum, hp.nesterov, dtype=mu_dtype),
            T.orthogonalize(NSConfig.from_hparams(hp), view=view, batch_dims=bd)]


def _muon(hp, view, bd, momentum_dtype=None) -> T.Transform:
    return T.chain(*_front(hp, view, bd, momentum_dtype),
                   T.scale_by_shape(hp.lr_scale, view=view, batch_dims=bd),
                   T.decoupled_apply(hp.lr, hp.weight_decay))


def _normuon(hp, view, bd, beta2, eps, momentum_dtype=None) -> T.Transform:
    return T.chain(*_front(hp, view, bd, momentum_dtype),
                   scale_by_row_norm(beta2, eps, view=view, batch_dims=bd),
                   T.scale_by_shape(hp.lr_scale, view=view, batch_dims=bd),
                   T.decoupled_apply(hp.lr, hp.weight_decay))


def _no_decay(hp: fmuon.MuonHParams, name: str) -> None:
    wd = hp.weight_decay
    if callable(wd) or (not hasattr(wd, "ndim") and float(wd) != 0.0) or \
            (hasattr(wd, "ndim") and not getattr(wd, "is_meta", False) and bool(wd != 0)):
        raise ValueError(f"{name}: the hyperball step replaces weight decay (the weight norm is "
                         f"fixed); pass weight_decay=0, got {wd!r}")


def _hyperball(hp, view, bd, radius, eps, momentum_dtype=None) -> T.Transform:
    _no_decay(hp, "muon_hyperball")
    return T.chain(*_front(hp, view, bd, momentum_dtype),
                   hyperball_apply(hp.lr, radius, eps, view=view, batch_dims=bd))


def _normuon_hyperball(hp, view, bd, beta2, eps, radius, hyperball_eps,
                       momentum_dtype=None) -> T.Transform:
    _no_decay(hp, "normuon_hyperball")
    return T.chain(*_front(hp, view, bd, momentum_dtype),
                   scale_by_row_norm(beta2, eps, view=view, batch_dims=bd),
                   hyperball_apply(hp.lr, radius, hyperball_eps, view=view, batch_dims=bd))


def _mu(momentum_dtype: Any) -> dict:
    """The ``momentum_dtype`` option as a Variant keeps it (absent when the default, so the
    variant's repr and equality stay what they were)."""
    return {} if momentum_dtype is None else {"momentum_dtype": momentum_dtype}


def muon(momentum_dtype: Any = None) -> Variant:
    """Muon itself as a variant (the chain :func:`dmuon.functional.muon.update` runs).

    Args:
        momentum_dtype: the dtype the momentum is kept in between steps (optax's ``mu_dtype``;
            ``None``: fp32; ``torch.bfloat16``; an 8-bit float with a per-matrix scale,
            ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``): rounded to it after each update
            in one process, stored in it by ``dmuon.Muon``'s owners (every variant takes it).
    """
    return Variant("muon", _muon, _mu(momentum_dtype))


def normuon(beta2: Any = 0.95, eps: float = 1e-10, momentum_dtype: Any = None) -> Variant:
    """NorMuon (Li et al. 2025, arXiv:2510.05491): Muon with each row of the orthogonalized update
    normalized by its running second moment, the matrix's Frobenius norm kept.

    Args:
        beta2: decay of the per-row second moment (default 0.95, the paper's); a float, a 0-d
            tensor or a function of the step.
        eps: ``ε`` (default 1e-10, the reference implementation's).
        momentum_dtype: as :func:`muon`'s.
    """
    return Variant("normuon", _normuon, dict(beta2=beta2, eps=eps, **_mu(momentum_dtype)))


def muon_hyperball(radius: Optional[float] = None, eps: float = 1e-8,
                   momentum_dtype: Any = None) -> Variant:
    """Muon-Hyperball (MuonH; Wen et al. 2025, NVIDIA Emerging-Optimizers 0.5's
    ``MuonHyperball``): Muon's direction, each matrix kept at a fixed Frobenius norm and moved by
    a fixed fraction ``lr`` of it; no weight decay (``weight_decay`` must be 0).

    Args:
        radius: the norm every matrix is kept at (default ``None``: its norm at its first step).
        eps: ``ε`` of the normalizations (default 1e-8, Emerging-Optimizers').
        momentum_dtype: as :func:`muon`'s.
    """
    return Variant("muon_hyperball", _hyperball, dict(radius=radius, eps=eps,
                                                      **_mu(momentum_dtype)))


def normuon_hyperball(beta2: Any = 0.95, eps: float = 1e-10, radius: Optional[float] = None,
                      hyperball_eps: float = 1e-8, momentum_dtype: Any = None) -> Variant:
    """NorMuonH: NorMuon's row normalization, then the hyperball step (the chain of the two;
    ``momentum_dtype`` as :func:`muon`'s)."""
    return Variant("normuon_hyperball", _normuon_hyperball,
                   dict(beta2=beta2, eps=eps, radius=radius, hyperball_eps=hyperball_eps,
                        **_mu(momentum_dtype)))
