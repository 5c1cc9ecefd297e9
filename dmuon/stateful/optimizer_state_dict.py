"""Full, topology-free optimizer state dicts (collective), in the seeds' checkpoint format::

    {"fsdp2":     {fqn: {"exp_avg": full, "exp_avg_sq": full}},      # AdamW moments
     "dedicated": {fqn: {"momentum_buffer": full,                     # Muon momentum (from owners)
                         "master": full}},                            # only when the master is
                                                                      # wider than the param
     "adamw_step": int, "muon_step": int, "num_steps": int,           # counters (bias correction)
     "param_groups": [{"name": "muon", hparams...}, {"name": "adamw", hparams...}]}

Every tensor is a plain full tensor keyed by parameter name; nothing names a rank, shard or mesh,
so a dict saved at one ``(shard, replicate)`` shape loads at any other, or in one process
(:func:`dmuon.functional.state_dict_check.functional_states_from_full`). ``"master"`` keeps the
fp32 master of a bf16/fp16 dedicated matrix so a resume is exact (load it after the model dict).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.functional import adamw as fadamw
from dmuon.functional import muon as fmuon
from dmuon.functional.state_dict_check import check_state_dict
from dmuon.stateful.optimizer import Muon
from dmuon.stateful.state import get_state
from dmuon.stateful.state_dict import agree, from_owner, from_rank0, full_copy, local_shard

__all__ = ["get_optimizer_state_dict", "set_optimizer_state_dict"]

_MOMENTS = ("exp_avg", "exp_avg_sq")
_COUNTERS = ("adamw_step", "muon_step", "num_steps")


def check_optimizer(model: nn.Module, optimizer: Any, what: str):
    """The model's runtime; ``TypeError`` unless ``optimizer`` is ``model``'s ``dmuon.Muon``."""
    rt = get_state(model, what)
    if not isinstance(optimizer, Muon) or optimizer.dedicated_state is not rt:
        raise TypeError(f"{what}: optimizer must be the dmuon.Muon built for this model")
    return rt


States = tuple[Optional[fmuon.MuonState], Optional[fadamw.AdamWState]]


def _fresh_muon(optimizer: Muon) -> Optional[fmuon.MuonState]:
    rt = optimizer.dedicated_state
    return fmuon.init(rt.owned_masters()) if rt.owned_names else None


def _fresh_adamw(optimizer: Muon) -> Optional[fadamw.AdamWState]:
    if not optimizer.adamw_named_params:
        return None
    return fadamw.init(optimizer.adamw_local_tensors()[0])


def fresh_states(optimizer: Muon) -> States:
    """New zero functional states ``(muon, adamw)`` for this rank's pieces (``None`` where this rank
    has no owned matrix / no AdamW param), to fill and :func:`install_states`."""
    return _fresh_muon(optimizer), _fresh_adamw(optimizer)


def current_states(optimizer: Muon) -> States:
    """The optimizer's functional states, zero-initialized where no step ran yet (local pieces)."""
    ms = optimizer.muon_state
    if ms is None:
        ms = _fresh_muon(optimizer)
    st = optimizer.adamw_state
    if st is None:
        st = _fresh_adamw(optimizer)
    return ms, st


def install_states(optimizer: Muon, states: States, counters: Mapping[str, Any]) -> None:
    """Make ``states`` (from :func:`fresh_states`, filled) the optimizer's, with the step counters
    ``counters["adamw_step" / "muon_step" / "num_steps"]`` of a saved dict, and rebuild its
    torch-style ``state`` views."""
    ms, st = states
    step_a, step_m = int(counters["adamw_step"]), int(counters["muon_step"])
    optimizer.adamw_state = st._replace(step=step_a) if st is not None else None
    optimizer.muon_state = ms._replace(step=step_m) if ms is not None else None
    optimizer.num_steps = int(counters["num_steps"])
    optimizer.refresh_state_views()


def hparam_groups(optimizer: Muon) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def saved_counters(optimizer: Muon, adamw_state: Optional[fadamw.AdamWState]) -> dict[str, Any]:
    """The saved dict's counters and hyper-parameters: ``adamw_step``, ``muon_step``,
    ``num_steps`` and ``param_groups`` (a list, see :func:`hparam_groups`)."""
    return {"adamw_step": int(adamw_state.step) if adamw_state is not None else 0,
            "muon_step": int(optimizer.num_steps), "num_steps": int(optimizer.num_steps),
            "param_groups": hparam_groups(optimizer)}


def dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """``local`` (this rank's piece) as a DTensor laid out like the FSDP2 param ``like`` (no
    communication); ``local`` itself when ``like`` is a plain tensor."""
    if not hasattr(like, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


@torch.no_grad()
def get_optimizer_state_dict(model: nn.Module, optimizer: Muon, cpu_offload: bool = False, *,
                             rank0_only: bool = False) -> dict[str, Any]:
    """Collective: the full optimizer state (see the module docstring). Every rank must call it.

    Args:
      model, optimizer: the model and its ``dmuon.Muon``.
      cpu_offload: return CPU tensors.
      rank0_only: only rank 0 keeps the tensors (other ranks get the same dict with empty
        sections); momentum travels owner -> rank 0 only.

    Returns:
      the dict; before the first step the moments and momentum are zeros.
    """
    rt = check_optimizer(model, optimizer, "dmuon.get_optimizer_state_dict")
    rt.drain()
    keep = not rank0_only or rt.rank == 0
    mv = (lambda t: t.cpu()) if cpu_offload else (lambda t: t)
    ms, st = current_states(optimizer)
    fsdp2: dict[str, dict[str, torch.Tensor]] = {}
    for n, p in optimizer.adamw_named_params:
        # collective for a DTensor p: the full tensor of this rank's piece (a copy)
        entry = {k: full_copy(dtensor_like(src[n], p)) for k, src in zip(_MOMENTS, (st.mu, st.nu))}
        if keep:
            fsdp2[n] = {k: mv(v) for k, v in entry.items()}
    dedicated: dict[str, dict[str, torch.Tensor]] = {}
    for n in rt.names:
        src = rt.owner_rank[n]
        mine = rt.rank == src
        entry = {"momentum_buffer": from_owner(ms.momentum[n] if mine else None, rt.shape[n],
                                               rt.master_dtype[n], src, rt, rank0_only)}
        if rt.master_dtype[n] != rt.orig_dtype[n]:
            entry["master"] = from_owner(rt.masters[n] if mine else None, rt.shape[n],
                                         rt.master_dtype[n], src, rt, rank0_only)
        if keep:
            dedicated[n] = {k: mv(v) for k, v in entry.items()}
    return {"fsdp2": fsdp2, "dedicated": dedicated, **saved_counters(optimizer, st)}


def _shapes(section: Mapping[str, Any], key: str) -> dict[str, Any]:
    out = {}
    for n, s in section.items():
        t = s.get(key) if isinstance(s, Mapping) else None
        out[n] = tuple(t.shape) if isinstance(t, torch.Tensor) else None
    return out


def validate_optimizer_state_dict(sd: Any, optimizer: Muon) -> list[str]:
    """Problems of a full optimizer state dict against ``optimizer`` (empty list: loadable).

    A section may be empty (a checkpoint taken before the first step: zeros are used); a non-empty
    section must name every param of this model with full shapes."""
    if not isinstance(sd, Mapping):
        return [f"expected a mapping from dmuon.get_optimizer_state_dict, got {type(sd).__name__}"]
    problems = [f"missing section {k!r}" for k in ("fsdp2", "dedicated")
                if not isinstance(sd.get(k), Mapping)]
    if problems:
        return problems
    rt = optimizer.dedicated_state
    adamw_shapes = {n: tuple(p.shape) for n, p in optimizer.adamw_named_params}
    checks = [("fsdp2", k, adamw_shapes) for k in _MOMENTS]
    checks.append(("dedicated", "momentum_buffer", dict(rt.shape)))
    for sec, key, shapes in checks:
        if not sd[sec]:
            continue
        c = check_state_dict(_shapes(sd[sec], key), shapes)
        for p in c.problems(strict=True):
            problems.append(f"{sec}[*][{key!r}]: {p}")
    masters = {n: s["master"] for n, s in sd["dedicated"].items()
               if isinstance(s, Mapping) and "master" in s}
    for n, t in masters.items():
        if n in rt.shape and (not isinstance(t, torch.Tensor) or tuple(t.shape) != rt.shape[n]):
            problems.append(f"dedicated[{n!r}]['master']: expected a tensor of shape {rt.shape[n]}")
    groups = sd.get("param_groups") or []
    names = [g.get("name") for g in groups if isinstance(g, Mapping)]
    if groups and sorted(names) != sorted(g["name"] for g in optimizer.param_groups):
        problems.append(f"param_groups named {names}, expected "
                        f"{[g['name'] for g in optimizer.param_groups]}")
    return problems


def load_hparams(optimizer: Muon, groups: Any) -> None:
    """Copy saved hyper-parameters into the param groups, matched by group name."""
    by_name = {g.get("name"): g for g in (groups or []) if isinstance(g, Mapping)}
    for mine in optimizer.param_groups:
        theirs = by_name.get(mine.get("name"))
        if theirs is not None:
            mine.update({k: v for k, v in theirs.items() if k not in ("params", "name")})


@torch.no_grad()
def set_optimizer_state_dict(model: nn.Module, optimizer: Muon,
                             state_dict: Optional[Mapping[str, Any]], *,
                             rank0_only: bool = False) -> None:
    """Collective: load a dict written by :func:`get_optimizer_state_dict` at any topology.

    Call it after ``set_model_state_dict`` (a ``"master"`` entry overwrites the model's masters).

    Args:
      model, optimizer: the model and its ``dmuon.Muon``.
      state_dict: the full dict (every rank, or only rank 0 with ``rank0_only``).
      rank0_only: only rank 0's dict is read; tensors go from rank 0 to where they live.

    Raises:
      ValueError: on every rank, before any tensor moves, when a rank's dict does not match the
        model (the message lists the problems).
    """
    what = "dmuon.set_optimizer_state_dict"
    rt = check_optimizer(model, optimizer, what)
    rt.drain()
    has_dict = not rank0_only or rt.rank == 0
    problems = validate_optimizer_state_dict(state_dict, optimizer) if has_dict else []
    meta = None
    if has_dict and not problems:
        meta = {"fsdp2": bool(state_dict["fsdp2"]), "dedicated": bool(state_dict["dedicated"]),
                "masters": sorted(n for n, s in state_dict["dedicated"].items() if "master" in s),
                **{k: state_dict.get(k, 0) for k in _COUNTERS},
                "param_groups": state_dict.get("param_groups")}
    got = agree(rt, problems, what, meta if rank0_only else None)
    if rank0_only:
        meta = got[0][1]

    def fetch(section: str, n: str, key: str, shape, dtype, dst: Optional[int]):
        """The full tensor on this rank (``dst=None``: every rank needs it), else ``None``."""
        if not rank0_only:
            return state_dict[section][n][key]
        me = rt.rank
        if dst is None:
            return from_rank0(state_dict[section][n][key] if me == 0 else None, shape, dtype, rt)
        if me == 0:
            t = state_dict[section][n][key].to(device=rt.device, dtype=dtype).contiguous()
            if dst == 0:
                return t
            rt.mesh_groups.control_collective(
                "optimizer-state send", lambda g: dist.send(t, dst=dst, group=g))
        elif me == dst:
            buf = torch.empty(shape, dtype=dtype, device=rt.device)
            rt.mesh_groups.control_collective(
                "optimizer-state receive", lambda g: dist.recv(buf, src=0, group=g))
            return buf
        return None

    load_hparams(optimizer, meta["param_groups"])
    ms, st = fresh_states(optimizer)
    if st is not None and meta["fsdp2"]:
        for n, p in optimizer.adamw_named_params:
            for k, dst in zip(_MOMENTS, (st.mu[n], st.nu[n])):
                full = fetch("fsdp2", n, k, tuple(p.shape), dst.dtype, None)
                dst.copy_(local_shard(full.to(device=dst.device, dtype=dst.dtype), p))
    owned = set(rt.owned_names)
    for n in rt.names:
        if meta["dedicated"]:
            t = fetch("dedicated", n, "momentum_buffer", rt.shape[n], rt.master_dtype[n],
                      rt.owner_rank[n])
            if n in owned:
                ms.momentum[n].copy_(t.to(device=rt.device, dtype=ms.momentum[n].dtype))
        if n in meta["masters"]:
            t = fetch("dedicated", n, "master", rt.shape[n], rt.master_dtype[n], None)
            if n in rt.masters:
                rt.masters[n].copy_(t.to(device=rt.device, dtype=rt.masters[n].dtype))
    install_states(optimizer, (ms, st), meta)
    if meta["masters"]:
        rt.masters_changed()
