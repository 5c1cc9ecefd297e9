"""Forward / backward hooks that move the dedicated params of one hook group.

Per hook-boundary module (a ``layers.N`` block by default — never a leaf, since a module such as
``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``):

* pre-forward: gather the group (broadcast owner -> shard group, compute dtype) and launch the
  gather of the next group in forward order (prefetch);
* post-forward: register the pre-backward hook on the outputs; Z3 frees the gathered copy;
* pre-backward (a multi-grad hook on the outputs, fires before the block's backward): queue the
  end-of-backward callback once per backward, re-gather (Z3), prefetch the previous group;
* post-accumulate-grad on every dedicated param: the runtime collects the local grad and, once the
  whole group has one, launches the group's reduce and frees the gathered copy.

Activation checkpointing (non-reentrant) re-runs a block's forward *inside* backward: the hooks see
``torch._C._current_graph_task_id() != -1`` and then only make sure the group is gathered (no
prefetch, no free, no new backward hook), so recomputation neither re-reduces nor double-counts.
The model itself gets hooks too: pre-forward readies the runtime (dtypes, layouts), post-forward
fixes the prefetch order after the first forward. HSDP: a group's gather (pre-forward or prefetch)
first waits that group's pending post-step publish; the end-of-backward callback waits the rest.

``torch.compile``: every hook is wrapped in ``torch.compiler.disable`` (as FSDP2 does with its
own), so when a user compiles a block (``layer.compile()``, whose compiled ``_call_impl`` runs the
hooks, ``torch.compile(layer)``) or the model, the hooks run eagerly as graph breaks: collectives,
``.data`` swaps and storage resizes never enter a graph, and runtime state (versions, flags) never
becomes a guard.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from dmuon.stateful.runtime import ROOT_GROUP, DedicatedRuntime


def _eager(fn: Any) -> Any:
    """``fn`` kept out of any ``torch.compile`` graph (runs eagerly; a graph break if reached)."""
    return torch.compiler.disable(fn, recursive=True)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    try:
        leaves = tree_leaves(output)
    except Exception:  # noqa: BLE001 - exotic output containers
        leaves = [output]
    if hasattr(output, "values") and not any(isinstance(x, torch.Tensor) for x in leaves):
        leaves = list(output.values())
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _register_pre_backward(rt: DedicatedRuntime, key: str | None, output: Any) -> None:
    if not torch.is_grad_enabled():
        return
    tensors = _grad_tensors(output)
    if not tensors:
        return

    def pre_backward(_grads: Any) -> None:
        rt.on_backward_start()
        if key is not None:
            rt.unshard(key)
            prev = rt.next_group(key, backward=True)
            if prev is not None and rt.groups[prev].reshard_after_forward:
                rt.launch_unshard(prev)

    torch.autograd.graph.register_multi_grad_hook(tensors, _eager(pre_backward), mode="any")


def register_hooks(model: nn.Module, rt: DedicatedRuntime) -> list[Any]:
    """Register every dmuon hook on ``model`` (boundary modules, the model, the params)."""
    handles: list[Any] = []
    has_root = ROOT_GROUP in rt.groups

    def root_pre(module: nn.Module, args: Any) -> None:
        rt.ensure_ready()
        if _in_backward():
            if has_root:
                rt.unshard(ROOT_GROUP)
            return
        # HSDP: no global drain here; each group's gather waits its own publish (overlap)
        if has_root:
            rt.note_forward(ROOT_GROUP)
            rt.unshard(ROOT_GROUP)

    def root_post(module: nn.Module, args: Any, output: Any) -> Any:
        if _in_backward():
            return None
        rt.finalize_order()
        _register_pre_backward(rt, ROOT_GROUP if has_root else None, output)
        return None

    handles.append(model.register_forward_pre_hook(_eager(root_pre)))
    handles.append(model.register_forward_hook(_eager(root_post)))

    for key, g in rt.groups.items():
        if key == ROOT_GROUP:
            continue

        def pre(module: nn.Module, args: Any, key: str = key) -> None:
            rt.ensure_ready()
            if _in_backward():  # activation-checkpoint recomputation
                rt.unshard(key)
                return
            rt.note_forward(key)
            rt.unshard(key)
            nxt = rt.next_group(key)
            if nxt is not None:
                rt.launch_unshard(nxt)

        def post(module: nn.Module, args: Any, output: Any, key: str = key) -> Any:
            if _in_backward():
                return None
            _register_pre_backward(rt, key, output)
            if rt.groups[key].reshard_after_forward:
                rt.reshard(key)
            return None

        handles.append(g.module.register_forward_pre_hook(_eager(pre)))
        handles.append(g.module.register_forward_hook(_eager(post)))

    for name, p in rt.params.items():
        handles.append(p.register_post_accumulate_grad_hook(
            _eager(lambda param, name=name: rt.on_grad(name, param))))
    return handles
