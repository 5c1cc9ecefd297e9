"""Forward / backward hooks that move the dedicated params of each hook group (pre/post-forward on
the boundary modules and the model, a pre-backward hook on the outputs' tensors, a
post-accumulate-grad hook on every dedicated param). Every hook runs eagerly (outside any
``torch.compile`` graph), and every dedicated param gets its gradient, whatever forward returns.

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.hooks".
"""
from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from dmuon.compat.torch_api import (fsdp_output_grad_tensors, fsdp_param_groups, fsdp_state,
                                   in_backward, tree_leaves)
from dmuon.functional.output_tensors import grad_tensors, hidden_from_fsdp
from dmuon.stateful.runtime.state import ROOT_GROUP, DedicatedState

__all__ = ["register_hooks", "check_fsdp_sees_output"]


def _eager(fn: Any) -> Any:
    """``fn`` kept out of any ``torch.compile`` graph (runs eagerly; a graph break if reached)."""
    return torch.compiler.disable(fn, recursive=True)


def _register_pre_backward(st: DedicatedState, key: str | None, output: Any) -> bool:
    """Hook the output's tensors so that the backward of ``key`` starts with dmuon's pre-backward;
    False when the output has none (the caller then keeps the group gathered). A block whose output
    holds only tensors earlier blocks hooked (it returned its input) starts first in their hook:
    torch would run its hook after theirs, and every rank must re-gather in one order."""
    if not (tensors := grad_tensors(output, tree_leaves)):
        return False
    if key and all(hasattr(t, "_dmuon_starts") for t in tensors):
        tensors[0]._dmuon_starts.insert(0, key)
        return True
    starts = [key]  # the groups this hook starts, in reverse forward order

    def pre_backward(_grads: Any) -> None:
        for key in starts:
            with record_function(f"dmuon::pre_backward ({key or '<root>'})"):
                st.on_backward_start()
                if key is not None:
                    st.unshard(key, regather=True)
                    prev = st.forwards.next_group(key, backward=True)
                    if prev is not None and st.groups[prev].reshard_after_forward:
                        st.unshard(prev, regather=True, wait=False)

    for t in tensors:
        t._dmuon_starts = starts
    torch.autograd.graph.register_multi_grad_hook(tensors, _eager(pre_backward), mode="any")
    return True


def check_fsdp_sees_output(model: nn.Module, output: Any) -> None:
    """Raise when FSDP2 would silently leave its own params untrained: ``model`` is the only
    ``fully_shard``-ed module, holds FSDP2 params, and its output hides every tensor from FSDP2's
    pytree (so FSDP2's pre-backward hook never runs)."""
    root = fsdp_state(model)
    if root is None or not fsdp_param_groups(root) or fsdp_output_grad_tensors(output):
        return
    if any(n and fsdp_state(m) is not None for n, m in model.named_modules()):
        return  # other fully_shard modules' pre-backward hooks start FSDP2's work for the root
    raise RuntimeError(hidden_from_fsdp(type(model).__name__, type(output).__name__))


def register_hooks(model: nn.Module, st: DedicatedState) -> list[Any]:
    """Register every dmuon hook on ``model`` (boundary modules, the model, the params)."""
    handles: list[Any] = []
    has_root = ROOT_GROUP in st.groups
    root_only = not any(k != ROOT_GROUP for k in st.groups)

    def root_pre(module: nn.Module, args: Any) -> None:
        st.lazy_init()
        if not in_backward():
            st.begin_forward()
        if not has_root:
            return
        with record_function("dmuon::pre_forward (<root>)"):
            if not in_backward():
                st.note_forward(ROOT_GROUP)
                if root_only:  # the root group is the first (and only) hook group
                    st.notify_group_forward()
            st.unshard(ROOT_GROUP)

    def root_post(module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():
            return None
        st.finalize_order()
        if torch.is_grad_enabled() and _register_pre_backward(
                st, ROOT_GROUP if has_root else None, output):
            check_fsdp_sees_output(model, output)
        return None

    handles.append(model.register_forward_pre_hook(_eager(root_pre)))
    handles.append(model.register_forward_hook(_eager(root_post)))

    for key, g in st.groups.items():
        if key == ROOT_GROUP:
            continue

        def pre(module: nn.Module, args: Any, key: str = key) -> None:
            st.lazy_init()  # (called directly before the model's first forward: as FSDP2)
            with record_function(f"dmuon::pre_forward ({key})"):
                if in_backward():  # activation-checkpoint recomputation
                    st.unshard(key, regather=True)
                    return
                st.note_forward(key)
                st.notify_group_forward()  # the optimizer's listener (offload: deferred copies back)
                st.unshard(key)
                if (nxt := st.forwards.next_group(key)) is not None:
                    st.unshard(nxt, wait=False)

        def post(module: nn.Module, args: Any, output: Any, key: str = key) -> Any:
            if in_backward():
                return None
            with record_function(f"dmuon::post_forward ({key})"):
                hooked = torch.is_grad_enabled() and _register_pre_backward(st, key, output)
                # no hookable output tensor (or no grad): a Z3 group stays gathered until the end
                # of its backward (under no_grad: freed now); where other ranks hooked and freed
                # it, they re-gather it: this rank joins (kept_unhooked)
                g = st.groups[key]
                if g.reshard_after_forward and (hooked or not torch.is_grad_enabled()):
                    g.reshard()
                elif g.reshard_after_forward:
                    g.kept_unhooked = True
            return None

        handles.append(g.module.register_forward_pre_hook(_eager(pre)))
        handles.append(g.module.register_forward_hook(_eager(post)))

    # held by C++ (AccumulateGrad), out of gc's reach: a weak reference, or the model never dies
    st_ref = weakref.ref(st)

    def on_grad(param: nn.Parameter, name: str) -> None:
        if (state := st_ref()) is not None:
            state.on_grad(name, param)

    def before_grad(grad: torch.Tensor, name: str) -> None:  # a backward no group hook started
        if (state := st_ref()) is not None and state.ledger.records[name].shown:
            state.ledger.take_markers([name])  # (torch would add into a zero-stride marker)

    for name, p in st.params.items():
        handles.append(p.register_hook(_eager(partial(before_grad, name=name))))
        h = p.register_post_accumulate_grad_hook(_eager(partial(on_grad, name=name)))
        p._dmuon_grad_hook = h.id  # kept last among the param's hooks (state.on_grad, guards)
        handles.append(h)
    return handles
