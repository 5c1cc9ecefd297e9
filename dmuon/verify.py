"""Verify mode: check, on the real mesh, that one distributed ``dmuon.Muon`` step equals the
single-device update (SPEC §4). A composition of existing pieces; no new math.

:func:`verify_step` replaces one ``optimizer.step()`` call (after backward, gradients reduced):

1. gathers, on every rank, the full params (:func:`dmuon.get_model_state_dict`, with the owners'
   wider masters from :func:`dmuon.get_optimizer_state_dict`), the full gradients (FSDP2's via
   ``full_tensor()``, the dedicated matrices' reduced gradients broadcast from their owners with
   :func:`_from_owner`) and the full optimizer state;
2. runs ``optimizer.step()``;
3. gathers the new full params and state the same way;
4. computes the single-device reference on the gathered tensors: the pure distributed step
   (:func:`dmuon.functional.step.world_step`, the composition of the phases the runtime runs, with
   :func:`~dmuon.functional.owner_step.owner_step`, the function ``dmuon.Muon.step`` runs) over a
   world of one rank that owns every matrix, with the optimizer's Muon hparams (``ns_dtype`` as
   configured; and once more with ``ns_dtype=float64``, reported only) and
   :func:`dmuon.functional.adamw.update` (``impl="reference"``, i.e.
   ``torch.optim.AdamW(foreach=False)`` math) with its AdamW hparams;
5. compares each param and each state tensor (momentum, ``exp_avg``, ``exp_avg_sq``) by the max
   relative error ``max|dist - ref| / max|ref|`` and takes the max of every error over ranks (one
   small object all-gather), so the verdict and the report are the same on every rank.

Tolerance (``rtol=None``), per tensor, by the lowest precision involved (the master / param dtype
and, for Muon, the Newton–Schulz dtype): fp64 ``1e-10``, fp32 ``1e-5``, fp16 ``1e-3``, bf16
``1e-2``. The 16-bit bounds are loose on purpose: on CUDA the optimizer's Newton–Schulz engine
(batched, Gram / symmetric kernels, graph replay) and the functional NS both round in the NS dtype
(fp16 by default there), in a different order; the difference, scaled by ``lr``, is of that order
relative to the weights. A bug (a wrong
owner, a stale master, a rank-dependent hyper-parameter, a lost step) is O(lr) or more and shows.

What it does not check: the gradients themselves. They are the step's *inputs*, gathered after the
reduce; the gradient reduction is checked by the equality tests against a full-batch reference.
Hyper-parameters are checked to be the same on every rank (else :class:`VerificationError`, raised
before the step, nothing updated).

Memory and time: every rank holds the full model, its gradients, two copies of the optimizer state
and up to three reference copies of the params (fp64 Newton–Schulz included). It is a debugging / CI
mode for small runs (a few steps, a model that fits on one device several times), not for
production steps.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.stateful.modes.tensor_parallel import refuse_tp
from dmuon.stateful.runtime.agree import agree_equal, gather
from dmuon.compat.wrappers import unwrapping_model
from dmuon.functional import adamw as fadamw
from dmuon.functional import muon as fmuon
from dmuon.functional.program import step_program
from dmuon.functional.owner_checks import refuse_variant
from dmuon.functional.step import world_step
from dmuon.newton_schulz.iteration import default_ns_dtype
from dmuon.stateful.optimizer.muon import Muon
from dmuon.stateful.checkpoint.optimizer_state_dict import (check_optimizer, get_optimizer_state_dict,
                                                 hparam_groups)
from dmuon.stateful.checkpoint.state_dict import (dedicated_names_by_key, full_copy,
                                       get_model_state_dict)

__all__ = ["verify_step", "VerifyReport", "VerificationError", "default_rtol"]

logger = logging.getLogger(__name__)

#: default relative tolerance by the lowest precision involved (see the module docstring)
DEFAULT_RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


class VerificationError(AssertionError):
    """The distributed step differs from the single-device reference (raised on every rank)."""


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """Result of :func:`verify_step` (the same on every rank).

    Attributes:
      errors: ``{name: max relative error}`` of every param after the step (dedicated matrices
        against functional Muon with the configured ``ns_dtype``, others against functional AdamW).
      state_errors: ``{"name/momentum_buffer" | "name/exp_avg" | "name/exp_avg_sq": error}``.
      tolerances: ``{key: tolerance}`` for every key of ``errors`` and ``state_errors``.
      fp64_errors: ``{name: error}`` of each dedicated matrix against Muon with fp64 Newton–Schulz
        (informational: the cost of the configured NS precision; not checked).
      max_error: the largest of ``errors`` and ``state_errors``; ``worst``: its key.
      loss: ``closure()``'s value, if a closure was given.
    """

    errors: dict[str, float]
    state_errors: dict[str, float]
    tolerances: dict[str, float]
    fp64_errors: dict[str, float]
    max_error: float
    worst: Optional[str]
    loss: Any = None


def default_rtol(dtype: torch.dtype) -> float:
    """The default tolerance for a tensor computed in ``dtype`` (:data:`DEFAULT_RTOL`)."""
    return DEFAULT_RTOL.get(dtype, 1e-2)


def _lowest(*dtypes: torch.dtype) -> torch.dtype:
    return min(dtypes, key=lambda d: torch.finfo(d).bits if d.is_floating_point else 64)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|a - ref| / max|ref|`` in fp64 (``max|a - ref|`` when ``ref`` is all zeros); ``inf``
    on a shape mismatch or a non-finite value."""
    if tuple(a.shape) != tuple(ref.shape):
        return float("inf")
    if a.numel() == 0:
        return 0.0
    a64, r64 = a.detach().to(torch.float64), ref.detach().to(device=a.device, dtype=torch.float64)
    diff = float((a64 - r64).abs().max())
    scale = float(r64.abs().max())
    if diff != diff:  # NaN
        return float("inf")
    return diff / scale if scale > 0 else diff


def _key_of(model: nn.Module, rt) -> dict[str, str]:
    """``{dedicated canonical name: its first state-dict key}``."""
    out: dict[str, str] = {}
    for k, n in dedicated_names_by_key(model, rt).items():
        out.setdefault(n, k)
    return out


def _gather(model: nn.Module, optimizer: Muon, keys: Mapping[str, str]):
    """Collective: (full params in master dtype, full optimizer state dict)."""
    rt = optimizer.dedicated_state
    sd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, optimizer)
    params = {}
    for n in rt.names:
        ent = osd["dedicated"][n]
        params[n] = ent["master"] if "master" in ent else sd[keys[n]].to(rt.master_dtype[n])
    for n, _ in optimizer.adamw_named_params:
        params[n] = sd[n]
    return params, osd


def _gather_grads(optimizer: Muon) -> dict[str, Optional[torch.Tensor]]:
    """Collective: every trainable param's full gradient (``None`` where it has none). Dedicated
    matrices: the owner's reduced gradient (in the reduce dtype), broadcast from the owner."""
    rt = optimizer.dedicated_state
    reduced = rt.reduced_grads()
    mine = {n: str(g.dtype).split(".")[-1] for n, g in reduced.items() if g is not None}
    metas = gather(mine, what="verify gradient metadata", via=rt.mesh_groups)
    meta = {n: d for m in metas for n, d in m.items()}
    grads: dict[str, Optional[torch.Tensor]] = {}
    for n in rt.names:
        if n not in meta:
            grads[n] = None
            continue
        src = rt.owner_rank[n]
        g = reduced[n] if rt.rank == src else None
        grads[n] = _from_owner(g, rt.shape[n], getattr(torch, meta[n]), src, rt)
    for n, p in optimizer.adamw_named_params:
        g = p.grad
        grads[n] = None if g is None else full_copy(g)
    return grads


def _from_owner(t: Optional[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype, src: int,
                rt: Any) -> torch.Tensor:
    """Collective: the full tensor ``t`` held by global rank ``src`` (``None`` elsewhere) as a copy
    on every rank (broadcast). ``shape`` / ``dtype``: those of ``t``, for the receiving buffers."""
    buf = (t.detach().clone() if rt.rank == src
           else torch.empty(shape, dtype=dtype, device=rt.device))
    rt.mesh_groups.control_collective(
        "state-dict broadcast", lambda g: dist.broadcast(buf, src=src, group=g))
    return buf


def _check_hparams(optimizer: Muon) -> None:
    """Raise :class:`VerificationError` on every rank if the param groups differ across ranks."""
    mine = repr(hparam_groups(optimizer))
    agree_equal(mine, what="verify hyper-parameters", via=optimizer.dedicated_state.mesh_groups,
                error=lambda detail: VerificationError(
                    "dmuon.verify_step: the optimizer's hyper-parameters differ across ranks (each "
                    "rank would update its own matrices with its own values); nothing was updated. "
                    "Per rank: " + detail + ". Make every rank set the same lr / schedule / "
                    "hparams."))


@torch.no_grad()
def _reference(optimizer: Muon, params, grads, osd, ns_dtype_override=None):
    """Single-device step on the gathered tensors: ``(new params, momentum, mu, nu)``."""
    rt = optimizer.dedicated_state
    ded = list(rt.names)
    hp = optimizer.muon_hparams()
    if ns_dtype_override is not None:
        hp = hp._replace(ns_dtype=ns_dtype_override)
    out_p: dict[str, torch.Tensor] = {}
    mom: dict[str, torch.Tensor] = {}
    if ded:
        mp = {n: params[n] for n in ded}
        ms = fmuon.MuonState(step=int(osd["muon_step"]),
                             momentum={n: osd["dedicated"][n]["momentum_buffer"] for n in ded})
        mg = {n: grads[n] for n in ded}
        if any(g is not None for g in mg.values()):  # the pure step, one rank owning everything
            (mp,), (ms,), _ = world_step([mp], [mg], _one_rank_program(rt, mg), [ms], hp,
                                         views=rt.matrices.views,
                                         mults=rt.matrices.hp_mults)
        out_p.update(mp)
        mom = dict(ms.momentum)
    names = [n for n, _ in optimizer.adamw_named_params]
    mu: dict[str, torch.Tensor] = {}
    nu: dict[str, torch.Tensor] = {}
    if names and ns_dtype_override is None:
        ap = {n: params[n] for n in names}
        st = fadamw.AdamWState(step=int(osd["adamw_step"]),
                               mu={n: osd["fsdp2"][n]["exp_avg"] for n in names},
                               nu={n: osd["fsdp2"][n]["exp_avg_sq"] for n in names})
        ag = {n: grads[n] for n in names}
        if any(g is not None for g in ag.values()):
            ap, st = fadamw.update(ag, st, ap, optimizer.adamw_hparams(), impl="reference")
        out_p.update(ap)
        mu, nu = dict(st.mu), dict(st.nu)
    return out_p, mom, mu, nu


def _one_rank_program(rt: Any, grads: Mapping[str, Optional[torch.Tensor]]) -> Any:
    """The step program of the dedicated matrices on one rank (the single-device reference):
    rank ``(0, 0)`` owns every matrix; gradients move in their own dtypes, masters in theirs."""
    master = {n: str(rt.master_dtype[n]) for n in rt.names}
    return step_program({n: (0, 0) for n in rt.names}, rt.shape,
                        {n: str(g.dtype) if (g := grads.get(n)) is not None else master[n]
                         for n in rt.names},
                        master_dtypes=master, shard_size=1, groups=rt.hook_groups,
                        reshard_after_forward=False)


def _max_over_ranks(rt: Any, d: dict[str, float]) -> dict[str, float]:
    got = gather(d, what="verify error maxima", via=rt.mesh_groups)
    return {k: max(g[k] for g in got) for k in d}


@unwrapping_model
def verify_step(model: nn.Module, optimizer: Muon, closure: Optional[Callable[[], Any]] = None,
                *, rtol: Optional[float] = None) -> VerifyReport:
    """Collective: run ``optimizer.step()`` and check it against the single-device update.

    Call it where ``optimizer.step()`` would be (after backward; after ``clip_grad_norm_`` if
    any). It steps the optimizer exactly once, whatever the verdict (except for differing
    hyper-parameters, detected before the step).

    Args:
      model: the model prepared by ``dedicate_params`` (and ``fully_shard``).
      optimizer: its ``dmuon.Muon``.
      closure: optional, as in ``step(closure)``: run first (with grad enabled; it should
        zero the grads, run forward and backward, return the loss), then verified.
      rtol: one tolerance for every tensor; ``None``: per tensor by dtype (module docstring).

    Returns:
      a :class:`VerifyReport`, identical on every rank.

    Raises:
      VerificationError: (an ``AssertionError``) on every rank when an error exceeds its tolerance
        (the message names the worst params, their errors, tolerances and owner ranks), or when the
        hyper-parameters differ across ranks.
      TypeError: ``optimizer`` is not the ``dmuon.Muon`` of ``model``.
    """
    what = "dmuon.verify_step"
    rt = check_optimizer(model, optimizer, what)
    refuse_tp(rt, what)
    refuse_variant(optimizer._owner.custom, what)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    _check_hparams(optimizer)
    keys = _key_of(model, rt)
    before, osd = _gather(model, optimizer, keys)
    grads = _gather_grads(optimizer)

    optimizer.step()

    after, osd_after = _gather(model, optimizer, keys)
    ref_p, ref_m, ref_mu, ref_nu = _reference(optimizer, before, grads, osd)

    hp = optimizer.muon_hparams()
    ns_dtype = hp.ns_dtype or default_ns_dtype(rt.device)
    errors, state_errors, tols = {}, {}, {}
    for n in rt.names:
        errors[n] = rel_err(after[n], ref_p[n])
        state_errors[f"{n}/momentum_buffer"] = rel_err(
            osd_after["dedicated"][n]["momentum_buffer"], ref_m[n])
        low = _lowest(rt.master_dtype[n], ns_dtype)
        tols[n] = rtol if rtol is not None else default_rtol(low)
        tols[f"{n}/momentum_buffer"] = rtol if rtol is not None else default_rtol(rt.master_dtype[n])
    for n, p in optimizer.adamw_named_params:
        errors[n] = rel_err(after[n], ref_p[n])
        t = rtol if rtol is not None else default_rtol(p.dtype)
        tols[n] = t
        for k, ref in (("exp_avg", ref_mu), ("exp_avg_sq", ref_nu)):
            state_errors[f"{n}/{k}"] = rel_err(osd_after["fsdp2"][n][k], ref[n])
            tols[f"{n}/{k}"] = t
    fp64_errors: dict[str, float] = {}
    if rt.names:
        if ns_dtype == torch.float64:
            fp64_errors = {n: errors[n] for n in rt.names}
        else:
            ref64, _, _, _ = _reference(optimizer, before, grads, osd, torch.float64)
            fp64_errors = {n: rel_err(after[n], ref64[n]) for n in rt.names}

    merged = _max_over_ranks(optimizer.dedicated_state, {**{f"p:{k}": v for k, v in errors.items()},
                              **{f"s:{k}": v for k, v in state_errors.items()},
                              **{f"f:{k}": v for k, v in fp64_errors.items()}})
    errors = {k: merged[f"p:{k}"] for k in errors}
    state_errors = {k: merged[f"s:{k}"] for k in state_errors}
    fp64_errors = {k: merged[f"f:{k}"] for k in fp64_errors}
    allerr = {**errors, **state_errors}
    worst = max(allerr, key=allerr.get) if allerr else None
    report = VerifyReport(errors=errors, state_errors=state_errors, tolerances=tols,
                          fp64_errors=fp64_errors, max_error=allerr[worst] if worst else 0.0,
                          worst=worst, loss=loss)
    bad = sorted((k for k, e in allerr.items() if not e <= tols[k]), key=lambda k: -allerr[k])
    if bad:
        def where(k: str) -> str:
            n = k.split("/")[0]
            return f" (owner rank {rt.owner_rank[n]})" if n in rt.owner_rank else " (FSDP2/AdamW)"
        detail = "; ".join(f"{k}: {allerr[k]:.3g} > {tols[k]:.3g}{where(k)}" for k in bad[:8])
        raise VerificationError(
            f"{what}: the distributed step differs from the single-device reference for "
            f"{len(bad)} tensor(s); worst: {detail}"
            + (" ..." if len(bad) > 8 else "")
            + ". Errors are max|dist - ref| / max|ref| after this step. The step was applied.")
    logger.info("%s: ok, max relative error %.3g (%s)", what, report.max_error, worst)
    return report
