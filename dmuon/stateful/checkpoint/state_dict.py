"""Full (single-device style) model state dicts for a dedicated + FSDP2 model, at any topology:
:func:`get_model_state_dict` / :func:`set_model_state_dict`. A dict names no rank, shard or mesh;
a load is checked on every rank and the verdict agreed before anything changes.

Design notes: docs/design/checkpoint.md, "dmuon.stateful.checkpoint.state_dict".
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.functional.copy_log import MODEL
from dmuon.functional.selection import canonical_names, tied_names
from dmuon.functional.state_dict_check import model_state_problems
from dmuon.stateful.runtime.state import DedicatedState, get_state, local_tensor
from dmuon.compat.wrappers import unwrapping_model
from dmuon.stateful.checkpoint.torch_state_dict import (agree, check_unloaded, distribute_like,
                                                       log_dtype_changes)
from dmuon.stateful.modes.tensor_parallel import full_shape, local_part
from dmuon.stateful.checkpoint.transfer import transfer_of

__all__ = ["get_model_state_dict", "set_model_state_dict", "LoadResult"]


class LoadResult(NamedTuple):
    """What ``set_model_state_dict(..., strict=False)`` did not load (like torch's
    ``load_state_dict`` return value). Tied names satisfied by an alias are not missing."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def module_entries(model: nn.Module, detach: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each dedicated param's placeholder kept as its entry (never
    read); other entries detached as torch does (``detach=False``: the params themselves)."""
    from dmuon.compat.fsdp_patch import is_dedicated
    st = get_state(model)
    prev, st.raw_state_dict = st.raw_state_dict, True
    try:
        sd = model.state_dict(keep_vars=True)
    finally:
        st.raw_state_dict = prev
    return {k: (v if is_dedicated(v) or not detach else v.detach()) for k, v in sd.items()}


def dedicated_names_by_key(model: nn.Module, rt: DedicatedState,
                           entries: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, str]:
    """``{state_dict key: dedicated canonical name}`` (a tied matrix under each of its keys), by
    the keys ``model.state_dict()`` gives: after the renames of modules' state-dict hooks
    (``checkpoint_wrapper`` drops ``_checkpoint_wrapped_module.``). ``entries``: the caller's
    :func:`module_entries` (one state-dict pass), detached or not."""
    entries = module_entries(model, detach=False) if entries is None else entries
    return canonical_names(entries.items(), rt.params)


def expected_entries(entries: Mapping[str, torch.Tensor], rt: DedicatedState, ded: Mapping[str, str]
                     ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (full shape, dtype)}`` of the single-device ``model.state_dict()``, in its order
    (the same on every rank), from :func:`module_entries` and :func:`dedicated_names_by_key`:
    dedicated matrices by their full shape and the param's dtype."""
    return {k: (full_shape(rt, ded[k]), rt.orig_dtype[ded[k]]) if k in ded
            else (tuple(v.shape), v.dtype) for k, v in entries.items()}


def from_rank0(t: Optional[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
               rt: DedicatedState) -> torch.Tensor:
    """Collective: rank 0's full tensor ``t`` (ignored elsewhere) broadcast to every rank, on
    ``rt.device`` in ``dtype`` (``shape``: ``t``'s); for FSDP2's params, buffers and AdamW moments
    of a ``rank0_only`` load."""
    buf = (t.to(device=rt.device, dtype=dtype).contiguous() if rt.rank == 0
           else torch.empty(shape, dtype=dtype, device=rt.device))
    rt.mesh_groups.control_collective(
        "state-dict broadcast", lambda g: dist.broadcast(buf, src=0, group=g))
    return buf


def full_copy(t: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor ``t`` (every rank of its mesh calls it): its full tensor
    (``full_tensor()``); a plain tensor: a detached copy."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


@torch.no_grad()
@unwrapping_model
def get_model_state_dict(model: nn.Module, cpu_offload: bool = False, *,
                         rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Collective: ``{fully-qualified name: full tensor}`` like a single-device ``state_dict()``.
    Every rank must call it (it drains dmuon's pending collectives first).

    Args:
      model: a model prepared by ``dedicate_params`` (and ``fully_shard``).
      cpu_offload: return CPU tensors.
      rank0_only: only rank 0 keeps the dict (others return ``{}``).

    Returns:
      plain tensors (never DTensors), the same keys / shapes / dtypes as ``model.state_dict()`` of
        the model on one device (tied params under each of their names).
    """
    rt = get_state(model, "dmuon.get_model_state_dict(model)")
    rt.join("dmuon.get_model_state_dict(model)", drain=True)
    check_unloaded(rt, [MODEL], "dmuon.get_model_state_dict", refuse=True)
    keep = not rank0_only or rt.rank == 0
    mv = (lambda t: t.cpu()) if cpu_offload else (lambda t: t)
    full: dict[str, torch.Tensor] = {}
    for n, t in transfer_of(rt).full_masters():
        if keep:
            full[n] = mv(t.to(rt.orig_dtype[n]).clone())
    entries = module_entries(model)  # one state-dict pass
    ded = dedicated_names_by_key(model, rt, entries)
    out: dict[str, torch.Tensor] = {}
    for k, v in entries.items():
        t = full.get(ded[k]) if k in ded else full_copy(v)  # (collective for a DTensor)
        if keep:
            out[k] = t if k in ded else mv(t)
    return out


@torch.no_grad()
@unwrapping_model
def set_model_state_dict(model: nn.Module, state_dict: Optional[Mapping[str, torch.Tensor]], *,
                         strict: bool = True, rank0_only: bool = False,
                         check_finite: bool = True) -> LoadResult:
    """Collective: load a full ``{name: tensor}`` dict (single-device, HF or dmuon) into the model.

    Works at any topology: the dict's tensors are full; each rank keeps what it owns.

    Args:
      model: a model prepared by ``dedicate_params`` (and ``fully_shard``).
      state_dict: ``{fully-qualified name: full tensor}``; values are cast to each param's dtype.
        With ``rank0_only``, only rank 0's dict is read (others may pass ``None``).
      strict: missing or unexpected keys are errors (default). ``False`` skips them (wrong shapes
        still raise) and reports them in the return value.
      rank0_only: rank 0 holds the dict (the dedicated matrices move bucketed, one hook group
        at a time; the other tensors are broadcast one at a time).
      check_finite: refuse NaN / Inf values (default); ``False`` loads them.

    Returns:
      :class:`LoadResult` ``(missing_keys, unexpected_keys)``.

    Raises:
      ValueError: on every rank, before anything changes, when a rank's dict has missing /
        unexpected keys (``strict``), wrong shapes, non-tensor or DTensor values (a sharded
        model's own ``state_dict()``: ``model.load_state_dict`` takes that), integer or bool
        values for floating params, or non-finite values (``check_finite``); the message lists
        them. A floating value of another precision loads (cast to the param's dtype; narrowing
        is logged).
    """
    what = "dmuon.set_model_state_dict"
    rt = get_state(model, f"{what}(model, sd)")
    rt.join(f"{what}(model, sd)", always=True)
    rt.wait_publish()
    live = module_entries(model, detach=False)  # one state-dict pass, by key (as ``exp``)
    ded = dedicated_names_by_key(model, rt, live)
    exp = expected_entries(live, rt, ded)
    notes: list = []
    check, problems = None, []
    if not rank0_only or rt.rank == 0:
        check, problems = model_state_problems(state_dict, exp, tied_names(live.items()),
                                               strict=strict, finite=check_finite, notes=notes)
    mine = None if check is None else (dict(check.source), list(check.missing),
                                       list(check.unexpected))
    payloads = agree(rt, problems, what, mine if rank0_only else None)
    log_dtype_changes(what, notes)
    source, missing, unexpected = payloads[0] if rank0_only else mine

    done: set[int] = set()
    held: dict[str, str] = {}  # rank0_only: dedicated name -> rank 0's key (moved below)
    for k, (shape, dtype) in exp.items():
        src = source.get(k)
        if src is None:
            continue
        n = ded.get(k)
        target = rt.params[n] if n is not None else live.get(k)
        if target is None or id(target) in done:  # unreachable buffer, or a tied alias done
            continue
        done.add(id(target))
        if rank0_only and n is not None:
            held[n] = src
            continue
        if rank0_only:  # FSDP2 params and buffers: broadcast, then this rank's shard
            v = from_rank0(state_dict[src] if rt.rank == 0 else None, shape, dtype, rt)
        else:
            v = state_dict[src]
        if n is not None:
            if n in rt.masters:  # (TP: this rank's slice of the full value), as the param holds it
                rt.masters[n].copy_(local_part(rt, n, v).to(device=rt.device,
                                                            dtype=rt.orig_dtype[n]))
        else:  # an FSDP2 param (this rank's shard of the full value) or a plain tensor
            dst = local_tensor(target)
            dst.copy_(local_tensor(distribute_like(v.to(device=dst.device, dtype=target.dtype),
                                                   target)))
    if held:  # the dedicated matrices: rank 0's values through the program's checkpoint moves
        for n, t in transfer_of(rt).to_owners(held, lambda n: state_dict[held[n]].to(  # as the
                device=rt.device, dtype=rt.orig_dtype[n]),  # param holds it (then its master's)
                rank0=True, shapes={n: full_shape(rt, n) for n in held}):
            if n in rt.masters:
                rt.masters[n].copy_(t)
    rt.masters_changed(loaded=MODEL, keys={ded[k] for k in source if k in ded})
    return LoadResult(list(missing), list(unexpected))
