"""Tensor parallelism (DTensor ``parallelize_module``) with dedicated ownership: each TP slice is
dedicated inside its own dp grid, so a matrix's ``T`` slice owners form one TP group; they run the
elementwise stages on their slices and gather / scatter only Newton–Schulz's input and output
(:class:`TPStep`). Unsupported layouts raise :class:`TensorParallelUnsupported` on every rank.

Design notes: docs/design/modes.md, "dmuon.stateful.modes.tensor_parallel".
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.compat.torch_api import module_param_slots
from dmuon.functional.selection import names_by_object
from dmuon.functional.state_fields import tp_concat_dim
from dmuon.functional.tp_plan import TPLayout, tp_roots
from dmuon.compat.spmd_mesh import spmd_typed
from dmuon.functional.tp_setup import spmd_layouts_of
from dmuon.functional.tp_step import (grad_agreement_verdict, grad_agreement_vector, group_max,
                                      tp_orthogonalizer, tp_sum_partials)
from dmuon.stateful.runtime.agree import rank_flags
from dmuon.stateful.runtime.errors import (TP_FIX, TensorParallelUnsupported, from_dtensor_api,  # noqa: F401
                                      refuse_tp, tp_error)
from dmuon.stateful.runtime.guards import to_plain, to_tp_slice_guard

__all__ = ["TensorParallelUnsupported", "TP_FIX", "TPLayout", "TPForward", "TPStep",
           "from_dtensor_api", "tp_error", "tp_layouts", "refuse_tp", "assemble_tp_slices",
           "full_shape", "local_part"]


def _is_dtensor(p: Any) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(p, DTensor)


def tp_layouts(model: nn.Module, chosen: Mapping[str, Any], axes: Any = None,
               mesh: Any = None) -> tuple[dict[str, TPLayout], dict[str, TPLayout]]:
    """``(TP layouts, whole views)`` of the chosen params (``axes``: a full SPMD ``mesh``'s, from
    ``dp_mesh_dims``): :func:`dmuon.functional.tp_setup.spmd_layouts_of`, which names what it
    refuses (``TensorParallelUnsupported`` / ``ValueError``). Plain params with ``spmd_types``
    annotations are read by :func:`dmuon.compat.spmd_mesh.spmd_types_of`."""
    from torch.distributed.tensor import Replicate, Shard
    dts = {n: p for n, p in chosen.items() if _is_dtensor(p)}
    annotated, typed = spmd_typed(model, {n: p for n, p in chosen.items() if n not in dts},
                                  mesh, read=axes is not None and bool(axes.model))
    return spmd_layouts_of(
        dts, names_by_object(model.named_parameters(remove_duplicate=False)), axes,
        plain=[n for n in chosen if n not in dts], shard_type=Shard, replicate_type=Replicate,
        annotated=annotated, fix=TP_FIX, error=TensorParallelUnsupported, typed=typed,
        spmd_mesh=mesh)


class TPForward:
    """Hooks that show each TP-sliced dedicated param as TP's DTensor (``DTensor.from_local`` of
    its gathered slice) for the whole forward of its hook group's module; registered after
    dmuon's group hooks. Afterwards a gathered slice is a ``TPSliceGuard``. A ``local`` layout's
    param (spmd_types: the model computes on plain slices) is left its plain slice throughout."""

    def __init__(self, model: nn.Module, layouts: Mapping[str, TPLayout],
                 group_of: Mapping[str, str], group_modules: Mapping[str, nn.Module]):
        self.layouts = dict(layouts)
        by_group: dict[str, list[tuple[nn.Module, str, str]]] = {}
        for n in (n for n, lay in layouts.items() if not lay.local):  # local: plain slices
            mod_name, _, leaf = n.rpartition(".")
            owner = model.get_submodule(mod_name) if mod_name else model
            by_group.setdefault(group_of[n], []).append((owner, leaf, n))
        self.handles = []
        for key, slots in by_group.items():
            module = group_modules[key]
            self.handles.append(module.register_forward_pre_hook(self._pre(slots)))
            self.handles.append(module.register_forward_hook(self._post(slots), always_call=True))

    def _pre(self, slots: list[tuple[nn.Module, str, str]]) -> Callable:
        from torch.distributed.tensor import DTensor

        @torch.compiler.disable
        def hook(module: nn.Module, args: Any) -> None:
            for owner, leaf, n in slots:
                plain = module_param_slots(owner)[leaf]
                if _is_dtensor(plain):  # re-entered (activation checkpointing): already shown
                    continue
                lay = self.layouts[n]
                owner.__dict__.setdefault("_dmuon_tp_plain", {})[leaf] = plain
                to_plain(plain)
                module_param_slots(owner)[leaf] = DTensor.from_local(
                    plain, lay.mesh, lay.placements, run_check=False, shape=torch.Size(lay.shape),
                    stride=lay.stride)
        return hook

    def _post(self, slots: list[tuple[nn.Module, str, str]]) -> Callable:
        @torch.compiler.disable
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for owner, leaf, _ in slots:
                plain = owner.__dict__.get("_dmuon_tp_plain", {}).pop(leaf, None)
                if plain is not None:
                    module_param_slots(owner)[leaf] = plain
                    if plain.numel() > 0:  # still gathered: reads outside the window raise
                        to_tp_slice_guard(plain)
        return hook


class TPStep:
    """The owners' side of a step with TP-sliced matrices, of the model's dedicated state ``rt``
    (its TP layouts; the names this rank owns, its slices, the same on every rank of its TP
    group; its TP group; the executor that runs the step program's ``tp`` phase and counts its
    bytes on lane ``"tp"``)."""

    def __init__(self, rt: Any):
        mg, owned, lay = rt.mesh_groups, rt.owned_names, rt.tp_layouts  # the state's, read here
        self.rt = rt
        self.names = tuple(n for n in owned if n in lay)
        # matrices without TP: their gradients must agree across the TP group (checked each step)
        self.replicated = tuple(n for n in owned if n not in lay)
        self.check_replicated = any(n not in lay for n in rt.names)
        self.control = mg.control
        self.device = torch.device(rt.device)  # of the small agreement tensors (NCCL: CUDA)
        self.group, self.ranks, self.index = mg.tp_group, tuple(mg.tp_ranks), int(mg.tp_index)
        self.executor = rt.executor  # runs the step program's "tp" phase
        self.T = len(self.ranks)
        # the NS root of each matrix (the plan's: dmuon.functional.tp_plan)
        self.root: dict[str, int] = tp_roots({n: lay[n].shape for n in self.names}, self.T)
        self.dims = {n: t.dim for n, t in lay.items()}  # the sliced dim of each
        self.world = dist.get_world_size()
        #: the ``sum_hook`` of a variant's stages (:func:`~dmuon.functional.tp_step.
        #: tp_sum_partials`, through the executor)
        self.sum_partials = partial(tp_sum_partials, dims=self.dims, ranks=self.ranks,
                                    world=self.world, run=self.executor.run)

    def agree_grads(self, grads: dict[str, Optional[torch.Tensor]],
                    masters: Mapping[str, torch.Tensor]) -> dict[str, Optional[torch.Tensor]]:
        """Make the TP group agree on which matrices have a gradient this step (a missing slice
        gets zeros) and check the non-TP matrices' gradients agree (one small all-reduce)."""
        out, bad = dict(grads), []
        if self.names or self.replicated:
            vec = torch.tensor(grad_agreement_vector(grads, self.names, self.replicated),
                               dtype=torch.float64, device=self.device)
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.group)
            present, bad = grad_agreement_verdict(vec.tolist(), self.names, self.replicated)
            for n in present:
                if out.get(n) is None:
                    out[n] = torch.zeros_like(masters[n])
        if self.check_replicated:
            self._agree_replicated(bad)
        return out

    def _agree_replicated(self, bad: list[str]) -> None:
        """Raise on every rank if any TP group's ranks hold different gradients of a non-TP matrix."""
        mine = torch.tensor([float(bool(bad))], dtype=torch.float32, device=self.device)
        if bool(rank_flags(mine, what="TP replicated-gradient agreement", via=self.control).any()):
            here = f" (here: {bad[:4]})" if bad else ""
            raise TensorParallelUnsupported(
                "dmuon.Muon.step: the ranks of a TP group computed different gradients for a "
                f"dedicated matrix that TP does not shard{here}, so its copies in the TP indices' "
                "grids would diverge. Nothing was updated. Its input differs across the TP group "
                "(e.g. sequence-parallel activations): shard it with TP too (ColwiseParallel / "
                "RowwiseParallel), or leave it to AdamW (predicate).")

    @property
    def bytes_received(self) -> int:
        """Bytes this rank received in the TP gathers / scatters (all steps): the executor's
        ``"tp"`` lane, counted like every other lane."""
        return self.executor.counters().get("tp", {}).get("received_bytes", 0)

    def orthogonalizer(self, inner: Callable[[list], Sequence[torch.Tensor]],
                       input_names: Sequence[str]) -> Callable[[list], list]:
        """``inner`` (an orthogonalizer of full matrices) behind the TP group's gathers and
        scatters of the step program's ``tp`` phase, run by the executor
        (:func:`dmuon.functional.tp_step.tp_orthogonalizer`)."""
        return tp_orthogonalizer(inner, input_names, tp=self.rt.program.tp, ranks=self.ranks,
                                 index=self.index, roots=self.root, dims=self.dims,
                                 run=self.executor.run)

    def max_over_group(self, values: torch.Tensor) -> torch.Tensor:
        """The MAX of the vector ``values`` over this rank's TP group (one ``AllReduce`` op on lane
        ``"tp"``; same length and order on every rank; NaN kept): an 8-bit momentum's whole-matrix
        absmaxes (:meth:`~dmuon.stateful.optimizer.state_storage.MomentumStorage.share_scales`)."""
        v = values.detach().to(device=self.device, dtype=torch.float32)
        return group_max(v, self.ranks, self.world, self.executor.run).to(values.device)


def assemble_tp_slices(layouts: Mapping[str, TPLayout], values: Mapping[str, torch.Tensor],
                       group: Any, layout: str = "param") -> dict[str, torch.Tensor]:
    """Collective over the TP group: ``values`` (every rank's slice of each TP matrix, or of its
    state field of ``layout``; other names pass through) with each slice replaced by the whole
    (one all-gather per TP matrix, in ``values``' order, which is the same on every rank)."""
    out = dict(values)
    for n, v in values.items():
        lay = layouts.get(n)
        rule = tp_concat_dim(layout, getattr(lay, "dim", None))
        if rule is None:
            continue
        x = v.contiguous()
        parts = [torch.empty_like(x) for _ in range(lay.parts)]
        dist.all_gather(parts, x, group=group)
        out[n] = torch.cat(parts, dim=rule)
    return out


def full_shape(rt: Any, name: str) -> tuple[int, ...]:
    """The single-device shape of dedicated param ``name`` (a TP slice's full matrix)."""
    lay = rt.tp_layouts.get(name)
    return tuple(lay.shape) if lay is not None else tuple(rt.shape[name])


def local_part(rt: Any, name: str, full: Any, layout: str = "param") -> Any:
    """This rank's TP slice of a full value of dedicated param ``name`` (or of its state field
    of ``layout``: :func:`~dmuon.functional.state_fields.tp_concat_dim`); the value itself for a
    matrix without TP, a field every TP rank holds whole, or ``None``."""
    lay = rt.tp_layouts.get(name)
    rule = tp_concat_dim(layout, getattr(lay, "dim", None))
    if rule is None or full is None or _is_dtensor(full):
        return full
    return full.chunk(lay.parts, dim=rule)[rt.mesh_groups.tp_index]
