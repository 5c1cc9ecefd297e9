"""Optimizer state dicts of ``dmuon.Muon``: torch's protocol (``Muon.state_dict()``, DCP), dmuon's
full format (:func:`get_optimizer_state_dict`), both topology-free, and one load path
(:func:`load_optimizer_state`) that checks every value on every rank and agrees the verdict before
anything changes.

Design notes: docs/design/checkpoint.md, "dmuon.stateful.checkpoint.optimizer_state_dict".
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from dmuon.compat.torch_api import held_local
from dmuon.functional import adamw as fadamw
from dmuon.functional.copy_log import OPTIMIZER
from dmuon.functional.stages.hparams import as_step
from dmuon.functional.load_scalars import counters, load_problems, skipped_counts
from dmuon.functional.optimizer_format import (
    MOMENTS as _MOMENTS, SKIPPED, from_torch_protocol, full_dict_problems, full_dict_structure,
    full_entries, hparams, loadable_hparams, optimizer_state_problems, to_torch_protocol)
from dmuon.stateful.runtime.state import get_state, local_tensor
from dmuon.compat.wrappers import unwrapping_model
from dmuon.stateful.checkpoint.state_dict import from_rank0, full_copy
from dmuon.stateful.checkpoint.torch_state_dict import (
    StateDictError, agree, check_unloaded, distribute_like, dtensor_rows, layout_problem,
    log_narrowing)
from dmuon.stateful.modes.tensor_parallel import refuse_tp
from dmuon.stateful.checkpoint.owner_fields import (entry_shape, gather_fields, layout_of,
                                                    stage_fields)

__all__ = ["get_optimizer_state_dict", "set_optimizer_state_dict", "load_optimizer_state",
           "torch_optimizer_state_dict", "torch_load_optimizer_state_dict"]


def check_optimizer(model: nn.Module, optimizer: Any, what: str):
    """The model's state; ``TypeError`` unless ``optimizer`` is ``model``'s ``dmuon.Muon``."""
    rt = get_state(model, what)
    if getattr(optimizer, "dedicated_state", None) is not rt:  # only model's dmuon.Muon has it
        raise TypeError(f"{what}: optimizer must be the dmuon.Muon built for this model")
    return rt


def hparam_groups(optimizer: Any) -> list[dict[str, Any]]:
    return [hparams(g) for g in optimizer.param_groups]


def dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """``local`` (this rank's piece) as a DTensor laid out like the FSDP2 param ``like`` (no
    communication); ``local`` itself when ``like`` is a plain tensor."""
    if not hasattr(like, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def muon_step(optimizer: Any) -> int:
    """The owner's step count (``num_steps`` on a rank that owns nothing): every rank's count."""
    return int(optimizer._owner.step_count if optimizer.dedicated_state.owned_names
               else optimizer.num_steps)


# ---------------------------------------------------------------------------------- torch's
@torch.no_grad()
@torch.inference_mode(False)  # the copies keep version counters (the copy log reads them)
def torch_optimizer_state_dict(optimizer: Any) -> dict[str, Any]:
    """Collective: ``Muon.state_dict()`` in torch's protocol (design notes)."""
    rt = optimizer.dedicated_state
    refuse_tp(rt, "Muon.state_dict() (torch's protocol; use dmuon.get_optimizer_state_dict)")
    rt.join("optimizer.state_dict()", always=True, drain=True)  # torch.save(...) on rank 0
    check_unloaded(rt, [OPTIMIZER], "Muon.state_dict()")
    st, owner, step = optimizer.adamw_state, optimizer._owner, float(muon_step(optimizer))
    entries = {n: {**{k: dtensor_rows(v, rt.shard_mesh) if layout_of(optimizer, k) == "param"
                      else v for k, v in e.items()},  # a variant's smaller fields: full tensors
                   "step": torch.tensor(step)}  # every rank's: DCP stores one rank's copy
               for n, e in gather_fields(optimizer).items()}
    torch_form = fadamw.torch_entries(st, optimizer.adamw_skipped) if st is not None else {}
    for n, p in optimizer.adamw_named_params:  # (torch.optim.AdamW's per-param counts)
        entries[n] = {k: v if k == "step" else dtensor_like(v, p) for k, v in torch_form[n].items()}
    own = [(f"{k} of {n}", v) for n, e in entries.items() for k, v in e.items()
           if n in rt.params or k == "step"]  # copies (AdamW's moments are its own tensors)
    rt.state_dict_copies.handed_out(OPTIMIZER, own, held_local)
    groups = [(hparams(g), [optimizer.param_name(p) for p in g["params"]])
              for g in optimizer.param_groups]
    scalars = {"variant_scalars": owner.scalars()} if owner.custom else {}  # the chain's counts
    return to_torch_protocol(groups, entries, num_steps=int(optimizer.num_steps), **scalars)


def torch_load_optimizer_state_dict(optimizer: Any, state_dict: Mapping[str, Any]) -> None:
    """``Muon.load_state_dict``: torch's protocol (from any topology: params matched by
    ``param_names`` where the groups carry them, else by position), or dmuon's full format."""
    optimizer.dedicated_state.join("optimizer.load_state_dict(sd)", always=True)
    if isinstance(state_dict, Mapping) and "fsdp2" in state_dict and "dedicated" in state_dict:
        return load_optimizer_state(optimizer, full_entries(state_dict),
                                    what="Muon.load_state_dict")
    refuse_tp(optimizer.dedicated_state, "Muon.load_state_dict with torch's protocol (load "
              "dmuon.get_optimizer_state_dict's dict instead)")
    mine = [optimizer.param_name(p) for g in optimizer.param_groups for p in g["params"]]
    entries = from_torch_protocol(state_dict, mine, optimizer.dedicated_state.params)
    if entries is None:
        raise StateDictError("Muon.load_state_dict: expected {'state', 'param_groups'} (from "
                             "Muon.state_dict() or torch's get_optimizer_state_dict) or dmuon's "
                             "{'fsdp2', 'dedicated', ...} (dmuon.get_optimizer_state_dict)")
    load_optimizer_state(optimizer, entries, what="Muon.load_state_dict")


# ---------------------------------------------------------------------------------- one load path
@torch.no_grad()
def load_optimizer_state(optimizer: Any, entries: Mapping[str, Any], *, what: str,
                         check_finite: bool = True, rank0: bool = False) -> None:
    """Collective: validate, stage and install an optimizer state (design notes: "One load path").

    Args:
      entries: ``{"dedicated": {name: {"momentum_buffer": v[, "master": v]}}, "fsdp2": {name:
        {"exp_avg": v, "exp_avg_sq": v}}, "adamw_step", "muon_step", "num_steps",
        "param_groups"}``. A dedicated ``v``: a full tensor, or a ``Shard(0)`` DTensor of dmuon's
        rows. An FSDP2 ``v``: a full tensor, a DTensor laid out like the param, or this rank's
        local piece (``dmuon.load_sharded``). An empty section keeps zeros (a checkpoint taken
        before the first step).
      rank0: only global rank 0 holds the dict's values (``rank0_only``; elsewhere
        ``entries["dedicated"]`` names the same keys with ``None`` values, and only rank 0 checks
        them): the dedicated ones move from it through
        :meth:`~dmuon.stateful.checkpoint.transfer.CheckpointTransfer.from_rank0`.
    """
    rt = optimizer.dedicated_state
    has_dict = not rank0 or rt.rank == 0
    rt.drain()
    problems, notes = [], []
    ded, fsdp, owner = entries.get("dedicated") or {}, entries.get("fsdp2") or {}, optimizer._owner
    if has_dict:
        keys = [f.key for f in owner.fields]
        problems = optimizer_state_problems(
            ded, fsdp, fields=keys, finite=check_finite, notes=notes,
            matrices={n: {k: (entry_shape(optimizer, n, k), rt.master_dtype[n])
                          for k in keys + ["master"]} for n in rt.params},
            adamw={n: (tuple(p.shape), tuple(local_tensor(p).shape), p.dtype)
                   for n, p in optimizer.adamw_named_params},
            layout=lambda v: layout_problem(v, rt), live=optimizer.adamw_state,
            more=load_problems(entries, optimizer.param_groups,
                               scalars=len(owner.scalars())))
        log_narrowing(notes)
    agree(rt, problems, what, route="optimizer")
    steps = counters(entries)
    # stage: new functional states filled from the entries (nothing live changes yet)
    st = fadamw.init(optimizer.adamw_local_tensors()[0]) if optimizer.adamw_named_params else None
    if st is not None and fsdp:
        for n, p in optimizer.adamw_named_params:
            for k, dst in zip(_MOMENTS, (st.mu[n], st.nu[n])):
                dst.copy_(_local_piece(fsdp[n][k], p).to(dtype=dst.dtype))
    # every field of the chain by name, and the masters (an empty section: before the first step)
    staged_fields = stage_fields(optimizer, ded, rank0=rank0) if ded else None
    staged_masters = staged_fields.pop("master") if ded else {}
    # install (the only writes to live state)
    groups = entries.get("param_groups") or []
    by_name = {g.get("name"): g for g in groups if isinstance(g, Mapping)}
    for g in optimizer.param_groups:
        theirs = by_name.get(g.get("name"))
        if theirs is not None:
            g.update(loadable_hparams(theirs))
    if st is not None:  # stored in this optimizer's adamw_state_dtype (a note if the saved differs)
        saved = (by_name.get("adamw") or {}).get("adamw_state_dtype") if fsdp else \
            str(optimizer._adamw_storage.dtype)
        st = optimizer._adamw_storage.load(st, saved, what)
    optimizer.adamw_state = st and st._replace(step=as_step(steps["adamw_step"]))
    optimizer.adamw_skipped = skipped_counts(entries, [n for n, _ in optimizer.adamw_named_params])
    optimizer.num_steps = steps["num_steps"]
    owner.broken = None  # a step that failed part-way: reloaded (every rank loads)
    saved = (by_name.get("muon") or {}).get("momentum_dtype") if ded else \
        str(optimizer._storage.dtype)  # the momentum field's (a note if it differs)
    if staged_fields is None:
        owner.reset()
    if staged_fields is not None or entries.get("variant_scalars"):
        owner.load(staged_fields or {}, entries.get("variant_scalars"), saved, what)
    if rt.owned_names:
        owner.step_count = as_step(steps["muon_step"])
    for n, t in staged_masters.items():
        rt.masters[n].copy_(t)
    rt.state_dict_copies.loaded(OPTIMIZER)  # (what dcp.load wrote into a Muon.state_dict())
    if staged_masters:
        rt.masters_changed()
    optimizer.invalidate_state_views()  # rebuilt when read (fp8: no decoded copies held)


def _local_piece(v: Any, p: Any) -> torch.Tensor:
    """This rank's piece of an AdamW moment: a DTensor (its local tensor), a full tensor (sliced
    like ``p``), or already this rank's piece."""
    if hasattr(v, "to_local"):
        return v.to_local()
    if tuple(v.shape) == tuple(p.shape):
        return local_tensor(distribute_like(v.to(device=p.device), p))
    return v.to(device=p.device)


# ---------------------------------------------------------------------------------- dmuon's format
@torch.no_grad()
@unwrapping_model
def get_optimizer_state_dict(model: nn.Module, optimizer: Any, cpu_offload: bool = False, *,
                             rank0_only: bool = False) -> dict[str, Any]:
    """Collective: dmuon's full optimizer state (design notes). Every rank calls it.

    Args:
      model, optimizer: the model and its ``dmuon.Muon``.
      cpu_offload: return CPU tensors.
      rank0_only: only rank 0 keeps the tensors (other ranks get the same dict with empty
        sections).

    Returns:
      the dict; before the first step the moments and momentum are zeros.
    """
    rt = check_optimizer(model, optimizer, "dmuon.get_optimizer_state_dict")
    rt.join("dmuon.get_optimizer_state_dict(model, optimizer)", always=True, drain=True)
    check_unloaded(rt, [OPTIMIZER], "dmuon.get_optimizer_state_dict", refuse=True)
    keep = not rank0_only or rt.rank == 0
    mv = (lambda t: t.cpu()) if cpu_offload else (lambda t: t)
    st = optimizer.adamw_state
    fsdp2: dict[str, dict[str, torch.Tensor]] = {}
    for n, p in optimizer.adamw_named_params:
        # collective for a DTensor p: the full tensor of this rank's piece (a copy)
        entry = {k: full_copy(dtensor_like(src[n], p)) for k, src in zip(_MOMENTS, (st.mu, st.nu))}
        if keep:
            fsdp2[n] = {k: mv(v) for k, v in entry.items()}
    ded = gather_fields(optimizer)
    dedicated = {n: {k: mv(v) for k, v in e.items()} for n, e in ded.items()} if keep else {}
    return {"fsdp2": fsdp2, "dedicated": dedicated,
            "adamw_step": int(st.step) if st is not None else 0,
            SKIPPED: dict(optimizer.adamw_skipped), "muon_step": muon_step(optimizer),
            "num_steps": int(optimizer.num_steps), "param_groups": hparam_groups(optimizer),
            **({"variant_scalars": optimizer._owner.scalars()} if optimizer._owner.custom
               else {})}


@torch.no_grad()
@unwrapping_model
def set_optimizer_state_dict(model: nn.Module, optimizer: Any,
                             state_dict: Optional[Mapping[str, Any]], *,
                             rank0_only: bool = False, check_finite: bool = True) -> None:
    """Collective: load a dict written by :func:`get_optimizer_state_dict` at any topology
    (through :func:`load_optimizer_state`). Call it after ``set_model_state_dict`` (a
    ``"master"`` entry overwrites the model's masters).

    Args:
      model, optimizer: the model and its ``dmuon.Muon``.
      state_dict: the full dict (every rank, or only rank 0 with ``rank0_only``).
      rank0_only: only rank 0's dict is read; the dedicated matrices' state moves from it
        bucketed, one hook group at a time; AdamW's moments are broadcast one at a time.
      check_finite: refuse NaN / Inf values (default).

    Raises:
      StateDictError: on every rank, before anything changes, when a rank's dict does not match
        the model (the message lists the problems).
    """
    what = "dmuon.set_optimizer_state_dict"
    rt = check_optimizer(model, optimizer, what)
    rt.join(f"{what}(model, optimizer, sd)", always=True, drain=True)
    has_dict = not rank0_only or rt.rank == 0
    problems = full_dict_problems(state_dict) if has_dict else []
    mine = full_dict_structure(state_dict) if rank0_only and has_dict and not problems else None
    meta = agree(rt, problems, what, mine, route="optimizer")[0]  # rank 0's structure too
    if not rank0_only:
        return load_optimizer_state(optimizer, full_entries(state_dict), what=what,
                                    check_finite=check_finite)
    # rank 0 holds the dict: AdamW's tensors broadcast one by one
    adamw = dict(optimizer.adamw_named_params)
    entries = dict(meta)
    entries["fsdp2"] = {
        n: {k: from_rank0(state_dict["fsdp2"][n][k] if rt.rank == 0 else None,
                          tuple(adamw[n].shape), adamw[n].dtype, rt) for k in _MOMENTS}
        for n in meta["fsdp2"] if n in adamw}
    # the dedicated entries stay on rank 0 as they are (checked there as the plain route checks
    # them) and move bucketed, each converted to the master dtype on the device as it moves
    entries["dedicated"] = {n: {k: state_dict["dedicated"][n][k] if rt.rank == 0 else None
                                for k in keys}
                            for n, keys in meta["dedicated"].items() if n in rt.params}
    load_optimizer_state(optimizer, entries, what=what, check_finite=check_finite, rank0=True)

