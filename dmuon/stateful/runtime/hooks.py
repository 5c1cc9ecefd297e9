"""Forward / backward hooks that move the dedicated params of each hook group.

Per hook-boundary module (a ``layers.N`` block by default — never a leaf, since a module such as
``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``):

* pre-forward: gather the group (broadcast owner -> shard group, compute dtype) and launch the
  gather of the next group in forward order (prefetch);
* post-forward: register the pre-backward hook on the outputs' tensors; Z3 frees the gathered copy;
* pre-backward (a multi-grad hook on those tensors, fires before the block's backward): queue the
  end-of-backward callback once per backward, re-gather (Z3), prefetch the previous group;
* post-accumulate-grad on every dedicated param: the state collects the local grad (and queues the
  end-of-backward callback, should no pre-backward hook have fired) and launches the reduces that
  are due, in the one order every rank uses (:mod:`dmuon.stateful.runtime.state`). It runs after
  the user's own post-accumulate-grad hooks on the param, whenever they were registered, so they
  see the local gradient as torch gives it (:meth:`~dmuon.stateful.runtime.state.DedicatedState.
  on_grad`).

**Any forward output.** The pre-backward hook needs the tensors of the output. Like FSDP2, dmuon
looks for them with torch's pytree (tensors, tuples, lists, dicts, HF ``ModelOutput``), and beyond
it through dataclass fields and the attributes of any other object (:func:`grad_tensors`). If an
output holds no tensor that requires grad (or hides them from both), a Z3 group keeps its gathered
copy through the backward instead of freeing it after forward (as Z2 does), so its backward never
needs a re-gather; the end-of-backward callback is then queued by the params' grad hooks. Either
way every dedicated param gets its gradient, whatever forward returns.

Activation checkpointing (non-reentrant) re-runs a block's forward *inside* backward: the hooks see
:func:`~dmuon.compat.torch_api.in_backward` and then only make sure the group is gathered (no
prefetch, no free, no new backward hook), so recomputation neither re-reduces nor double-counts.
The model itself gets hooks too: pre-forward runs the state's lazy init (dtypes, layouts),
post-forward fixes the prefetch order after the first forward. HSDP: a group's gather first waits
that group's pending post-step publish; the end-of-backward callback waits the rest.

``torch.compile``: every hook is wrapped in ``torch.compiler.disable`` (as FSDP2 does with its
own), so when a user compiles a block or the model, the hooks run eagerly as graph breaks:
collectives, ``.data`` swaps and storage resizes never enter a graph.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from dmuon.compat.torch_api import (fsdp_output_grad_tensors, fsdp_param_groups, fsdp_state,
                                   in_backward, tree_leaves)
from dmuon.stateful.runtime.state import ROOT_GROUP, DedicatedState

__all__ = ["grad_tensors", "register_hooks", "check_fsdp_sees_output"]

_MAX_DEPTH = 6


def _eager(fn: Any) -> Any:
    """``fn`` kept out of any ``torch.compile`` graph (runs eagerly; a graph break if reached)."""
    return torch.compiler.disable(fn, recursive=True)


def _collect(obj: Any, out: list[torch.Tensor], seen: set[int], depth: int) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return
    if depth > _MAX_DEPTH or id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int,
                                                                             float, bool)):
        return
    seen.add(id(obj))
    try:
        leaves = tree_leaves(obj)
    except Exception:  # noqa: BLE001 - an exotic container pytree cannot flatten
        leaves = [obj]
    if len(leaves) != 1 or leaves[0] is not obj:  # pytree knew the container (ModelOutput too)
        for leaf in leaves:
            _collect(leaf, out, seen, depth + 1)
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
        _collect(child, out, seen, depth + 1)


def grad_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors requiring grad in a forward output: pytree leaves (tensors, tuples, lists,
    dicts, HF ``ModelOutput``), dataclass fields, and the attributes of other objects (``__dict__``
    or ``__slots__``), up to 6 levels deep; modules and classes are not entered."""
    found: list[torch.Tensor] = []
    _collect(output, found, set(), 0)
    uniq = {id(t): t for t in found if t.requires_grad}
    return list(uniq.values())


def _register_pre_backward(st: DedicatedState, key: str | None, output: Any) -> bool:
    """Hook the output's tensors so that the backward of ``key`` starts with dmuon's pre-backward;
    False when the output has none (the caller then keeps the group gathered)."""
    tensors = grad_tensors(output)
    if not tensors:
        return False

    def pre_backward(_grads: Any) -> None:
        with record_function(f"dmuon::pre_backward ({key or '<root>'})"):
            st.on_backward_start()
            if key is not None:
                st.unshard(key, regather=True)
                prev = st.next_group(key, backward=True)
                if prev is not None and st.groups[prev].reshard_after_forward:
                    st.launch_unshard(prev, regather=True)

    torch.autograd.graph.register_multi_grad_hook(tensors, _eager(pre_backward), mode="any")
    return True


def check_fsdp_sees_output(model: nn.Module, output: Any) -> None:
    """Raise when FSDP2 would silently leave its own params untrained: ``model`` is the only
    ``fully_shard``-ed module, it holds FSDP2 params, and its forward output hides every tensor
    from FSDP2 (a plain object: dmuon finds the tensors in its attributes, FSDP2 does not). FSDP2's
    backward work (reducing the gradients of every param it manages) starts from a pre-backward
    hook on the output's tensors, or from another ``fully_shard`` module's: here none runs."""
    root = fsdp_state(model)
    if root is None or not fsdp_param_groups(root) or fsdp_output_grad_tensors(output):
        return
    others = [n for n, m in model.named_modules() if n and fsdp_state(m) is not None]
    if others:  # their pre-backward hooks start FSDP2's backward work for the root too
        return
    cls = type(output).__name__
    raise RuntimeError(
        f"dmuon: {type(model).__name__}.forward returned a {cls} object that hides its tensors "
        f"from torch's pytree, so FSDP2 cannot hook the backward of this model (its only "
        "fully_shard module): the gradients of FSDP2's own params would never be reduced and "
        "those params would silently not train (dmuon's matrices would). Return the loss in a "
        f"tensor, tuple, dict, dataclass or Hugging Face ModelOutput, or register {cls} with "
        "torch.utils._pytree (register_pytree_node / register_dataclass); or fully_shard the "
        "model's blocks too.")


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
        if torch.is_grad_enabled():
            if _register_pre_backward(st, ROOT_GROUP if has_root else None, output):
                check_fsdp_sees_output(model, output)
        return None

    handles.append(model.register_forward_pre_hook(_eager(root_pre)))
    handles.append(model.register_forward_hook(_eager(root_post)))

    for key, g in st.groups.items():
        if key == ROOT_GROUP:
            continue

        def pre(module: nn.Module, args: Any, key: str = key) -> None:
            st.lazy_init()
            with record_function(f"dmuon::pre_forward ({key})"):
                if in_backward():  # activation-checkpoint recomputation
                    st.unshard(key, regather=True)
                    return
                st.note_forward(key)
                st.notify_group_forward()  # the optimizer's listener (offload: deferred copies back)
                st.unshard(key)
                nxt = st.next_group(key)
                if nxt is not None:
                    st.launch_unshard(nxt)

        def post(module: nn.Module, args: Any, output: Any, key: str = key) -> Any:
            if in_backward():
                return None
            with record_function(f"dmuon::post_forward ({key})"):
                hooked = torch.is_grad_enabled() and _register_pre_backward(st, key, output)
                # no hookable output tensor (or no grad): a Z3 group stays gathered until the end
                # of its backward, which then needs no re-gather (under no_grad: freed now)
                if st.groups[key].reshard_after_forward and (hooked or not torch.is_grad_enabled()):
                    st.groups[key].reshard()
            return None

        handles.append(g.module.register_forward_pre_hook(_eager(pre)))
        handles.append(g.module.register_forward_hook(_eager(post)))

    # a param's grad hook is held by C++ (its AccumulateGrad), which Python's gc cannot traverse:
    # holding the state there would keep the state, FSDP2's states and the model alive forever
    # (a cycle through C++); a weak reference breaks it (the model holds the state)
    st_ref = weakref.ref(st)

    def on_grad(param: nn.Parameter, name: str) -> None:
        state = st_ref()
        if state is not None:
            state.on_grad(name, param)

    for name, p in st.params.items():
        h = p.register_post_accumulate_grad_hook(
            _eager(lambda param, name=name: on_grad(param, name)))
        p._dmuon_grad_hook = h.id  # kept last among the param's hooks (state.on_grad, guards)
        handles.append(h)
    return handles
