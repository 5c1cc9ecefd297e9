"""Full, topology-free optimizer state dicts (collective), in the seeds' checkpoint format::

    {"fsdp2":     {fqn: {"exp_avg": full, "exp_avg_sq": full}},      # AdamW moments
     "dedicated": {fqn: {"momentum_buffer": full}},                   # Muon momentum (from owners)
     "adamw_step": int, "muon_step": int, "num_steps": int,           # counters (bias correction)
     "param_groups": [{hparams of the muon group}, {hparams of the adamw group}]}

Every tensor is a plain full tensor, the same on every rank, so rank 0 can ``torch.save`` it and
every rank can load it back (same topology here; the format itself names no rank or shard).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.functional import adamw as fadamw
from dmuon.functional import muon as fmuon
from dmuon.stateful.optimizer import Muon
from dmuon.stateful.runtime import get_runtime


def _check_opt(model: nn.Module, optimizer: Any, what: str):
    rt = get_runtime(model, what)
    if not isinstance(optimizer, Muon) or optimizer._rt is not rt:
        raise TypeError(f"{what}: optimizer must be the dmuon.Muon built for this model")
    return rt


def _full(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride()).full_tensor()
    return local.detach().clone()


def get_optimizer_state_dict(model: nn.Module, optimizer: Muon,
                             cpu_offload: bool = False) -> dict[str, Any]:
    """Collective: the full optimizer state (see the module docstring), the same on every rank."""
    rt = _check_opt(model, optimizer, "dmuon.get_optimizer_state_dict")
    rt.wait_publish()
    rt.wait_reduces()
    mv = (lambda t: t.cpu()) if cpu_offload else (lambda t: t)
    fsdp2: dict[str, dict[str, torch.Tensor]] = {}
    st = optimizer.adamw_state
    if st is not None and st.step > 0:
        for n, p in optimizer._adamw_named:
            fsdp2[n] = {"exp_avg": mv(_full(st.mu[n], p)), "exp_avg_sq": mv(_full(st.nu[n], p))}
    dedicated: dict[str, dict[str, torch.Tensor]] = {}
    if optimizer.num_steps > 0:
        ms = optimizer.muon_state
        for n in rt.names:
            src = rt.owner_rank[n]
            if rt.rank == src and ms is not None:
                buf = ms.momentum[n].detach().clone()
            else:
                buf = torch.zeros(rt.shape[n], dtype=rt.master_dtype[n], device=rt.device)
            dist.broadcast(buf, src=src)
            dedicated[n] = {"momentum_buffer": mv(buf)}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"fsdp2": fsdp2, "dedicated": dedicated,
            "adamw_step": int(st.step) if st is not None else 0,
            "muon_step": int(optimizer.num_steps), "num_steps": int(optimizer.num_steps),
            "param_groups": groups}


def _validate(sd: Mapping[str, Any], optimizer: Muon, rt) -> list[str]:
    problems: list[str] = []
    for key in ("fsdp2", "dedicated"):
        if not isinstance(sd.get(key), Mapping):
            problems.append(f"missing section {key!r}")
    if problems:
        return problems
    shapes = {n: tuple(p.shape) for n, p in optimizer._adamw_named}
    if sd["fsdp2"]:
        miss = [n for n in shapes if n not in sd["fsdp2"]]
        extra = [n for n in sd["fsdp2"] if n not in shapes]
        if miss or extra:
            problems.append(f"fsdp2: missing {miss}, unexpected {extra}")
        for n, s in sd["fsdp2"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                t = s.get(k) if isinstance(s, Mapping) else None
                if n in shapes and (t is None or tuple(t.shape) != shapes[n]):
                    problems.append(f"fsdp2[{n!r}][{k!r}]: expected shape {shapes[n]}")
    if sd["dedicated"]:
        miss = [n for n in rt.names if n not in sd["dedicated"]]
        extra = [n for n in sd["dedicated"] if n not in rt.shape]
        if miss or extra:
            problems.append(f"dedicated: missing {miss}, unexpected {extra}")
        for n, s in sd["dedicated"].items():
            t = s.get("momentum_buffer") if isinstance(s, Mapping) else None
            if n in rt.shape and (t is None or tuple(t.shape) != rt.shape[n]):
                problems.append(f"dedicated[{n!r}]['momentum_buffer']: expected shape {rt.shape[n]}")
    return problems


@torch.no_grad()
def set_optimizer_state_dict(model: nn.Module, optimizer: Muon, state_dict: Mapping[str, Any]) -> None:
    """Collective: load a dict written by :func:`get_optimizer_state_dict` (every rank passes it).

    Raises:
      ValueError: on every rank when any rank's dict does not match the model (lists the problems).
    """
    rt = _check_opt(model, optimizer, "dmuon.set_optimizer_state_dict")
    problems = _validate(state_dict, optimizer, rt)
    flag = torch.tensor([1 if problems else 0], dtype=torch.int64, device=rt.device)
    dist.all_reduce(flag)
    if int(flag.item()) > 0:
        raise ValueError("set_optimizer_state_dict: the optimizer state dict does not match on "
                         f"{int(flag.item())} rank(s): " + ("; ".join(problems) or "this rank's is fine"))
    groups = state_dict.get("param_groups")
    if groups and len(groups) == len(optimizer.param_groups):
        for mine, theirs in zip(optimizer.param_groups, groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
    if optimizer._adamw_named:
        params, _ = optimizer._adamw_tensors()
        st = fadamw.init(params)
        for n, p in optimizer._adamw_named:
            s = state_dict["fsdp2"].get(n)
            if s is None:
                continue
            for k, dst in (("exp_avg", st.mu[n]), ("exp_avg_sq", st.nu[n])):
                full = s[k].to(device=dst.device, dtype=dst.dtype)
                if hasattr(p, "device_mesh"):
                    from torch.distributed.tensor import distribute_tensor
                    full = distribute_tensor(full, p.device_mesh, p.placements,
                                             src_data_rank=None).to_local()
                dst.copy_(full)
        optimizer.adamw_state = st._replace(step=int(state_dict.get("adamw_step", 0)))
    owned = rt.owned_names
    if owned:
        ms = fmuon.init({n: rt.masters[n] for n in owned})
        for n in owned:
            s = state_dict["dedicated"].get(n)
            if s is not None:
                ms.momentum[n].copy_(s["momentum_buffer"].to(device=rt.device,
                                                             dtype=ms.momentum[n].dtype))
        optimizer.muon_state = ms._replace(step=int(state_dict.get("muon_step", 0)))
    optimizer.num_steps = int(state_dict.get("num_steps", 0))
    optimizer.refresh_state_views()
