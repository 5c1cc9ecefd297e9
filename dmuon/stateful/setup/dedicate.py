"""``dedicate_params``: take Muon's matrices away from FSDP2 and give each, whole, to one owner
rank (collective; before ``fully_shard``). Every check runs on every rank with the verdict agreed
before any process group is made. Design notes: docs/design/setup.md, "`dedicate_params`"."""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.functional.buckets import ROOT_GROUP, boundary_groups
from dmuon.functional.collectives import check_choice, mode_collectives
from dmuon.functional.dedicate_options import DedicateOptions, check_options, fold_deprecated
from dmuon.functional.setup_check import already_dedicated, ddp_grid, deferral_agreed
from dmuon.functional.plan import plan_owners
from dmuon.functional.program import check_reshard_after_forward
from dmuon.functional.specs import layer_key_from_name, specs_from_named_shapes
from dmuon.functional.tp_setup import tp_decisions, tp_mesh_ranks
from dmuon.compat.mesh_timeouts import bound_mesh_groups
from dmuon.compat.spmd_mesh import axes_mesh
from dmuon.functional.spmd_mesh import spmd_meshes
from dmuon.compat.torch_api import (default_group_timeout, torch_supported,
                                   unsupported_torch_message)
from dmuon.stateful.modes.ddp import guard_fsdp_mode, install_ddp_mode
from dmuon.stateful.runtime.executor import Executor
from dmuon.compat.fsdp_patch import DEDICATED_ATTR, install_fully_shard_patch
from dmuon.stateful.runtime.hooks import register_hooks
from dmuon.compat.fsdp_info import has_fsdp_state
from dmuon.stateful.runtime.guards import guard_module_apply
from dmuon.functional.policy import (as_policy, decide_params, policy_fingerprint,
                                     routing_predicate)
from dmuon.functional.matrix_settings import matrix_settings
from dmuon.functional.routing import Dedication, model_routing_table
from dmuon.functional.selection import check_materialized, names_by_object, select_params
from dmuon.stateful.modes.meta_init import MetaInit, device_of_mesh, empty_param, replace_params
from dmuon.stateful.runtime.agree import agree_equal, gather
from dmuon.stateful.runtime.process_groups import agree_grids, make_process_groups, with_split_groups
from dmuon.stateful.modes.deferred import covers_world, defer, find_pending, should_defer
from dmuon.stateful.modes.tensor_parallel import (TP_FIX, TensorParallelUnsupported, TPForward,
                                                  tp_layouts)
from dmuon.stateful.runtime.state import STATE_ATTR, DedicatedState, find_state, local_tensor
from dmuon.stateful.setup.release import ReleasedState
from dmuon.stateful.checkpoint.torch_state_dict import register_state_dict_hooks

logger = logging.getLogger(__name__)

Predicate = Callable[[str, torch.Tensor], bool]


def _select(model: nn.Module, predicate: Predicate,
            finishing: bool = False) -> tuple[list, dict[str, nn.Parameter]]:
    """This rank's local checks and the dedicated params ``{name: param}`` (raises on bad input;
    ``finishing``: a deferred dedication, after ``fully_shard``)."""
    fsdp_mods = [] if finishing else has_fsdp_state(model)
    if fsdp_mods:
        raise RuntimeError(
            "dedicate_params must run before fully_shard, but these modules already have FSDP2 "
            f"state: {fsdp_mods[:5]}{' ...' if len(fsdp_mods) > 5 else ''}. Call "
            "dmuon.dedicate_params(model, mesh, predicate) first, then fully_shard.")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # dedups tied params
    return named, select_params(named, predicate, type(model).__name__)


def _agree_deferral(local_err: Optional[Exception], mesh: Any, replicate_mesh: Any,
                    wants: bool) -> bool:
    """Collective: whether every rank defers (:mod:`dmuon.stateful.modes.deferred`;
    :func:`dmuon.functional.setup_check.deferral_agreed`). Otherwise the setup check that follows
    raises on every rank, naming what is wrong."""
    try:
        meshes = (mesh,) if replicate_mesh is None else (mesh, replicate_mesh)
        mine = tuple(sorted(int(x) for m in meshes for x in m.mesh.flatten().tolist()))
    except AttributeError:
        mine = ()
    err = None if local_err is None else (type(local_err).__name__, str(local_err))
    return deferral_agreed(gather((err, mine, bool(wants)),
                                  what="dedicate_params deferral agreement"))


def _agree_setting(name: str, value: Any) -> None:
    """All-gather the setting ``name``'s ``value``; raise on every rank if the ranks passed
    different ones."""
    agree_equal(value, what=f"dedicate_params {name} agreement", show=repr,
                error=lambda detail: RuntimeError(
                    f"dedicate_params: {name} differs across ranks ({detail}); pass the same "
                    "value on every rank. Nothing was changed."))


def dedicate_params(
    model: nn.Module,
    mesh: Any,
    predicate: Predicate,
    *,
    replicate_mesh: Any = None,
    hook_boundary_predicate: Optional[Callable[[nn.Module], bool]] = None,
    reshard_after_forward: bool = True,
    options: Optional[DedicateOptions] = None,
    **deprecated: Any,
) -> dict[nn.Parameter, int]:
    """Dedicate every matrix ``predicate`` selects to one owner rank (collective; before fully_shard).

    Args:
      model: the model, not yet ``fully_shard``-ed, the same on every rank; materialized, or
        built whole on the meta device (then ``to_empty`` + init after ``fully_shard``; the
        dedicated params become new ``nn.Parameter`` objects, see
        :mod:`dmuon.stateful.modes.meta_init`).
      mesh: the 1-D shard ``DeviceMesh`` (the one passed to ``fully_shard``), or a 2-D mesh with
        dims ``("replicate", "shard")``; with ``options.dp_mesh_dims``, the full SPMD mesh.
      predicate: ``predicate(name, param) -> bool`` picks the Muon matrices (``ndim >= 2``); every
        other trainable param stays with FSDP2 and AdamW.
      replicate_mesh: optional replicate mesh, 1-D or N-D (its ranks row-major as one axis): HSDP.
      hook_boundary_predicate: ``module -> bool``; a param is moved by the hooks of its lowest
        accepted ancestor. Default: the ``layers.N`` / ``blocks.N`` ancestor. Params outside any
        boundary go to a root group moved by the model's own hooks.
      reshard_after_forward: True (Z3): free gathered copies after forward, re-gather in backward;
        False (Z2): keep them from forward to the end of backward.
      options: :class:`dmuon.DedicateOptions` (the per-param ``policy``, ``mp_policy``,
        ``batch_dims``, ``data_parallel``, ``timeout``, ``split_ns``, ``collectives``); their
        former spelling as keyword arguments here works for one release (``DeprecationWarning``).

    Returns:
      the owner global rank of every dedicated param, as ``{param -> rank}`` (tied params once), a dict
        whose ``.routing`` is the routing table (every param → Muon with its view / AdamW / frozen,
        and the rule or predicate that decided; ``print(...)`` it; :mod:`dmuon.functional.routing`);
        ``{}`` when the dedication is deferred to ``dmuon.Muon(model)`` (``mesh`` is the dp sub-mesh of
        a mesh with a TP dim and TP is not applied yet, or the TP params are on meta:
        :mod:`dmuon.stateful.modes.deferred`).
    Every check runs on every rank before any process group is made: a problem on one rank
    raises on all (that rank's own exception there, its message elsewhere), never a hang.

    Raises:
      RuntimeError: torch.distributed is not initialized; the model already has FSDP2 state or was
        already dedicated; the predicate raised (the message names the param); the owner plan
        differs across ranks.
      ValueError: the predicate matches nothing, or matches a non-matrix; some selected params
        are on the meta device and others not;
        the meshes do not match the world (ranks, R x G, device type; see
        :func:`dmuon.functional.setup_check.check_setups`).
      NotImplementedError: a TP layout or TP combination dmuon does not support
        (:mod:`dmuon.stateful.modes.tensor_parallel`).
      ValueError: ``data_parallel`` is not ``"fsdp"`` / ``"ddp"``, or ``"ddp"`` with a 2-D / HSDP
        mesh; RuntimeError: ranks passed different ``data_parallel``.
    """
    options, notes = fold_deprecated(options, deprecated)
    for note in notes:
        warnings.warn(note, DeprecationWarning, stacklevel=2)
    return _dedicate(model, mesh, predicate, options, hook_boundary_predicate,
                     reshard_after_forward, spmd_meshes(mesh, replicate_mesh,
                                                        options.dp_mesh_dims, sub_mesh=axes_mesh))


def _dedicate(model: nn.Module, mesh: Any, predicate: Predicate, options: DedicateOptions,
              hook_boundary_predicate: Optional[Callable[[nn.Module], bool]],
              reshard_after_forward: bool, spmd: tuple, *,
              finishing: bool = False) -> dict[nn.Parameter, int]:
    """:func:`dedicate_params`; ``spmd``: ``spmd_meshes``' (shard mesh, replicate mesh, axes,
    error); ``finishing``: a deferred one."""
    full_mesh, (mesh, replicate_mesh, axes, spmd_err) = mesh, spmd
    data_parallel, timeout = options.data_parallel, options.timeout
    if not torch_supported():
        raise RuntimeError(unsupported_torch_message("dmuon.dedicate_params"))
    if (old := find_state(model)) is not None or (find_pending(model) and not finishing):
        raise RuntimeError(already_dedicated(isinstance(old, ReleasedState)))
    install_fully_shard_patch()  # idempotent; back in place if it was removed
    if not dist.is_initialized():
        check_options(options)  # no peers to agree with: a wrong argument is named first
        raise RuntimeError("dedicate_params needs torch.distributed: call "
                           "torch.distributed.init_process_group(...) first")
    # local checks may fail on some ranks only: agree first (one all-gather), so every rank
    # raises and none is left waiting in a collective the others never reach
    chosen: dict[str, nn.Parameter] = {}
    layouts: dict = {}
    views: dict = {}  # dedicated DTensors on a full SPMD mesh, whole (TP: in layouts)
    routing = None
    deferring = False
    local_err: Optional[Exception] = None
    max_split, force_split, collectives = 1, None, "per_owner"
    try:
        max_split, force_split, collectives = check_options(options)
        check_reshard_after_forward(reshard_after_forward)
        if spmd_err is not None:
            raise spmd_err
        pol = as_policy(options.policy)
        named, chosen = _select(model, routing_predicate(pol, predicate, model), finishing)
        # the dp sub-mesh of a (dp, tp) mesh before TP, or TP params on meta: later (deferred.py)
        deferring = not finishing and should_defer(chosen, axes is not None
                                                   or not covers_world(mesh, replicate_mesh))
        if finishing:
            check_materialized(chosen)
        if not deferring:
            # TP-sharded DTensors or spmd_types slices (tensor_parallel.py)
            layouts, views = tp_layouts(model, chosen, axes, full_mesh)
            check_choice(collectives, data_parallel, tp=bool(layouts), split=max_split > 1)
            decisions = tp_decisions(decide_params(model, chosen, pol, options.batch_dims),
                                     {n: lay.view() for n, lay in layouts.items()},
                                     data_parallel=data_parallel, fix=TP_FIX,
                                     on_meta=any(p.is_meta for p in chosen.values()),
                                     error=TensorParallelUnsupported)
            spec_named = [(n, tuple(local_tensor(p).shape), p.dtype) if n in layouts else (n, p)
                          for n, p in named]
            routing = model_routing_table(model, pol, decisions, predicate)
            specs = specs_from_named_shapes(spec_named, lambda n, p: n in chosen,
                                            view_fn=lambda n, shape: decisions[n].view)
    except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
        local_err = e
    on_meta = bool(chosen) and all(p.is_meta for p in chosen.values())
    if not finishing and _agree_deferral(local_err, full_mesh, None if axes else replicate_mesh,
                                         deferring):
        # TP (or the values) come later: finished by dmuon.Muon(model) (deferred.py)
        _agree_setting("data_parallel", data_parallel)
        names = set(chosen)
        defer(model, chosen, lambda m: _dedicate(
            m, full_mesh, lambda n, p: n in names, options, hook_boundary_predicate,
            reshard_after_forward, spmd, finishing=True))
        logger.info("dmuon: dedication of %d params deferred to dmuon.Muon(model) (TP after "
                    "dedicate_params)", len(chosen))
        return Dedication()
    grids = agree_grids(mesh, replicate_mesh, local_err=local_err,
                        param_device_types=[str(mesh.device_type) if p.is_meta else p.device.type
                                            for p in chosen.values()],
                        tp_ranks=tp_mesh_ranks(layouts))
    _agree_setting("data_parallel", data_parallel)
    _agree_setting("collectives", collectives)
    timeout = timeout or default_group_timeout(str(mesh.device_type))
    if len(grids) > 1:  # tensor parallelism: one dp grid per TP index
        mesh_groups = make_process_groups(tp_grids=grids, timeout=timeout)
    else:
        grid = ddp_grid(grids[0]) if data_parallel == "ddp" else grids[0]  # raises on all or none
        mesh_groups = make_process_groups(grid=grid, timeout=timeout)
    plan = plan_owners(specs, mesh_groups.shard_size, mesh_groups.replicate_size,
                       max_split=max_split, force_split=force_split)
    # every rank's owner plan (and policy) the same: else raise on every rank
    agree_equal(policy_fingerprint(plan.fingerprint, pol), what="owner-plan fingerprint all-gather",
                via=mesh_groups, show=lambda fp: fp[:12], error=lambda detail: RuntimeError(
                    "dedicate_params: the owner plan differs across ranks (" + detail + "). Every "
                    "rank must build the same model (same names, shapes, dtypes) and pass the same "
                    "predicate, policy (its rules, dtypes included), mesh and settings."))
    if plan.splits:  # one process group per split unit's members (every rank makes every one)
        mesh_groups = with_split_groups(mesh_groups, [sp.members for sp in plan.splits])
    bound_mesh_groups((mesh, replicate_mesh), timeout, logger)
    chosen = {**chosen, **replace_params(  # TP: plain local slices from here on
        model, {n: chosen[n] for n, lay in {**layouts, **views}.items() if not lay.local},
        lambda p: nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad))}
    meta_shapes = meta_device = None
    if on_meta:  # meta-device init: new real-device param objects, no values (meta_init.py)
        meta_device = device_of_mesh(mesh)
        meta_shapes = {n: tuple(p.shape) for n, p in chosen.items()}
        chosen = replace_params(model, chosen, lambda p: empty_param(p, meta_device))

    # a param shared by several modules (tied weights) is moved by the boundary of all its uses
    by_id = names_by_object(model.named_parameters(remove_duplicate=False))
    aliases = {n: by_id[id(p)] for n, p in chosen.items()}
    accepts = None if hook_boundary_predicate is None else (
        lambda path: hook_boundary_predicate(model.get_submodule(path)))
    groups = boundary_groups(aliases, accepts, [m for m, _ in model.named_modules()])
    group_modules = {k: (model if k == ROOT_GROUP else model.get_submodule(k))
                     for k in groups.order}

    if hook_boundary_predicate is None and all(
            layer_key_from_name(a) is None for names in aliases.values() for a in names):
        logger.info(
            "dmuon: no dedicated param lies under a layers.N / blocks.N module, so all %d are in "
            "one root hook group, gathered for the whole forward (groups: %s). Pass "
            "hook_boundary_predicate=lambda m: ... to dedicate_params to move them per block.",
            len(chosen), [k or "<root>" for k in groups.order])
    executor = Executor(mesh_groups)
    st = DedicatedState(
        model=model, params=chosen, plan=plan, mesh_groups=mesh_groups, executor=executor,
        groups=groups, group_modules=group_modules,
        reshard_after_forward=reshard_after_forward, mp_policy=options.mp_policy,
        meta_shapes=meta_shapes, meta_device=meta_device,
        matrices=matrix_settings(decisions, specs, chosen),
        tp_layouts=layouts, data_parallel=data_parallel, dp_dims=axes and (axes.shard, axes.replicate),
        collectives=mode_collectives(collectives, data_parallel, tp=bool(layouts)),
        # model.state_dict()'s DTensor rows: over the 1-D shard mesh (DDP mode: plain tensors)
        shard_mesh=None if data_parallel == "ddp" else (mesh["shard"] if mesh.ndim == 2
                                                         else mesh))
    if meta_shapes is not None:  # the masters have no values yet: the init writes them
        st.meta_init = MetaInit.open(st)
    for n, p in chosen.items():
        setattr(p, DEDICATED_ATTR, st.owner_rank[n])
        p._dmuon_name = n  # named by the placeholder guard's errors (dmuon.stateful.runtime.guards)
        p._dmuon_shape = st.shape[n]  # what a placeholder reports as its shape / numel()
        p._dmuon_group = st.group_of[n]  # its hook group ("": the model's), named there too
    if data_parallel == "ddp":
        install_ddp_mode(model, st)
    else:
        guard_fsdp_mode(model)
    st.hook_handles += register_hooks(model, st)  # kept: dmuon.release removes them
    # after the group hooks: a module sees its gathered TP slice as TP's DTensor; state-dict hooks
    st.hook_handles += (TPForward(model, {**layouts, **views}, st.group_of, group_modules).handles
                        + register_state_dict_hooks(model, st).handles)
    guard_module_apply(model, list(chosen.values()))
    setattr(model, STATE_ATTR, st)
    logger.info("dmuon: dedicated %d params in %d hook groups over G=%d R=%d (plan %s)",
                len(chosen), len(groups.order), st.G, st.R, plan.fingerprint[:12])
    st.routing = routing.with_owners(st.owner_rank)  # Muon.routing_table(); recipes log it
    for note in routing.notes:  # likely heads kept off Muon, embeddings a predicate puts on it
        logger.warning(note)
    out = Dedication({chosen[n]: st.owner_rank[n] for n in chosen})
    out.routing = st.routing
    return out
