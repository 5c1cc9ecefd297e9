"""Which tensors of a forward output the runtime hooks (pure): every tensor requiring grad that
the output holds, wherever it holds it, so that every dedicated param gets its gradient whatever
forward returns (:mod:`dmuon.stateful.runtime.hooks` registers its pre-backward hook on them)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn

__all__ = ["MAX_DEPTH", "grad_tensors", "hidden_from_fsdp"]

#: how many levels of containers and attributes :func:`grad_tensors` enters
MAX_DEPTH = 6


def _collect(obj: Any, out: list[torch.Tensor], seen: set[int], depth: int,
             leaves_of: Callable[[Any], list[Any]]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return
    if depth > MAX_DEPTH or id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int,
                                                                            float, bool)):
        return
    seen.add(id(obj))
    try:
        leaves = leaves_of(obj)
    except Exception:  # noqa: BLE001 - an exotic container pytree cannot flatten
        leaves = [obj]
    if len(leaves) != 1 or leaves[0] is not obj:  # pytree knew the container (ModelOutput too)
        for leaf in leaves:
            _collect(leaf, out, seen, depth + 1, leaves_of)
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
        children = list(vars(obj).values())
    else:
        children = [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())]
    for child in children:
        _collect(child, out, seen, depth + 1, leaves_of)


def grad_tensors(output: Any, leaves_of: Callable[[Any], list[Any]]) -> list[torch.Tensor]:
    """The tensors requiring grad in a forward output, each once: the leaves of the containers
    ``leaves_of`` flattens (torch's pytree: dicts, lists, tuples, registered containers such as
    Hugging Face ``ModelOutput``), dataclass fields and other objects' attributes, up to
    :data:`MAX_DEPTH` levels deep (modules and classes are not entered)."""
    found: list[torch.Tensor] = []
    _collect(output, found, set(), 0, leaves_of)
    uniq = {id(t): t for t in found if t.requires_grad}
    return list(uniq.values())


def hidden_from_fsdp(model_cls: str, output_cls: str) -> str:
    """The error for a model (its only ``fully_shard`` module, holding FSDP2 params) whose forward
    returned an ``output_cls`` object that hides every tensor from torch's pytree: FSDP2's
    pre-backward hook never runs, so its params would silently not train."""
    return (
        f"dmuon: {model_cls}.forward returned a {output_cls} object that hides its tensors from "
        "torch's pytree, so FSDP2 cannot hook the backward of this model (its only fully_shard "
        "module): the gradients of FSDP2's own params would never be reduced and those params "
        "would silently not train (dmuon's matrices would). Return the loss in a tensor, tuple, "
        "dict, dataclass or Hugging Face ModelOutput, or register "
        f"{output_cls} with torch.utils._pytree (register_pytree_node / register_dataclass); or "
        "fully_shard the model's blocks too.")
