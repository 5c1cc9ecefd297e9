"""The root state of a dedicated model: groups, forward order, weights version, the backward and
step protocols, the HSDP publish.

One :class:`DedicatedState` is attached to a model by :func:`dmuon.dedicate_params`
(``model._dmuon_state``; read it with :func:`get_state`). It is the only object the hooks, the
optimizer and the state-dict functions talk to, as FSDP2's ``FSDPState`` is for its param groups.
It owns:

* the :class:`~dmuon.stateful.runtime.storage.DedicatedStorage` (masters, placeholders) and the
  :class:`~dmuon.stateful.runtime.storage.GradBufferPool`;
* one :class:`~dmuon.stateful.runtime.param_group.DedicatedParamGroup` per hook group, in forward order;
* the plan, the lane process groups and the executor (built by ``dedicate_params``), and the bucket
  layouts and schedules (built once, at the first forward, when FSDP2's dtypes are known).

**Same collectives on every rank.** Every collective a rank issues must come in the same order on
every rank of its process group, whatever arrives when. Gathers follow the forward order (agreed
across ranks once, at the end of the first forward). Gradient reduces are issued in one fixed
order, the reverse of the static group order, the same on every rank: a group whose local
gradients are all in may launch its reduce as soon as every group before it in that order has;
the end of the backward launches the rest, in order. A param with no local gradient sends zeros
and presence 0 (DDP's ``find_unused_parameters`` semantics): its average counts it as zero, and
a param no rank had a gradient for is skipped by the update, as a single-device optimizer skips
``grad is None``.

**Step protocol** (the optimizer's narrow interface): :meth:`reduced_grads` (waits, returns the
owner's averaged gradients, ``None`` for params no rank had one for), :meth:`owned_masters`,
:meth:`clear_grads`, :meth:`after_step` (weights version bump, gathered copies freed, HSDP publish),
:meth:`masters_changed` (a state-dict load), :meth:`attach_optimizer` / :meth:`is_current`.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.functional.buckets import HookGroups, bucket_layout
from dmuon.functional.policy import resolve_group_dtypes
from dmuon.compat.torch_api import fsdp_mp_policy, queue_backward_callback
from dmuon.stateful.runtime.consumed_grads import ConsumedGrads
from dmuon.compat.fsdp_info import find_fsdp_state, mean_to_fsdp_scale
from dmuon.stateful.runtime.executor import Executor
from dmuon.compat.fsdp_patch import check_not_taken_over
from dmuon.stateful.runtime.grad_markers import GradMarkersMixin
from dmuon.stateful.runtime.guards import DedicatedGradMarker
from dmuon.stateful.runtime.param_group import DedicatedParamGroup, GradState, ReducedGrad
from dmuon.stateful.runtime.process_groups import MeshGroups
from dmuon.stateful.runtime.publish import PublishMixin
from dmuon.stateful.runtime.storage import DedicatedStorage, GradBufferPool

logger = logging.getLogger(__name__)

ROOT_GROUP = ""
#: the model attribute ``dedicate_params`` stores the state in (read it with :func:`get_state`)
STATE_ATTR = "_dmuon_state"

__all__ = ["ROOT_GROUP", "STATE_ATTR", "DedicatedState", "find_state", "get_state",
           "local_tensor"]


class DedicatedState(GradMarkersMixin, PublishMixin):
    """Root state of the dedicated params of one model (see the module docstring)."""

    def __init__(self, *, model: nn.Module, params: Mapping[str, nn.Parameter], plan: Any,
                 mesh_groups: MeshGroups, executor: Executor, groups: HookGroups,
                 group_modules: Mapping[str, nn.Module], reshard_after_forward: bool,
                 mp_policy: Any, batch_dims: Mapping[str, int],
                 meta_shapes: Optional[Mapping[str, tuple[int, ...]]] = None,
                 meta_device: Optional[torch.device] = None,
                 param_dtypes: Optional[Mapping[str, Any]] = None,
                 reduce_dtypes: Optional[Mapping[str, Any]] = None,
                 master_dtypes: Optional[Mapping[str, Any]] = None,
                 views: Optional[Mapping[str, Any]] = None,
                 view_sources: Optional[Mapping[str, str]] = None,
                 hp_mults: Optional[Mapping[str, tuple[float, float]]] = None,
                 tp_layouts: Optional[Mapping[str, Any]] = None):
        self.model_ref = weakref.ref(model)
        self.params: dict[str, nn.Parameter] = dict(params)
        self.names: tuple[str, ...] = tuple(params)
        self.plan = plan
        self.mesh_groups = mesh_groups
        self.executor = executor
        self.hook_groups = groups
        self.G, self.R = mesh_groups.shard_size, mesh_groups.replicate_size
        self.coord: tuple[int, int] = tuple(mesh_groups.coord)
        self.rank: int = mesh_groups.rank
        self.owners: dict[str, tuple[int, int]] = {n: tuple(plan.owner(n)) for n in self.names}
        self.owner_rank: dict[str, int] = {
            n: mesh_groups.global_rank(*self.owners[n]) for n in self.names}
        self.owned_names: tuple[str, ...] = tuple(
            n for n in self.names if self.owners[n] == self.coord)
        self._owned = frozenset(self.owned_names)
        self.batch_dims = dict(batch_dims)
        # the policy's decisions (dedicate_params): matrix views (what NS / the lr scale see), where
        # each view came from, and (lr_mult, wd_mult) per param
        self.views: dict[str, Any] = dict(views or {})
        self.view_sources: dict[str, str] = dict(view_sources or {})
        self.hp_mults: dict[str, tuple[float, float]] = dict(hp_mults or {})
        # TP: {name: TPLayout} of the TP-sliced matrices and their forward hooks (tensor_parallel)
        self.tp_layouts: dict[str, Any] = dict(tp_layouts or {})
        self.tp_forward: Any = None
        self.mp_policy = mp_policy
        # policy rules' per-param dtypes; resolved at the first forward into compute / reduce
        self.rule_param_dtype = dict(param_dtypes or {})
        self.rule_reduce_dtype = dict(reduce_dtypes or {})
        self.compute_dtype: dict[str, torch.dtype] = {}  # {name: gathered-copy dtype}
        self.reduce_dtype: dict[str, torch.dtype] = {}   # {name: reduce dtype}
        self.reshard_after_forward = reshard_after_forward
        self.storage = DedicatedStorage(self.params, self.owners, groups, self.G, self.R,
                                        self.coord, shapes=meta_shapes, device=meta_device,
                                        master_dtypes=master_dtypes)
        self.pool = GradBufferPool(self.coord[0], self.storage.device)
        self.groups: dict[str, DedicatedParamGroup] = {
            key: DedicatedParamGroup(
                key=key, module=group_modules[key], names=groups.names(key), storage=self.storage,
                executor=executor, reshard_after_forward=reshard_after_forward and key != ROOT_GROUP)
            for key in groups.order}
        self.group_of = groups.as_mapping()
        self.order: list[str] = list(groups.order)  # forward order; agreed at the first forward
        self._seen_order: list[str] = []
        self._order_final = False
        self._calls: dict[str, int] = {}   # calls of each group in the current forward
        self.reused: set[str] = set()      # groups once called twice in a forward: reduce at the end
        self._reduce_order: tuple[str, ...] = tuple(reversed(groups.order))
        self._reduce_next = 0          # index into _reduce_order of the next reduce to launch
        self.version = 0               # weights change at every step: older gathers are stale
        self.require_grad_sync = True  # False inside dmuon.no_sync
        self.local_grads: dict[str, torch.Tensor] = {}
        # names whose local grad went into a reduce, or that this rank owns in a launched reduce
        # (it holds their reduced gradient, also without a local one: they get markers too)
        self._sent: set[str] = set()
        self._reduced: dict[str, torch.Tensor] = {}
        self._present_here: set[str] = set()
        self._flags: dict[str, list[torch.Tensor]] = {}
        self._resolved: Optional[dict[str, Optional[torch.Tensor]]] = None
        self._callback_queued = False
        self.ready = False
        self._optimizer_generation = 0
        # a synced backward ran since the last step (step() refuses to run without one)
        self.fresh_grads = False
        # ``.grad`` markers of placeholders whose gradient dmuon holds (see dmuon.stateful.runtime.guards)
        self._markers: dict[str, DedicatedGradMarker] = {}
        self._marked: set[str] = set()
        #: after a step, the owners' consumed gradients as torch's ``.grad`` would still show them
        self.consumed = ConsumedGrads()
        # Muon(check_finite=True): whether a gradient this rank sent was non-finite (0-d, device)
        self.track_local_finite = False
        self.local_nonfinite: Optional[torch.Tensor] = None
        # the 1-D shard mesh (DTensor rows of model.state_dict(), see torch_state_dict.py), set by
        # dedicate_params; raw_state_dict: model.state_dict() keeps placeholders (dmuon's reads)
        self.shard_mesh: Any = None
        self.raw_state_dict = False
        self._transfer: Any = None
        self._fsdp_states: dict[str, Any] = {}  # {group key: enclosing FSDP2 state} (lazy init)
        # "fsdp" or "ddp" (dedicate_params(data_parallel=...); DDP mode: dmuon.stateful.modes.ddp)
        self.data_parallel = "fsdp"
        #: the open init window of a meta-built model (:mod:`dmuon.stateful.modes.meta_init`), or None
        self.meta_init: Any = None
        if meta_shapes is not None:
            from dmuon.stateful.modes.meta_init import MetaInit
            self.meta_init = MetaInit.open(self)

    # ------------------------------------------------------------------ read-only views
    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def masters(self) -> dict[str, torch.Tensor]:
        """``{name: master}`` of this rank's column (HSDP: every rank of the owner's column)."""
        return self.storage.masters

    @property
    def shape(self) -> dict[str, tuple[int, ...]]:
        return self.storage.shape

    @property
    def orig_dtype(self) -> dict[str, torch.dtype]:
        return self.storage.orig_dtype

    @property
    def master_dtype(self) -> dict[str, torch.dtype]:
        return self.storage.master_dtype

    @property
    def checkpoint_transfer(self) -> Any:
        """The :class:`~dmuon.stateful.checkpoint.transfer.CheckpointTransfer` of this model
        (bucketed state-dict and checkpoint transfers; built at first use)."""
        if self._transfer is None:
            from dmuon.stateful.checkpoint.transfer import CheckpointTransfer
            self._transfer = CheckpointTransfer(self)
        return self._transfer

    def finish_meta_init(self, what: str) -> None:
        """Close the init window of a meta-built model (collective; no-op when none is open;
        see :func:`dmuon.stateful.modes.meta_init.finish_meta_init`)."""
        if self.meta_init is not None:
            from dmuon.stateful.modes.meta_init import finish_meta_init
            finish_meta_init(self, what)

    def hp_groups(self, names) -> dict[tuple[float, float], list[str]]:
        """``names`` grouped by the policy's ``(lr_mult, wd_mult)`` (``(1, 1)`` without a rule),
        in order: one functional Muon update per group."""
        groups: dict[tuple[float, float], list[str]] = {}
        for n in names:
            groups.setdefault(self.hp_mults.get(n, (1.0, 1.0)), []).append(n)
        return groups

    def owned_masters(self) -> dict[str, torch.Tensor]:
        """``{name: master}`` of the matrices this rank runs Muon on (fixed at setup)."""
        return self.storage.owned_masters

    # ------------------------------------------------------------------ lazy init
    def lazy_init(self) -> None:
        """Resolve dtypes, build the gather / reduce layouts, schedules and buffers (the first
        forward, once: the compute and reduce dtypes come from FSDP2's policy).

        Per param, :func:`dmuon.functional.policy.resolve_group_dtypes` (policy rules over the
        group's ``MixedPrecisionPolicy``); a bucket holds one dtype (layouts are keyed by it)."""
        if self.ready:
            return
        self.finish_meta_init("dmuon (first forward)")
        model = self.model_ref()
        if model is not None:
            check_not_taken_over(model, self.params, "dmuon (first forward)")
        for g in self.groups.values():
            self._fsdp_states[g.key] = fsdp = find_fsdp_state(model, g.module)
            pol = self.mp_policy if self.mp_policy is not None else fsdp_mp_policy(fsdp)
            g.compute_dtype, g.reduce_dtype, cd, rd = resolve_group_dtypes(
                g.key or "<root>", {n: self.orig_dtype[n] for n in g.names},
                group_param_dtype=getattr(pol, "param_dtype", None),
                group_reduce_dtype=getattr(pol, "reduce_dtype", None),
                rule_param_dtype=self.rule_param_dtype, rule_reduce_dtype=self.rule_reduce_dtype)
            self.compute_dtype.update(cd)
            self.reduce_dtype.update(rd)
        cdt, rdt = self.compute_dtype, self.reduce_dtype
        unshard = bucket_layout(self.owners, self.shape, cdt, self.hook_groups, self.G, self.R)
        reduce = bucket_layout(self.owners, self.shape, rdt, self.hook_groups, self.G, self.R,
                               presence=True)
        for g in self.groups.values():
            g.setup(unshard, reduce, self.storage.master_layout)
        self.storage.set_placeholder_dtypes(cdt)
        self.ready = True

    # ------------------------------------------------------------------ forward order
    def begin_forward(self) -> None:
        """A forward of the model starts (not a checkpoint recomputation)."""
        self._calls.clear()

    def note_forward(self, key: str) -> None:
        """Record the order in which groups run forward (the first forward; used to prefetch) and
        groups called more than once in one forward (:attr:`reused`: under reentrant activation
        checkpointing their params get one gradient per call, so their reduce waits for the end
        of backward)."""
        self._calls[key] = self._calls.get(key, 0) + 1
        if self._calls[key] > 1:
            self.reused.add(key)
        if not self._order_final and key not in self._seen_order:
            self._seen_order.append(key)

    def finalize_order(self) -> None:
        """End of the first forward: the forward order, agreed across ranks (one all-gather,
        once). Ranks whose forwards ran the groups in different orders fall back, all of them,
        to the static group order (prefetching the same group on every rank)."""
        if self._order_final or not self._seen_order:
            return
        self._order_final = True
        rest = [k for k in self.order if k not in self._seen_order]
        mine = tuple(self._seen_order + rest)
        from dmuon.stateful.runtime.agree import gather  # local: this file is being rewritten
        orders = gather(mine, what="forward-order agreement (first forward)",
                        via=self.mesh_groups)
        if len(set(orders)) == 1:
            self.order = list(mine)
        else:
            logger.warning("dmuon: the first forward ran the hook groups in different orders on "
                           "different ranks; prefetching in the static module order instead")

    def next_group(self, key: str, backward: bool = False) -> Optional[str]:
        """The group after ``key`` in forward order (before it, ``backward=True``)."""
        if not self._order_final or key not in self.order:
            return None
        j = self.order.index(key) + (-1 if backward else 1)
        return self.order[j] if 0 <= j < len(self.order) else None

    # ------------------------------------------------------------------ gather / free
    def unshard(self, key: str) -> None:
        self._take_markers(self.groups[key].names)
        self.groups[key].unshard(self.version)

    def launch_unshard(self, key: str) -> None:
        self._take_markers(self.groups[key].names)
        self.groups[key].launch_unshard(self.version)

    def reshard_all(self) -> None:
        if self.ready:
            for g in self.groups.values():
                g.reshard()

    # ------------------------------------------------------------------ backward protocol
    def on_backward_start(self) -> None:
        """The first dmuon hook of a backward pass: queue :meth:`on_backward_end` once."""
        if not self._callback_queued:
            self._callback_queued = True
            queue_backward_callback(self.on_backward_end)

    def on_grad(self, name: str, param: nn.Parameter) -> None:
        """Post-accumulate-grad of a dedicated param: move the local grad aside; launch the
        reduces that are due (:meth:`_launch_due_reduces`)."""
        grad = param.grad
        if grad is None:
            return
        self.on_backward_start()  # forward outputs dmuon found no tensor in still end here
        param.grad = None
        prev = self.local_grads.get(name)
        self.local_grads[name] = grad if prev is None else prev.add_(grad)
        if not self.require_grad_sync:
            return
        key = self.group_of[name]
        self.groups[key].note_grad(name, defer=key in self.reused)
        self._launch_due_reduces()

    def _launch_reduce(self, key: str) -> None:
        g = self.groups[key]
        self._take_markers(g.names)  # markers of an earlier no_sync backward: still attached?
        self._sent.update(n for n in g.names if n in self.local_grads or n in self._owned)
        if self.track_local_finite:
            self._note_local_finite(g.names)
        g.launch_reduce(self.local_grads, self.pool)
        self._resolved = None
        g.reshard()  # its gradients are out: the gathered copy is not needed in this backward

    def _note_local_finite(self, names) -> None:
        """Accumulate, on the device, whether a local gradient this rank sends is non-finite."""
        grads = [self.local_grads[n] for n in names if n in self.local_grads]
        if not grads:
            return
        bad = (~torch.isfinite(torch.stack(torch._foreach_norm(grads)).float())).any()
        self.local_nonfinite = bad if self.local_nonfinite is None else self.local_nonfinite | bad

    def _launch_due_reduces(self) -> None:
        """Launch, in the fixed reduce order, every reduce whose group's gradients are complete
        and whose predecessors in that order are launched (the same sequence on every rank)."""
        order = self._reduce_order
        while self._reduce_next < len(order):
            key = order[self._reduce_next]
            if self.groups[key].grad_state is not GradState.COMPLETE:
                return
            self._launch_reduce(key)
            self._reduce_next += 1

    def on_backward_end(self) -> None:
        """End of a backward: launch every reduce not launched yet, in the fixed order (zeros and
        presence 0 for missing grads), free gathered copies, reset per-backward state."""
        self._callback_queued = False
        self.wait_publish()  # publishes of groups this forward did not use
        if self.require_grad_sync:
            for key in self._reduce_order[self._reduce_next:]:
                self._launch_reduce(key)
        self._reduce_next = 0
        if self.require_grad_sync:
            self.fresh_grads = True
        for g in self.groups.values():
            # weights change only at step(): Z2 keeps its gathered copy across no_sync micro-batches
            keep = not self.require_grad_sync and not g.reshard_after_forward
            if g.holds_gathered and not keep:
                g.reshard()
            g.reset_backward()
            self._attach_markers(g.names)

    # ------------------------------------------------------------------ step protocol
    def _collect(self) -> None:
        """Wait for every in-flight reduce (in launch order) and accumulate the owner's grads."""
        for key in self._reduce_order:
            for rg in self.groups[key].wait_reduces():
                self._accumulate(rg)

    def _accumulate(self, rg: ReducedGrad) -> None:
        k = mean_to_fsdp_scale(self._fsdp_states.get(self.group_of[rg.name]), self.G * self.R)
        if k is not None:  # FSDP2's set_gradient_divide_factor on the enclosing module
            rg.grad.mul_(k)
        prev = self._reduced.get(rg.name)
        self._reduced[rg.name] = rg.grad if prev is None else prev.add_(rg.grad)
        if rg.present_here:
            self._present_here.add(rg.name)
        elif rg.flag is not None:
            self._flags.setdefault(rg.name, []).append(rg.flag)
        self._resolved = None

    def reduced_grads(self) -> dict[str, Optional[torch.Tensor]]:
        """Wait for the pending reduces; ``{owned name: averaged gradient, or None}`` (``None``:
        no rank had a gradient for it since the last :meth:`clear_grads`, or no backward ran).

        Whether any rank had one is known without a host sync when the owner had a local gradient
        itself (every param of a dense model); otherwise the reduces' presence elements are read
        in one batch (one host sync on CUDA, in steps where that happens)."""
        self._take_markers(list(self._marked), remove=False)
        self._collect()
        if self._resolved is not None:
            return self._resolved
        unsure = [n for n in self._reduced if n not in self._present_here]
        absent: set[str] = set()
        if unsure:
            flags = torch.stack([torch.stack(self._flags[n]).amax() for n in unsure]).tolist()
            absent = {n for n, f in zip(unsure, flags) if not f > 0}
        self._resolved = {n: (self._reduced.get(n) if n not in absent else None)
                          for n in self.owned_names}
        return self._resolved

    def drain(self) -> None:
        """Wait for every collective dmuon has in flight (reduces and HSDP publishes), so that a
        caller can issue its own collectives (state dicts, checkpoints). Local."""
        self._collect()
        self.wait_publish()

    def has_pending_reduces(self) -> bool:
        return any(g.inflight_reduces for g in self.groups.values())

    def clear_grads(self) -> None:
        """Drop local and reduced grads (``Muon.zero_grad``, ``step``); buffers back to the pool."""
        self._collect()
        for n in list(self._marked):
            if self.params[n].grad is self._markers[n]:
                self.params[n].grad = None
        self._marked.clear()
        self._sent.clear()
        self.fresh_grads = False
        self.local_nonfinite = None
        self.local_grads.clear()
        self._reduced.clear()
        self._present_here.clear()
        self._flags.clear()
        self._resolved = None
        self.pool.release_all()

    def masters_changed(self) -> None:
        """The masters were written (a step, a state-dict load): bump :attr:`version` and free
        the gathered copies (the next forward gathers the new values)."""
        self.version += 1
        self.reshard_all()

    def after_step(self, *, replicate_async: bool = True) -> None:
        """After the owners updated their masters: :meth:`masters_changed`, then publish (HSDP)."""
        self.masters_changed()
        self.publish(replicate_async=replicate_async)

    def attach_optimizer(self) -> int:
        """A new ``dmuon.Muon`` on this model: returns its generation (it supersedes older ones)."""
        self._optimizer_generation += 1
        return self._optimizer_generation

    def is_current(self, generation: int) -> bool:
        return generation == self._optimizer_generation


def local_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t.to_local()`` for a DTensor (this rank's shard, a view); else ``t`` itself (or None)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def find_state(model: Any) -> Optional[DedicatedState]:
    """The state ``dedicate_params`` attached to ``model`` (``None`` if it has none); through a
    ``DistributedDataParallel`` wrapper (DDP mode), the wrapped module's."""
    from dmuon.stateful.modes.ddp import unwrap_model
    return getattr(unwrap_model(model), STATE_ATTR, None)


def get_state(model: nn.Module, what: str = "this call") -> DedicatedState:
    """The state ``dedicate_params`` attached to ``model``; clear error when there is none."""
    st = find_state(model)
    if st is None:
        raise RuntimeError(
            f"{what} needs a model prepared by dmuon.dedicate_params(model, mesh, predicate) "
            "(call it before fully_shard), but this model has no dedicated parameters.")
    return st
