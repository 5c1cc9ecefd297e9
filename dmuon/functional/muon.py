"""Muon as an explicit-state transformation over pytrees (optax style).

``init(params) -> MuonState`` and ``update(grads, state, params, hparams) -> (new_params, new_state)``.
Every param routed here is a matrix, or a batch of matrices (see ``batch_dims``); vectors and scalars
belong to AdamW (:mod:`dmuon.functional.adamw`).

For each param ``W`` with gradient ``g`` (viewed as ``B`` matrices of shape ``(m, n)``)::

    b ← μ·b + g                       (b starts at zero, so the first step gives b = g)
    x ← g + μ·b  if nesterov else  b
    U ← NS(x)                         (Newton–Schulz orthogonalization of each (m, n) matrix)
    W ← W·(1 − lr·wd)                 (decoupled weight decay)
    W ← W − lr·s(m, n)·U

with the shape scale ``s`` chosen by ``lr_scale``: ``"moonlight"`` ``0.2·sqrt(max(m, n))`` (matches
AdamW's update RMS, Liu et al. 2025), ``"jordan"`` ``sqrt(max(1, m/n))`` (Jordan 2024), ``"spectral"``
``sqrt(m/n)`` (Bernstein 2025), ``"none"`` ``1``.

Those lines are the stages of :mod:`dmuon.functional.stages` (momentum, orthogonalize, shape
scale, decoupled apply), each written once; :func:`transform` chains them (optax form) and
:func:`update` runs the same chain in place on donated buffers, with the caller's NS engine and
fused elementwise kernels as implementations of its stages.

References:
    K. Jordan et al. "Muon: An optimizer for hidden layers in neural networks", 2024.
        https://kellerjordan.github.io/posts/muon/
    J. Liu et al. "Muon is Scalable for LLM Training" (Moonlight), 2025. arXiv:2502.16982.
    I. Loshchilov, F. Hutter. "Decoupled Weight Decay Regularization", ICLR 2019 (weight decay form).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from dmuon.newton_schulz.coefficients import CoefficientSpec, ns_coefficient_table
from dmuon.newton_schulz.batched import orthogonalize_batched
from dmuon.functional.lr_scale import ADJUST_LR_FN, LR_SCALE_RULES, lr_scale_factor
from dmuon.newton_schulz.matrix_shape import as_matrix_shape  # noqa: F401 (re-exported)
from dmuon.functional.matrix_view import Batch, refuse_plain_ns, views_per_leaf
from dmuon.functional import transforms as T
from dmuon.functional.stages.decoupled import foreach_apply_
from dmuon.functional.stages.hparams import (check_hyper, new_step, next_step, register_state,
                                             value_at)
from dmuon.functional.stages.leaves import Leaves, run_inplace
from dmuon.functional.stages.momentum import foreach_momentum_
from dmuon.newton_schulz.config import NSConfig
from dmuon.functional.tree import (PyTree, check_tensor_leaves, flatten, flatten_like, leaf_paths,
                                  zeros_like_tree)

__all__ = [
    "LR_SCALE_RULES",
    "MAX_NS_STEPS",
    "MuonHParams",
    "MuonState",
    "FOREACH_ELEMENTWISE",
    "MuonElementwise",
    "Orthogonalize",
    "foreach_apply_",
    "foreach_momentum_",
    "init",
    "lr_scale_factor",
    "orthogonalize_batched",
    "transform",
    "update",
    "validate_hparams",
    "at_step",
    "hparams_key",
]

#: The ``orthogonalize=`` hook of :func:`update`: ``(B_i, m_i, n_i)`` inputs -> their NS results.
Orthogonalize = Callable[[list[Tensor]], Sequence[Tensor]]


class MuonElementwise(NamedTuple):
    """The ``elementwise=`` hook of :func:`update`: implementations of Muon's two elementwise
    stages (like NS's ``sym``), the momentum stage and the applying stage.

    The math is the stages' (:func:`foreach_momentum_`, :func:`foreach_apply_`); a replacement
    (e.g. the fused Triton kernels of :mod:`dmuon.kernels.muon_elementwise`, one pass each)
    computes the same formulas, in place, rounding at most differently (one rounding instead of
    one per op).

    Attributes:
        momentum: ``momentum(bs, gs, xs, mu)`` with the contract of :func:`foreach_momentum_`.
        apply: ``apply(ps, us, decay, alphas)`` with the contract of :func:`foreach_apply_`.
    """

    momentum: Callable[[list[Tensor], list[Tensor], "list[Tensor] | None", float], None]
    apply: Callable[[list[Tensor], list[Tensor], float, Sequence[float]], None]


#: The default elementwise stages: ``torch._foreach_*`` ops (bitwise the historical code).
FOREACH_ELEMENTWISE = MuonElementwise(momentum=foreach_momentum_, apply=foreach_apply_)


class MuonHParams(NamedTuple):
    """Hyper-parameters of Muon.

    ``lr``, ``momentum`` and ``weight_decay`` may each be a float, a 0-d tensor (traced by
    ``torch.compile`` as an input, batched by ``torch.vmap``: a sweep), or a function of the step
    ``h(step) -> value`` (:mod:`dmuon.functional.stages.hparams`; :func:`update` evaluates it at
    ``state.step``, the number of updates before this one; :func:`transform`'s stages keep their
    own counts). The other fields are structural (floats, ints, names).

    Attributes:
        lr: learning rate.
        momentum: momentum coefficient ``μ`` in ``[0, 1)``.
        nesterov: feed ``g + μ·b`` (True) or ``b`` (False) to Newton–Schulz.
        weight_decay: decoupled weight decay ``wd`` (``W ← W·(1 − lr·wd)``).
        ns_steps: Newton–Schulz iterations.
        ns_coefficients: a named schedule (``"polar_express"``, ``"jordan"``, ``"you"``), a table of
            ``(a, b, c)`` triples, or one flat ``(a, b, c)`` (torch's form: the same triple every
            iteration); see :mod:`dmuon.newton_schulz.coefficients`.
        ns_eps: ``ε`` in the Frobenius normalization ``x / (‖x‖_F + ε)``.
        ns_dtype: compute dtype of Newton–Schulz (``None``: the NS default for the device).
        lr_scale: shape scale rule, one of ``LR_SCALE_RULES`` (see :func:`lr_scale_factor`).
    """

    lr: Any = 0.02
    momentum: Any = 0.95
    nesterov: bool = True
    weight_decay: Any = 0.0
    ns_steps: int = 5
    ns_coefficients: CoefficientSpec = "polar_express"
    ns_eps: float = 1e-7
    ns_dtype: torch.dtype | None = None
    lr_scale: str = "moonlight"


@register_state
class MuonState(NamedTuple):
    """State of Muon: a plain pytree any tree tool can save (``torch.load(weights_only=True)``
    rebuilds it once this module is imported).

    Attributes:
        step: number of ``update`` calls so far, a 0-d ``float64`` tensor (schedules of
            :class:`MuonHParams` are evaluated at it; the math does not use it otherwise).
        momentum: momentum buffers ``b`` (sum form ``b ← μ·b + g``), same structure / shapes / dtypes
            as params.
    """

    step: Any
    momentum: PyTree


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: the most Newton–Schulz iterations :func:`validate_hparams` accepts (every step runs them all; a
#: few more than 5 already orthogonalize to fp32's precision)
MAX_NS_STEPS = 100


def validate_hparams(hparams: MuonHParams) -> None:
    """Raise ``ValueError`` (``TypeError`` for wrong types) when a Muon hyper-parameter is invalid:
    everything :func:`update` would reject later, the coefficient schedule against ``ns_steps``
    included, so a constructor that calls this fails before the first step.

    Args:
        hparams: the hyper-parameters to check.
    """
    if not isinstance(hparams, MuonHParams):
        raise TypeError(f"hparams must be a MuonHParams, got {type(hparams).__name__}")
    h = hparams
    _hyper("lr", h.lr, "a finite float >= 0")
    _hyper("momentum", h.momentum, "in [0, 1)", hi=1.0)
    if not isinstance(h.nesterov, bool):
        raise TypeError(f"Muon nesterov must be True or False, got {h.nesterov!r}")
    _hyper("weight_decay", h.weight_decay, "a finite float >= 0")
    if isinstance(h.ns_steps, bool) or not isinstance(h.ns_steps, int) or \
            not 1 <= h.ns_steps <= MAX_NS_STEPS:
        raise ValueError(f"Muon ns_steps must be an int in [1, {MAX_NS_STEPS}] (5 is usual; each "
                         f"iteration costs three matmuls per matrix), got {h.ns_steps!r}")
    try:
        ns_coefficient_table(h.ns_coefficients, h.ns_steps)
    except ValueError as e:
        raise ValueError(f"Muon ns_coefficients={h.ns_coefficients!r} with ns_steps={h.ns_steps}: "
                         f"{e}") from None
    if not (_real(h.ns_eps) and math.isfinite(h.ns_eps) and h.ns_eps >= 0):
        raise ValueError(f"Muon ns_eps must be a finite float >= 0, got {h.ns_eps!r}")
    if h.ns_dtype is not None and not (isinstance(h.ns_dtype, torch.dtype)
                                       and h.ns_dtype.is_floating_point):
        raise ValueError(f"Muon ns_dtype must be None or a floating torch.dtype, got {h.ns_dtype!r}")
    if h.lr_scale not in LR_SCALE_RULES:

        hint = ADJUST_LR_FN.get(h.lr_scale) if isinstance(h.lr_scale, str) else None
        raise ValueError(f"Muon lr_scale must be one of {LR_SCALE_RULES}, got {h.lr_scale!r}"
                         + (f" (torch.optim.Muon's adjust_lr_fn value; dmuon's lr_scale for it is "
                            f"{hint!r}, or pass adjust_lr_fn={h.lr_scale!r})" if hint else ""))


def _hyper(name: str, v: Any, what: str, hi: Any = None) -> None:
    """A float, 0-d tensor or schedule (:func:`~dmuon.functional.stages.hparams.check_hyper`),
    with Muon's message for a value out of range."""
    try:
        check_hyper(name, v, hi=hi)
    except ValueError:
        raise ValueError(f"Muon {name} must be {what}, got {v!r}") from None
    except TypeError as e:
        raise ValueError(f"Muon {name} must be {what} (or a 0-d tensor, or a function of the "
                         f"step): {e}") from None


def _non_matrix_error(name: str, shape: tuple[int, ...], view: Any, why: str = "") -> ValueError:
    return ValueError(
        f"param {name!r} of shape {shape} (view {view}) is not a batch of matrices"
        + (f" ({why})" if why else "") + ": Muon only "
        "orthogonalizes params with at least 2 dims after the batch dims, seen through a view that "
        "fits the shape. Route vectors and scalars (biases, norms, gains) to AdamW "
        "(dmuon.functional.adamw), or choose a view that fits (dmuon.functional.matrix_view)."
    )


def init(params: PyTree) -> MuonState:
    """Create the Muon state for ``params``: ``step = 0`` and zero momentum buffers.

    Args:
        params: any optree pytree of tensors, each with ``ndim >= 2`` (flat ``{name: tensor}`` dicts
            are the common case).

    Returns:
        ``MuonState(step=tensor(0), momentum=zeros_like(params))`` (buffers in each param's
        dtype).

    Raises:
        ValueError: a leaf has fewer than 2 dims (route it to AdamW).

    References:
        K. Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024.
    """
    leaves, treedef = flatten(params)
    names = leaf_paths(params)
    check_tensor_leaves(leaves, names, "params")
    for name, p in zip(names, leaves):
        if p.ndim < 2:
            raise _non_matrix_error(name, tuple(p.shape), Batch(0))
    return MuonState(step=new_step(), momentum=zeros_like_tree(leaves, treedef))


@torch.no_grad()
def update(
    grads: PyTree,
    state: MuonState,
    params: PyTree,
    hparams: MuonHParams = MuonHParams(),
    *,
    batch_dims: Any = None,
    view: Any = None,
    donate: bool = False,
    donate_grads: bool = False,
    orthogonalize: Orthogonalize | None = None,
    elementwise: MuonElementwise | None = None,
    momentum_io: Any = None,
) -> tuple[PyTree, MuonState]:
    """One Muon step on every matrix in ``params``.

    Per param (viewed as ``B`` matrices ``(m, n)``, see ``batch_dims``), with ``μ = momentum``::

        b ← μ·b + g;   x ← g + μ·b (nesterov) or b;   U ← NS(x)
        W ← W·(1 − lr·wd);   W ← W − lr·s(m, n)·U

    This runs :func:`transform`'s chain of stages (:mod:`dmuon.functional.stages`) in place, with
    the options below. All matrices of equal ``(m, n)``, dtype and device (across params and expert
    batches) are orthogonalized in one batched Newton–Schulz call. Gradients of lower precision than the param
    (bf16 grads for fp32/fp64 masters) are upcast first: momentum and the update run in the param's
    dtype; NS runs in ``hparams.ns_dtype``. A ``None`` gradient leaves that param and its momentum
    unchanged (like ``torch.optim.Muon``, which skips params without ``.grad``). Runs under
    ``torch.no_grad()`` (params may be ``nn.Parameter`` s, also with ``donate=True``).

    Args:
        grads: pytree with the params' structure; a leaf may be ``None``.
        state: the ``MuonState`` from ``init`` or a previous ``update``.
        params: pytree of tensors with ``ndim >= 2``.
        hparams: ``MuonHParams``; validated (unknown ``lr_scale`` raises ``ValueError`` with the choices).
        batch_dims: how many leading dims of a param index independent matrices (default 0: a param
            of shape ``(m, d1, d2, ...)`` is one ``(m, d1·d2·...)`` matrix). An int for all params, a
            pytree with the params' structure, or a mapping from dotted leaf path (the key, for a flat
            dict) to int, e.g. ``{"experts.w_in": 1}`` for an ``(E, m, n)`` expert stack: ``E``
            matrices, each scaled by its own ``(m, n)``. ``batch_dims=k`` is ``view=Batch(k)``.
        view: the matrix view of each param (:mod:`dmuon.functional.matrix_view`: ``Batch``,
            ``Heads``, ``Split``, ``Transposed``), in the same forms as ``batch_dims`` (one view, a
            pytree, or ``{path: view}``; missing: ``Batch(0)``). NS runs on every matrix of every
            block of the view and the shape scale ``s(m, n)`` is taken per block; the update is
            written back through the view's exact inverse. Give ``view=`` or ``batch_dims=``, not
            both (``ValueError``).
        donate: when ``True``, params and momentum buffers are updated in place and the returned
            leaves are the very same tensor objects (no copies); when ``False`` (default) no input is
            modified.
        donate_grads: when ``True``, gradients whose dtype is the param's are used as scratch: the
            Newton–Schulz input ``x`` is formed in the gradient's storage (and, with a custom
            ``orthogonalize``, may be overwritten by its result). The gradients' values are
            undefined afterwards. Saves one param-sized temporary per matrix; results are bitwise
            the same.
        orthogonalize: the Newton–Schulz step. ``None`` (default): :func:`orthogonalize_batched`
            with ``hparams.ns_steps``, ``ns_coefficients``, ``ns_eps`` and ``ns_dtype`` (one
            batched :func:`~dmuon.newton_schulz.iteration.newton_schulz` call per matrix shape).
            Otherwise a callable ``orthogonalize(xs) -> us`` called once per step with every
            active input as a ``(B, m, n)`` tensor (list order: params' leaf order), returning
            ``NS(xs[i])`` of the same shapes, in any float dtype. It owns its NS settings (e.g. a
            :class:`dmuon.kernels.ns_engine.NSEngine` built from the same hparams), must treat
            each matrix independently, and may overwrite ``xs`` in place and return them: the
            ``xs`` are always this function's scratch (fresh tensors, or donated gradients),
            never params or momentum buffers.
        elementwise: implementations of the momentum and applying stages
            (:class:`MuonElementwise`); ``None`` (default): :data:`FOREACH_ELEMENTWISE`. Without donation the params and momentum
            buffers are copied first and the stages run on the copies.

    Returns:
        ``(new_params, new_state)`` with ``new_state.step = state.step + 1``. Without donation, leaves
        with a ``None`` gradient are returned as the input objects themselves.

    Raises:
        ValueError: a param is not a matrix (route it to AdamW), grads / state do not match params,
            or an invalid hyper-parameter.

    References:
        K. Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024
        (https://kellerjordan.github.io/posts/muon/); J. Liu et al., "Muon is Scalable for LLM
        Training", 2025, arXiv:2502.16982 (the 0.2·sqrt(max(m, n)) scale and weight decay).
    """
    validate_hparams(hparams)
    if not isinstance(state, MuonState):
        raise TypeError(f"state must be a MuonState (from muon.init), got {type(state).__name__}")
    hparams = at_step(hparams, state.step)
    p_leaves, treedef = flatten(params)
    names = leaf_paths(params)
    check_tensor_leaves(p_leaves, names, "params")
    g_leaves = flatten_like(treedef, grads, "grads")
    b_leaves = flatten_like(treedef, state.momentum, "state.momentum")
    views = views_per_leaf(view, batch_dims, params, treedef)
    if orthogonalize is None:
        refuse_plain_ns(views, names)

    for name, p, g, b, vw in zip(names, p_leaves, g_leaves, b_leaves, views):
        shape = tuple(p.shape)
        try:
            vw.blocks(shape)
        except ValueError as err:
            raise _non_matrix_error(name, shape, vw, str(err)) from err
        if g is None:
            continue
        if not isinstance(g, Tensor) or tuple(g.shape) != shape:
            got = tuple(g.shape) if isinstance(g, Tensor) else type(g).__name__
            raise ValueError(f"grad of {name!r} must be a tensor of shape {shape}, got {got}")
        if not isinstance(b, Tensor) or tuple(b.shape) != shape:
            raise ValueError(
                f"momentum buffer of {name!r} must have shape {shape} (was the state made by "
                "muon.init for these params?)"
            )

    # Muon's chain, run in place: momentum and the Nesterov input (formed in the gradient's
    # storage where it is scratch), NS of every block, the shape scale, W·(1 − lr·wd) − lr·s·U.
    leaves = Leaves(params, grads, donate=donate, donate_updates=donate_grads, what="grads",
                    names=names)
    leaves.all_views(view, batch_dims, given=views)
    if momentum_io is not None and not donate:
        raise ValueError("muon.update(momentum_io=...) writes the stored momentum: pass donate=True")
    chain = transform(hparams, batch_dims=batch_dims, view=view, orthogonalizer=orthogonalize,
                      elementwise=elementwise, momentum_io=momentum_io)
    inner = T.ChainState((T.MomentumState(state.momentum),) + (T.EmptyState(),) * 3)
    new = run_inplace(chain, leaves, inner)
    return leaves.params_tree(), MuonState(step=next_step(state.step),
                                           momentum=new.states[0].momentum)


def at_step(hparams: MuonHParams, step: Any) -> MuonHParams:
    """``hparams`` with every schedule (``lr``, ``momentum``, ``weight_decay``) evaluated at
    ``step``; values pass through."""
    return hparams._replace(**{f: value_at(getattr(hparams, f), step)
                               for f in ("lr", "momentum", "weight_decay")})


def hparams_key(hparams: MuonHParams) -> tuple | None:
    """A hashable identity of ``hparams``' values, under which a chain built from them by a
    :class:`~dmuon.functional.variants.Variant` (a pure function of them) can be reused: equal
    keys, equal values of equal types (``-0.0`` told from ``0.0``); ``None`` when one is a tensor
    or a function (it may change in place: a chain built from it is built again)."""
    return _value_key(tuple(hparams))


def _value_key(v: Any) -> tuple | None:
    if isinstance(v, (tuple, list)):
        parts = tuple(_value_key(x) for x in v)
        return None if None in parts else (type(v).__name__, parts)
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype)):
        return (type(v).__name__, repr(v))
    return None


def transform(hparams: MuonHParams = MuonHParams(), *, batch_dims: Any = None,
              view: Any = None, orthogonalizer: Any = None,
              elementwise: MuonElementwise | None = None,
              momentum_io: Any = None) -> T.Transform:
    """Muon as a chain of :mod:`dmuon.functional.transforms` stages, the chain :func:`update` runs
    in place::

        chain(trace_momentum(μ, nesterov), orthogonalize(NS), scale_by_shape(lr_scale),
              decoupled_apply(lr, wd))

    Args:
        hparams: :class:`MuonHParams` (validated); its ``ns_*`` fields are the NS settings
            (:class:`~dmuon.newton_schulz.NSConfig`) unless ``orthogonalizer`` replaces them.
        batch_dims, view: the matrix views, as in :func:`update` (one of the two).
        orthogonalizer: ``None`` (Newton–Schulz per ``hparams``), an ``NSConfig``, or any
            :data:`~dmuon.functional.transforms.Orthogonalizer` ``xs -> us``.
        elementwise: implementations of the momentum and applying stages
            (:class:`MuonElementwise`; ``None``: :data:`FOREACH_ELEMENTWISE`).
        momentum_io: the momentum stage's ``io`` (:func:`~dmuon.functional.stages.momentum.
            trace_momentum`): its state holds stored tensors, decoded chunk by chunk.

    Returns:
        A :class:`~dmuon.functional.transforms.Transform`: with
        :func:`~dmuon.functional.transforms.apply_updates` (optax form; its last stage rounds
        ``W + (−lr)·(s·U + λ·W)``, within a few ulps of :func:`update`), or with
        :func:`~dmuon.functional.transforms.update_params` (bitwise :func:`update`).
    """
    validate_hparams(hparams)
    ew = FOREACH_ELEMENTWISE if elementwise is None else elementwise
    ortho = NSConfig.from_hparams(hparams) if orthogonalizer is None else orthogonalizer
    return T.chain(
        T.trace_momentum(hparams.momentum, hparams.nesterov, impl=ew.momentum, io=momentum_io),
        T.orthogonalize(ortho, batch_dims=batch_dims, view=view),
        T.scale_by_shape(hparams.lr_scale, batch_dims=batch_dims, view=view),
        T.decoupled_apply(hparams.lr, hparams.weight_decay, impl=ew.apply),
    )
