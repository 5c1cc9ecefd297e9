"""AdamW as an explicit-state transformation over pytrees (optax style).

``init(params) -> AdamWState`` and ``update(grads, state, params, hparams) -> (new_params, new_state)``.
AdamW is the chain ``scale_by_adam(betas, eps)`` then ``decoupled_apply(lr, wd)``
(:func:`transform`; the stages of :mod:`dmuon.functional.stages`, whose arithmetic follows
``torch.optim.AdamW(foreach=False)`` op for op); :func:`update` runs that chain in place with
per-tensor ops (bitwise torch's single-tensor path), as ``torch._foreach_*`` calls, or as the
fused kernel ``torch._fused_adamw_`` (an implementation of the whole chain).

References:
    I. Loshchilov, F. Hutter. "Decoupled Weight Decay Regularization". ICLR 2019. arXiv:1711.05101.
    D. P. Kingma, J. Ba. "Adam: A Method for Stochastic Optimization". ICLR 2015. arXiv:1412.6980.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch
from torch import Tensor

from dmuon.functional import transforms as T
from dmuon.functional.stages.hparams import (as_step, check_hyper, new_step, next_step,
                                             register_state, value_at)
from dmuon.functional.stages.leaves import FOREACH, PER_TENSOR, Leaves, run_inplace
from dmuon.functional.tree import (PyTree, check_tensor_leaves, flatten, flatten_like, leaf_paths,
                                  zeros_like_tree)

__all__ = ["IMPLS", "AdamWHParams", "AdamWState", "init", "transform", "update", "validate_hparams",
           "hparams_of_group", "resolve_impl", "update_per_param", "torch_entries"]

#: The ``impl`` choices of :func:`update`.
IMPLS = ("reference", "foreach", "fused")


class AdamWHParams(NamedTuple):
    """Hyper-parameters of AdamW (defaults as ``torch.optim.AdamW``).

    Attributes:
        lr: learning rate ``γ``: a float, a 0-d tensor or a function of the step
            (:mod:`dmuon.functional.stages.hparams`; :func:`update` evaluates it at
            ``state.step``), as ``weight_decay``.
        betas: ``(β1, β2)``, decay rates of the first and second moment estimates.
        eps: ``ε`` added to the bias-corrected root second moment.
        weight_decay: decoupled weight decay ``λ`` (the param is multiplied by ``1 − γ·λ``).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01


@register_state
class AdamWState(NamedTuple):
    """State of AdamW: a plain pytree any tree tool can save.

    Attributes:
        step: number of ``update`` calls so far (one global count, a 0-d float64 tensor; bias
            correction uses it).
        mu: first moment estimates, same structure / shapes / dtypes as params.
        nu: second moment estimates, same structure / shapes / dtypes as params.
    """

    step: Any
    mu: PyTree
    nu: PyTree


def hparams_of_group(group: Mapping[str, Any]) -> AdamWHParams:
    """The :class:`AdamWHParams` of a torch param group (``lr``, ``betas``, ``eps``,
    ``weight_decay``: ``dmuon.Muon``'s ``param_groups[1]``)."""
    return AdamWHParams(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                        weight_decay=group["weight_decay"])


def resolve_impl(impl: str, device_type: str) -> str:
    """The :func:`update` ``impl`` an ``"auto"`` setting means on ``device_type`` (``"fused"``
    on CUDA, else ``"reference"``: bitwise ``torch.optim.AdamW(foreach=False)``)."""
    if impl != "auto":
        return impl
    return "fused" if device_type == "cuda" else "reference"


def validate_hparams(hparams: AdamWHParams) -> None:
    """Raise ``ValueError`` when an AdamW hyper-parameter is out of range.

    Args:
        hparams: the hyper-parameters to check.
    """
    if not isinstance(hparams, AdamWHParams):
        raise TypeError(f"hparams must be an AdamWHParams, got {type(hparams).__name__}")
    lr, betas, eps, wd = hparams
    check_hyper("lr", lr, where="AdamW")
    check_hyper("weight_decay", wd, where="AdamW")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"AdamW betas must be two floats in [0, 1), got {betas!r}")
    if not (eps >= 0):
        raise ValueError(f"AdamW eps must be >= 0, got {eps!r}")


def init(params: PyTree) -> AdamWState:
    """Create the AdamW state for ``params``: ``step = 0`` and zero moments.

    Args:
        params: any optree pytree of tensors (e.g. a flat ``{name: tensor}`` dict).

    Returns:
        ``AdamWState(step=tensor(0), mu=zeros_like(params), nu=zeros_like(params))``.

    References:
        Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
    """
    leaves, treedef = flatten(params)
    check_tensor_leaves(leaves, leaf_paths(params), "params")
    return AdamWState(step=new_step(), mu=zeros_like_tree(leaves, treedef),
                      nu=zeros_like_tree(leaves, treedef))


@torch.no_grad()
def update(
    grads: PyTree,
    state: AdamWState,
    params: PyTree,
    hparams: AdamWHParams = AdamWHParams(),
    *,
    donate: bool = False,
    impl: str = "reference",
) -> tuple[PyTree, AdamWState]:
    """One AdamW step with decoupled weight decay, exactly as ``torch.optim.AdamW(foreach=False)``.

    With ``t = state.step + 1`` and, for every leaf whose gradient ``g`` is not ``None``::

        W ← W · (1 − γ·λ)                       (skipped when λ = 0)
        m ← lerp(m, g, 1 − β1)                  (= β1·m + (1 − β1)·g)
        v ← β2·v + (1 − β2)·g²
        W ← W − (γ / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + ε)

    Leaves whose gradient is ``None`` keep their param and moments unchanged (the global step still
    advances; ``torch.optim.AdamW`` keeps one step per param instead, which differs only when a param
    sometimes gets no gradient: :func:`update_per_param` keeps torch's counts, as ``dmuon.Muon``'s
    AdamW group does). Gradients of a lower precision than the param (e.g. bf16 grads for
    fp32 masters) are upcast: the math runs in the param's dtype. Runs under ``torch.no_grad()``
    (params may be ``nn.Parameter`` s, also with ``donate=True``).

    Args:
        grads: pytree with the params' structure; a leaf may be ``None``.
        state: the ``AdamWState`` from ``init`` or a previous ``update``.
        params: pytree of tensors.
        hparams: ``AdamWHParams``.
        donate: when ``True``, params and moment buffers are updated in place and the returned leaves
            are the very same tensor objects; when ``False`` (default) no input is modified.
        impl: how :func:`transform`'s chain runs, one of ``IMPLS``:

            * ``"reference"`` (default): the ops of ``torch.optim.AdamW(foreach=False)``, one
              tensor at a time (each op over every leaf in turn) -- bitwise equal to it;
            * ``"foreach"``: the same ops as ``torch._foreach_*`` calls over all leaves of one
              device and dtype (a few launches per step on CUDA; bitwise equal to
              ``"reference"`` on CPU, where foreach runs the same per-tensor ops);
            * ``"fused"``: ``torch._fused_adamw_``, the kernel behind
              ``torch.optim.AdamW(fused=True)`` (one pass over param, grad and moments; CUDA, and
              CPU on recent torch). Same math, different rounding: equal to ``"reference"`` only
              up to a few ulps.

            Without donation the params and moments are copied first and the chain runs on
            the copies.

    Returns:
        ``(new_params, new_state)``. Without donation, leaves with a ``None`` gradient are returned as
        the input objects themselves (they are not copied).

    References:
        Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019 (arXiv:1711.05101);
        Kingma & Ba, "Adam", ICLR 2015; PyTorch ``torch.optim.AdamW``.
    """
    validate_hparams(hparams)
    if impl not in IMPLS:
        raise ValueError(f"AdamW impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(state, AdamWState):
        raise TypeError(f"state must be an AdamWState (from adamw.init), got {type(state).__name__}")
    hparams = hparams._replace(lr=value_at(hparams.lr, state.step),
                               weight_decay=value_at(hparams.weight_decay, state.step))
    p_leaves, treedef = flatten(params)
    names = leaf_paths(params)
    check_tensor_leaves(p_leaves, names, "params")
    g_leaves = flatten_like(treedef, grads, "grads")
    m_leaves = flatten_like(treedef, state.mu, "state.mu")
    v_leaves = flatten_like(treedef, state.nu, "state.nu")

    for name, p, g, m, v in zip(names, p_leaves, g_leaves, m_leaves, v_leaves):
        if g is not None:
            _check_leaf(name, p, g, m, v)

    leaves = Leaves(params, grads, donate=donate, what="grads", names=names,
                    ops=PER_TENSOR if impl == "reference" else FOREACH)
    by: dict[tuple, list[int]] = {}  # foreach lists and fused kernels take one device and dtype
    for k, p in enumerate(leaves.params):
        by.setdefault((p.device, p.dtype), []).append(k)
    groups = None if impl == "reference" or len(by) < 2 else list(by.values())
    chain = _fused(hparams) if impl == "fused" else transform(hparams)
    inner = T.ChainState((T.AdamState(state.step, state.mu, state.nu), T.EmptyState()))
    adam = run_inplace(chain, leaves, inner, groups).states[0]
    return leaves.params_tree(), AdamWState(step=adam.step, mu=adam.mu, nu=adam.nu)


def update_per_param(grads: Mapping[str, Any], state: AdamWState, params: Mapping[str, Tensor],
                     hparams: AdamWHParams = AdamWHParams(), *, skipped: Mapping[str, int],
                     donate: bool = False, impl: str = "reference"
                     ) -> tuple[dict[str, Tensor], AdamWState, dict[str, int]]:
    """:func:`update` with ``torch.optim.AdamW``'s step counts: one per param, advanced only at
    the updates where it has a gradient (flat ``{name: tensor}`` trees).

    Param ``n``'s count is ``state.step - skipped.get(n, 0)``: ``state.step`` counts the updates
    (it evaluates the hyper-parameters' schedules, as torch's param group holds one ``lr``) and
    ``skipped`` how many of them found ``n`` without a gradient. The params with a gradient are
    updated in cohorts of equal counts (one :func:`update` each, usually one: then the result is
    :func:`update`'s bitwise); afterwards every param without a gradient has skipped one more.

    Returns:
      ``(new params, new state, new skipped)`` (``skipped`` holds the nonzero counts only).
    """
    t = int(state.step)
    hparams = hparams._replace(lr=value_at(hparams.lr, state.step),
                               weight_decay=value_at(hparams.weight_decay, state.step))
    cohorts: dict[int, list[str]] = {}
    for n in params:
        if grads.get(n) is not None:
            cohorts.setdefault(int(skipped.get(n, 0)), []).append(n)
    new_p, mu, nu = dict(params), dict(state.mu), dict(state.nu)
    for c, names in sorted(cohorts.items()):
        sub = AdamWState(as_step(t - c), {n: mu[n] for n in names}, {n: nu[n] for n in names})
        out, st = update({n: grads[n] for n in names}, sub, {n: params[n] for n in names},
                         hparams, donate=donate, impl=impl)
        new_p.update(out)
        mu.update(st.mu)
        nu.update(st.nu)
    now = {n: int(skipped.get(n, 0)) + (grads.get(n) is None) for n in params}
    return new_p, AdamWState(next_step(state.step), mu, nu), {n: c for n, c in now.items() if c}


def torch_entries(state: AdamWState, skipped: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """``{name: torch.optim.AdamW's state entry}`` under :func:`update_per_param`: its ``step``
    (a 0-d tensor: ``state.step`` less the updates it skipped), ``exp_avg`` and ``exp_avg_sq``
    (the state's own tensors)."""
    t = int(state.step)
    return {n: {"step": torch.tensor(float(t - int(skipped.get(n, 0)))),
                "exp_avg": state.mu[n], "exp_avg_sq": state.nu[n]} for n in state.mu}


def _check_leaf(name: str, p: Tensor, g, m: Tensor, v: Tensor) -> None:
    if not isinstance(g, Tensor) or g.shape != p.shape:
        got = tuple(g.shape) if isinstance(g, Tensor) else type(g).__name__
        raise ValueError(f"grad of {name!r} must be a tensor of shape {tuple(p.shape)}, got {got}")
    if m.shape != p.shape or v.shape != p.shape:
        raise ValueError(
            f"AdamW moments of {name!r} have shapes {tuple(m.shape)}, {tuple(v.shape)}; expected "
            f"{tuple(p.shape)} (was the state made by adamw.init for these params?)"
        )


def _fused(hparams: AdamWHParams) -> T.Transform:
    """:func:`transform`'s chain with ``torch._fused_adamw_`` (the kernel of
    ``torch.optim.AdamW(fused=True)``) as the in-place implementation of both stages: one pass
    over param, grad and moments per device and dtype; same math, other rounding (a few ulps)."""
    chain = transform(hparams)
    lr, eps, wd = float(hparams.lr), float(hparams.eps), float(hparams.weight_decay)
    beta1, beta2 = (float(b) for b in hparams.betas)

    def update_(leaves: Leaves, state: T.ChainState) -> T.ChainState:
        adam = state.states[0]
        t = int(adam.step) + 1
        ps = leaves.written_params()
        if ps:
            step = torch.full((), float(t), dtype=torch.float32, device=ps[0].device)
            torch._fused_adamw_(ps, leaves.updates, adam.mu, adam.nu, [], [step] * len(ps), lr=lr,
                                beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps,
                                amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
        leaves.params, leaves.applied = ps, True
        return T.ChainState((adam._replace(step=next_step(adam.step)), state.states[1]))

    return chain._replace(update_=update_)


def transform(hparams: AdamWHParams = AdamWHParams()):
    """AdamW as a chain of :mod:`dmuon.functional.transforms` stages, the chain :func:`update`
    runs in place::

        chain(scale_by_adam(betas, eps), decoupled_apply(lr, wd))

    With :func:`~dmuon.functional.transforms.apply_updates` (optax form) the last stage rounds
    ``W + (−lr)·(u + λ·W)``, within a few ulps of :func:`update`; with
    :func:`~dmuon.functional.transforms.update_params` it is :func:`update` (``impl="foreach"``)
    bitwise.

    Args:
        hparams: :class:`AdamWHParams` (validated).

    Returns:
        A :class:`~dmuon.functional.transforms.Transform`.
    """
    validate_hparams(hparams)
    return T.chain(T.scale_by_adam(hparams.betas, hparams.eps),
                   T.decoupled_apply(hparams.lr, hparams.weight_decay))
