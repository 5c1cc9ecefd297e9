"""Full (single-device style) model state dicts for a dedicated + FSDP2 model, same topology.

``get_model_state_dict`` returns exactly the keys, shapes and dtypes of a single-device
``model.state_dict()`` as plain tensors on every rank: FSDP2 params via ``full_tensor()``,
dedicated matrices broadcast from their owners' masters (cast back to the param's dtype).
``set_model_state_dict`` validates the dict on every rank, agrees on the verdict with one small
collective (so a bad dict raises everywhere instead of hanging), then writes each rank's part:
masters on the ranks of the owner column, local shards of FSDP2 params, buffers.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.stateful.runtime import DedicatedRuntime, get_runtime


def _name_map(model: nn.Module, rt: DedicatedRuntime) -> dict[str, str]:
    """``state_dict key -> dedicated canonical name`` for every key that is a dedicated param."""
    canon = {p: n for n, p in rt.params.items()}
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p in canon:
            out[n] = canon[p]
    return out


def _expected(model: nn.Module, rt: DedicatedRuntime) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    ded = _name_map(model, rt)
    exp = {}
    for k, v in model.state_dict().items():
        if k in ded:
            n = ded[k]
            exp[k] = (rt.shape[n], rt.orig_dtype[n])
        else:
            exp[k] = (tuple(v.shape), v.dtype)
    return exp


def get_model_state_dict(model: nn.Module, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """Collective: ``{fully-qualified name: full tensor}`` like single-device ``model.state_dict()``.

    Args:
      model: a model prepared by ``dedicate_params`` (and ``fully_shard``); every rank must call.
      cpu_offload: return CPU tensors.

    Returns:
      the same dict on every rank (plain tensors, never DTensors).
    """
    rt = get_runtime(model, "dmuon.get_model_state_dict(model)")
    rt.wait_publish()
    ded = _name_map(model, rt)
    out: dict[str, torch.Tensor] = {}
    cache: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k in ded:
            n = ded[k]
            if n not in cache:
                if n in rt.masters:
                    buf = rt.masters[n].detach().to(rt.orig_dtype[n]).clone()
                else:
                    buf = torch.empty(rt.shape[n], dtype=rt.orig_dtype[n], device=rt.device)
                dist.broadcast(buf, src=rt.owner_rank[n])
                cache[n] = buf
            t = cache[n]
        elif hasattr(v, "full_tensor"):
            t = v.full_tensor()
        else:
            t = v.detach().clone()
        out[k] = t.cpu() if cpu_offload else t
    return out


def _validate(sd: Mapping[str, Any], exp: Mapping[str, tuple]) -> list[str]:
    problems = []
    missing = [k for k in exp if k not in sd]
    unexpected = [k for k in sd if k not in exp]
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    wrong = []
    for k, (shape, _dtype) in exp.items():
        v = sd.get(k)
        if v is None:
            continue
        if not isinstance(v, torch.Tensor):
            wrong.append(f"{k}: not a tensor ({type(v).__name__})")
        elif tuple(v.shape) != tuple(shape):
            wrong.append(f"{k}: shape {tuple(v.shape)}, expected {tuple(shape)}")
    if wrong:
        problems.append("wrong shapes " + "; ".join(wrong))
    return problems


@torch.no_grad()
def set_model_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Collective: load a full ``{name: tensor}`` dict (single-device or HF style) into the model.

    Raises:
      ValueError: on every rank, when any rank's dict has missing / unexpected keys or wrong shapes
        (the message lists them).
    """
    rt = get_runtime(model, "dmuon.set_model_state_dict(model, sd)")
    rt.wait_publish()
    exp = _expected(model, rt)
    problems = _validate(state_dict, exp)
    flag = torch.tensor([1 if problems else 0], dtype=torch.int64, device=rt.device)
    dist.all_reduce(flag)
    if problems or int(flag.item()) > 0:
        detail = "; ".join(problems) if problems else "this rank's dict is fine"
        raise ValueError(f"set_model_state_dict: the state dict does not match the model on "
                         f"{int(flag.item())} rank(s): {detail}")
    ded = _name_map(model, rt)
    live = dict(model.named_parameters(remove_duplicate=False))
    live.update(dict(model.named_buffers(remove_duplicate=False)))
    for k in exp:
        v = state_dict[k]
        if k in ded:
            n = ded[k]
            if n in rt.masters:
                rt.masters[n].copy_(v.to(device=rt.device, dtype=rt.masters[n].dtype))
            continue
        target = live.get(k)
        if target is None:  # a persistent buffer not reachable by name (rare): skip silently
            continue
        if hasattr(target, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor
            full = v.to(device=target.to_local().device, dtype=target.dtype)
            shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(v.to(device=target.device, dtype=target.dtype))
    rt.version += 1
    rt.reshard_all()
