"""What FSDP2 did to a model: which modules it took, with which mesh and mixed-precision policy.

dmuon casts dedicated params itself (FSDP2 does not cast ignored params), so it reads the
``MixedPrecisionPolicy`` that ``fully_shard`` got for the innermost module holding each dedicated
param. All
access to FSDP2's private state goes through :mod:`dmuon.compat.torch_api`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch.nn as nn

from dmuon.compat.torch_api import (fsdp_divide_factor, fsdp_mesh, fsdp_mp_policy,
                                   fsdp_param_groups, fsdp_state, wrap_fsdp_post_backward)

__all__ = ["has_fsdp_state", "find_mp_policy", "find_fsdp_state", "fsdp_holders", "mean_to_fsdp_scale", "mean_to_fsdp_scales", "fsdp_meshes", "fsdp_dp_dims", "FSDPGradUsage", "reduce_unused_fsdp_params",
           "keep_fsdp_gathered", "release_fsdp_kept", "drop_unreduced_fsdp_grads",
           "unmanaged_params", "replaced_params"]


def has_fsdp_state(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that already carry FSDP2 (``fully_shard``) state."""
    return [name or "<root>" for name, m in model.named_modules() if fsdp_state(m) is not None]


def find_mp_policy(model: Optional[nn.Module], module: nn.Module) -> Any:
    """The ``MixedPrecisionPolicy`` of the nearest ``fully_shard``-ed module among ``module`` and
    its ancestors inside ``model``; ``None`` when no FSDP2 state covers it."""
    return fsdp_mp_policy(find_fsdp_state(model, module))


def find_fsdp_state(model: Optional[nn.Module], module: nn.Module) -> Any:
    """The FSDP2 state of the nearest ``fully_shard``-ed module among ``module`` and its
    ancestors inside ``model`` (``None`` when none covers it)."""
    if model is None:
        return fsdp_state(module)
    path = next((name for name, m in model.named_modules() if m is module), None)
    chain = [model]
    if path:
        parts = path.split(".")
        chain += [model.get_submodule(".".join(parts[: i + 1])) for i in range(len(parts))]
    for m in reversed(chain):
        st = fsdp_state(m)
        if st is not None:
            return st
    return None


def fsdp_holders(model: Optional[nn.Module], names: Any, module_of: Any) -> dict[str, Any]:
    """``{name: FSDP2 state}`` of the innermost ``fully_shard``-ed module holding each param of
    ``names`` (``None``: none does): its ``MixedPrecisionPolicy`` (FSDP2 casts that module's
    inputs to its ``param_dtype``) and gradient divide factor apply to the param. Without a
    model, ``module_of(name)``'s own state."""
    if model is None:
        return {n: find_fsdp_state(None, module_of(n)) for n in names}
    found: dict[str, Any] = {}

    def state_of(path: str) -> Any:
        if path not in found:
            st = fsdp_state(model.get_submodule(path) if path else model)
            found[path] = st if st is not None or not path else state_of(path.rpartition(".")[0])
        return found[path]
    return {n: state_of(n.rpartition(".")[0]) for n in names}


def mean_to_fsdp_scale(state: Any, ranks: int) -> Optional[float]:
    """The factor that turns a mean over ``ranks`` data-parallel ranks into what FSDP2 gives the
    params of ``state`` (``set_gradient_divide_factor(f)``, torchtitan's 1.0: the sum / ``f``);
    ``None`` when that is the mean itself."""
    f = fsdp_divide_factor(state)
    return None if f is None or f == ranks else ranks / f


def mean_to_fsdp_scales(states: list[Any], ranks: int) -> list[Optional[float]]:
    """:func:`mean_to_fsdp_scale` of each of ``states``, read once per distinct state (the
    grads of one reduce mostly share one; read when asked, never kept: a user may call
    ``set_gradient_divide_factor`` between steps)."""
    read: dict[int, Optional[float]] = {}
    for st in states:
        if id(st) not in read:
            read[id(st)] = mean_to_fsdp_scale(st, ranks)
    return [read[id(st)] for st in states]


def fsdp_meshes(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """``(module name, ranks of the mesh, device type)`` of every FSDP2 param group in ``model``
    (every group: a module sharded with several meshes through ``shard_placement_fn`` has one
    per mesh)."""
    out = []
    for name, m in model.named_modules():
        for group in fsdp_param_groups(fsdp_state(m)):
            mesh = fsdp_mesh(group)
            if mesh is not None:
                out.append((name, tuple(int(x) for x in mesh.mesh.flatten().tolist()),
                            str(mesh.device_type)))
    return out


def fsdp_dp_dims(model: nn.Module) -> list[tuple[str, Optional[tuple[tuple[str, ...], ...]]]]:
    """``(module name, (shard names, replicate names) or None)`` of every FSDP2 param group in
    ``model``: the ``dp_mesh_dims`` its ``fully_shard`` call got (``None``: none, or a torch
    without them)."""
    def names(v: Any) -> tuple[str, ...]:
        return () if v is None else (v,) if isinstance(v, str) else tuple(v)
    out = []
    for name, m in model.named_modules():
        for group in fsdp_param_groups(fsdp_state(m)):
            dims = getattr(getattr(group, "mesh_info", None), "dp_mesh_dims", None)
            out.append((name, None if dims is None else (names(dims.shard),
                                                         names(dims.replicate))))
    return out


class FSDPGradUsage:
    """Which FSDP2 params got a gradient on this rank since the last step, and which had none
    before (``grad is None`` when this window's first backward reached FSDP2), recorded as FSDP2's
    ``post_backward`` starts, before its reduce-scatter. With ``set_reduce_scatter_unused_params``
    FSDP2 gives a param that no rank used a zero gradient; a single-device optimizer would see
    ``None`` and skip it. ``zeros_sent=False`` (a torch without that switch): nothing recorded,
    :meth:`local_flags` reports which params have a gradient now."""

    def __init__(self, zeros_sent: bool = True) -> None:
        self.zeros_sent = zeros_sent
        self._used: dict[int, bool] = {}
        self._none_before: dict[int, bool] = {}

    def record(self, params: list[tuple[Any, bool]]) -> None:
        """One group's ``post_backward`` is starting (``params``: (sharded param, has a local
        gradient))."""
        for p, used in params:
            k = id(p)
            if k not in self._none_before:
                self._none_before[k] = p.grad is None
            self._used[k] = self._used.get(k, False) or used

    def local_flags(self, params: Sequence[Any]) -> tuple[list[bool], list[bool]]:
        """``(used here, grad was None before)`` of each of ``params`` in this window
        (``zeros_sent=False``: ``(has a gradient now, [])``)."""
        if not self.zeros_sent:
            return [p.grad is not None for p in params], []
        return ([self._used.get(id(p), False) for p in params],
                [self._none_before.get(id(p), False) for p in params])

    def reset(self) -> None:
        """A step consumed the gradients, or ``zero_grad`` dropped them: a new window."""
        self._used.clear()
        self._none_before.clear()


def reduce_unused_fsdp_params(model: nn.Module) -> Optional[FSDPGradUsage]:
    """Make FSDP2 include a zero gradient for a param that got none on this rank (a param used on
    some ranks only, e.g. a bias of an MoE expert that got no token here), so that every rank's
    reduce-scatter covers the same params. Without it, ranks that used different params
    reduce-scatter different tensors of equal size into each other, silently (measured on torch
    2.13, gloo). This is FSDP2's own ``set_reduce_scatter_unused_params(True)``.

    Under it FSDP2 gives a param that no rank used a zero gradient (not ``None``), so AdamW would
    apply its moment decay and weight decay to it where a single-device optimizer skips it: the
    returned :class:`FSDPGradUsage` records, per rank, which params had a gradient before FSDP2's
    reduce-scatter, for ``dmuon.Muon.step`` to put ``None`` back where no rank had one
    (:func:`dmuon.stateful.optimizer.step_checks.agree_before_step`). Dedicated matrices are
    not affected: dmuon reduces them itself and skips those no rank had a gradient for.

    Returns:
      ``None`` when this torch's FSDP2 has no such switch (nothing was changed).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return None
    found = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not found or not all(hasattr(m, "set_reduce_scatter_unused_params") for m in found):
        return None
    usage = FSDPGradUsage()
    for m in found:
        m.set_reduce_scatter_unused_params(True, recurse=False)
        for group in fsdp_param_groups(fsdp_state(m)):
            wrap_fsdp_post_backward(group, usage.record)
    return usage


def keep_fsdp_gathered(model: nn.Module) -> list[Any]:
    """Keep FSDP2's params of ``model`` gathered after the current backward: a ``create_graph``
    backward (an R1 / WGAN-GP gradient penalty) builds a graph that reads them again in the next
    backward (e.g. a LayerNorm / RMSNorm double backward reads the norm weight), and FSDP2 frees
    them at its post-backward: torch then reads freed storage (SIGSEGV on torch 2.13). This is
    FSDP2's own ``set_reshard_after_backward(False)``, on each param group that has it on.

    Returns:
      the groups switched, for :func:`release_fsdp_kept`.
    """
    groups = fsdp_groups(model)
    if any(not hasattr(g, "reshard_after_backward") for g in groups):  # a torch that renamed it
        raise RuntimeError("dmuon: this torch's FSDP2 param groups have no reshard_after_backward, "
                           "so a create_graph backward would read params FSDP2 freed: call "
                           "model.set_reshard_after_backward(False) before torch.autograd.grad"
                           "(..., create_graph=True) and True before the final backward")
    kept = [g for g in groups if g.reshard_after_backward is True]
    for g in kept:
        g.reshard_after_backward = False
    return kept


def release_fsdp_kept(groups: list[Any]) -> list[Any]:
    """Undo :func:`keep_fsdp_gathered`: ``reshard_after_backward`` back on and each group resharded
    now (its next forward all-gathers the current values; after a step, the kept copy is stale).
    Returns ``[]`` (nothing kept any more)."""
    for g in groups:
        g.reshard_after_backward = True
        g.reshard()
    return []


def fsdp_groups(model: nn.Module) -> list[Any]:
    """Every FSDP2 param group of ``model``'s ``fully_shard`` modules."""
    return [g for m in model.modules() for g in fsdp_param_groups(fsdp_state(m))]


def reshard_unsharded(groups: Sequence[Any]) -> None:
    """Reshard each of FSDP2's param ``groups`` that holds an unsharded copy, before a step writes
    the shards. FSDP2 frees that copy in a backward (or after a Z3 forward); one left by a forward
    no backward followed (a ``torch.no_grad()`` pass between the backward and the step: FSDP2's
    root, ``reshard_after_forward=False`` modules) would serve the next forward stale values
    (measured on torch 2.13 with torch's AdamW and no dmuon: 1.4e-2 / 3.0e-2 after 3 steps; FSDP2
    leaves it to the user's ``module.reshard()``). Local, no collective."""
    for g in groups:
        if not g.is_sharded:
            g.reshard()


def unmanaged_params(model: nn.Module, named: Sequence[tuple[str, Any]]) -> list[str]:
    """The names in ``named`` (``(name, param)``) that no FSDP2 param group of ``model`` manages as
    its sharded param: a param of a module replaced after ``fully_shard``, one that a later
    ``fully_shard`` replaced, or an unsharded copy a forward left (:func:`reshard_unsharded`
    first)."""
    managed = {id(fp.sharded_param) for g in fsdp_groups(model) for fp in g.fsdp_params}
    return [n for n, p in named if id(p) not in managed]


def replaced_params(model: nn.Module, groups: Sequence[Any],
                    named: Sequence[tuple[str, Any]]) -> list[str]:
    """The names in ``named`` whose param ``model`` no longer holds (a ``fully_shard`` or a module
    replacement after they were collected); FSDP2's ``groups`` resharded first (a forward's
    unsharded params are not the model's own)."""
    reshard_unsharded(groups)
    live = {id(p) for p in model.parameters()}
    return [n for n, p in named if id(p) not in live]


def drop_unreduced_fsdp_grads(groups: Sequence[Any]) -> None:
    """Drop the gradients FSDP2's param ``groups`` hold not yet reduced: a backward under
    ``set_requires_gradient_sync(False)`` (``dmuon.no_sync``, or FSDP2's own knob) leaves them on
    the unsharded params, and one under ``set_requires_all_reduce(False)`` (HSDP) leaves the
    group's reduce-scattered part, where ``optimizer.zero_grad()`` (over the sharded params) does
    not reach; FSDP2's next synced backward adds them to its reduction (measured on torch 2.13,
    with or without dmuon: a micro-batch thrown away by ``zero_grad()`` still moved the next
    step). ``dmuon.Muon.zero_grad`` calls it, so that it drops every gradient, as a single-device
    ``zero_grad`` does."""
    for group in groups:
        if getattr(group, "_partial_reduce_output", None) is not None:
            group._partial_reduce_output = None
        for fp in getattr(group, "fsdp_params", ()):
            if not isinstance(getattr(type(fp), "unsharded_accumulated_grad", None), property):
                fp.unsharded_accumulated_grad = None  # (torch 2.15: a view of the param's .grad)
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
