"""An owner update computed ahead of ``step()``, out of place (:mod:`dmuon.functional.ns_overlap`
decides when it is valid): :func:`live_tensors` lists what it reads, :func:`speculative_inputs`
copies the live state and masters of some owned matrices into buffers of the speculation's own
(the chain's counts cloned, so the live ones never advance), and :func:`commit_` copies a valid
result into the live state and masters, bit for bit what running the update then would have
written. Nothing here reads or writes anything but the trees it is given."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import optree
import torch
from torch import Tensor

from dmuon.functional.tree import get_path, replace_path

__all__ = ["live_tensors", "speculative_inputs", "speculative_fields", "result_tensors", "commit_"]

#: ``buffer(key, like)``: a tensor shaped as ``like`` kept by the caller for ``key`` (reused
#: across steps, so a speculation allocates nothing in the steady state), holding ``like``'s values
Buffer = Callable[[tuple, Tensor], Tensor]


def live_tensors(state: Any, fields: Sequence[Any], masters: Mapping[str, Tensor],
                 names: Sequence[str]) -> list[Tensor]:
    """The live per-param state (field by field) and masters of ``names``: what an update of
    them reads and :func:`speculative_inputs` copies, in one fixed order (a stamp's inputs)."""
    return [get_path(state, f.path)[n] for f in fields for n in names] + [masters[n] for n in names]


def speculative_inputs(state: Any, fields: Sequence[Any], masters: Mapping[str, Tensor],
                       names: Sequence[str], buffer: Buffer) -> tuple[Any, dict[str, Tensor]]:
    """``(state, params)`` for an owner update of ``names`` that writes nothing live: each
    per-param field (:func:`~dmuon.functional.state_fields.state_fields`) restricted to ``names``
    in copies, every other tensor of the state (the chain's counts) cloned, the masters copied."""
    own: set[int] = set()
    for f in fields:
        live = get_path(state, f.path)
        sub = {n: buffer((f.key, n), live[n]) for n in names}
        own.update(id(t) for t in sub.values())
        state = replace_path(state, f.path, sub)
    leaves, treedef = optree.tree_flatten(state)
    state = treedef.unflatten([t.clone() if isinstance(t, Tensor) and id(t) not in own else t
                               for t in leaves])
    return state, {n: buffer(("param", n), masters[n]) for n in names}


def speculate(run: Callable[[Any, dict[str, Tensor]], tuple[dict[str, Tensor], Any]], state: Any,
              fields: Sequence[Any], masters: Mapping[str, Tensor], names: Sequence[str],
              buffer: Buffer) -> tuple[dict[str, dict[str, Tensor]], dict[str, Tensor]]:
    """An owner update of ``names`` that writes nothing live (the early owner phase of one hook
    group): ``run(state, params) -> (new params, new state)`` on :func:`speculative_inputs`;
    returns ``(new per-param fields, new params)``, what :func:`commit_` copies."""
    spec_state, params = speculative_inputs(state, fields, masters, names, buffer)
    params, spec_state = run(spec_state, params)
    return speculative_fields(spec_state, fields), params


def speculative_fields(state: Any, fields: Sequence[Any]) -> dict[str, dict[str, Tensor]]:
    """``{field key: {name: tensor}}`` of a speculation's resulting state (what :func:`commit_`
    copies; the counts are left out: the step's own update advances the live ones once)."""
    return {f.key: dict(get_path(state, f.path)) for f in fields}


def result_tensors(new_fields: Mapping[str, Mapping[str, Tensor]],
                   new_params: Mapping[str, Tensor]) -> list[Tensor]:
    """Every tensor a speculation made (:func:`speculate`'s results): its new params, then its
    per-param fields."""
    return [*new_params.values(), *(t for f in new_fields.values() for t in f.values())]


@torch.no_grad()
def commit_(state: Any, fields: Sequence[Any], masters: Mapping[str, Tensor],
            new_fields: Mapping[str, Mapping[str, Tensor]], new_params: Mapping[str, Tensor]
            ) -> None:
    """Copy a speculation's per-param state and new params into the live ``state`` and
    ``masters`` (in place, one ``_foreach_copy_``)."""
    dst, src = [], []
    for f in fields:
        live = get_path(state, f.path)
        for n, t in new_fields[f.key].items():
            dst.append(live[n])
            src.append(t)
    for n, t in new_params.items():
        dst.append(masters[n])
        src.append(t)
    if dst:
        torch._foreach_copy_(dst, src)
