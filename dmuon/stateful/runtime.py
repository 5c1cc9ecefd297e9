"""The per-model runtime of dedicated parameters: storage, groups, plan, buckets, executor.

One :class:`DedicatedRuntime` is attached to a model by :func:`dmuon.dedicate_params`
(``model._dmuon_runtime``). It owns every mutable thing the dedicated matrices need and runs the
prebuilt schedules of :mod:`dmuon.functional.schedule` through the torch executor; it never does
math or planning itself.

Storage (per rank ``(s, r)`` of the ``(R, G)`` mesh):

* **masters** — for every dedicated matrix whose owner column is ``s`` (all of them when ``G == 1``):
  the authoritative copy, in the wider of the param's dtype and fp32, as a view into a flat
  *master bucket* (one per ``(group, column, master dtype)``) so that the HSDP publish broadcasts
  whole ranges. Only the owner ``(s, r_o)`` runs Muon on it; the other ranks of column ``s`` receive
  the publish.
* **gathered copies** — per hook group and owner column a flat *unshard bucket* in the group's
  compute dtype. It is allocated once; between uses its storage is resized to 0 bytes (as FSDP2
  does), so views saved by autograd stay valid and see the re-gathered data in backward. While a
  group is gathered, each param's ``.data`` is a view into its bucket; otherwise ``.data`` is a
  zero-size placeholder (``model.state_dict()`` on a rank shows empty tensors: use
  :func:`dmuon.get_model_state_dict`).
* **gradients** — the post-accumulate-grad hook moves each local gradient into ``local_grads`` and
  clears ``param.grad``; the group's reduce copies them into flat *reduce buckets* (reduce
  dtype), averages them to the owner column, and the owner keeps the views of its own column's
  bucket as ``reduced_grads`` (accumulated across synced backwards until ``step``/``zero_grad``).
  The own column's buckets are allocated once and reused every step (``grad_buffers``: stable
  addresses for the optimizer's graph-replayed NS, which uses them as donated scratch); other
  columns' buckets (send-only) and a second synced backward's buckets are transient.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from dmuon.functional.buckets import (
    BucketEntry, BucketKey, BucketLayout, HookGroups, bucket_layout, to_torch_dtype,
)
from dmuon.functional.schedule import (
    Schedule, publish_schedule, reduce_schedule, unshard_schedule,
)

logger = logging.getLogger(__name__)

ROOT_GROUP = ""
#: the model attribute ``dedicate_params`` stores the runtime in (read it with :func:`get_runtime`)
RUNTIME_ATTR = "_dmuon_runtime"


def master_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The master dtype of a param: the wider of its dtype and fp32 (fp64 stays fp64)."""
    if dtype.is_floating_point and torch.finfo(dtype).bits > 32:
        return dtype
    return torch.float32


def _free_storage(t: torch.Tensor) -> None:
    st = t.untyped_storage()
    if st.size() != 0:
        st.resize_(0)


def _alloc_storage(t: torch.Tensor) -> None:
    st = t.untyped_storage()
    want = t.numel() * t.element_size()
    if st.size() != want:
        st.resize_(want)


@dataclass
class GroupRuntime:
    """Mutable per-hook-group state."""

    key: str
    module: nn.Module
    names: tuple[str, ...]
    compute_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    gathered: bool = False            # params' .data point into the unshard buckets, data valid
    gathered_version: int = -1        # runtime.version at the time of the gather
    pending_unshard: Any = None       # executor handle of an in-flight (prefetched) gather
    accumulated: set = field(default_factory=set)   # names whose grad arrived this backward
    reduced_this_backward: bool = False
    reshard_after_forward: bool = True


class DedicatedRuntime:
    """State of the dedicated params of one model (see the module docstring).

    Built by ``dedicate_params``; used by the hooks, ``Muon``, ``no_sync``, the state-dict and the
    grad-clip functions.
    """

    def __init__(self, *, model: nn.Module, params: Mapping[str, nn.Parameter], plan: Any,
                 mesh_groups: Any, executor: Any, groups: HookGroups,
                 group_modules: Mapping[str, nn.Module], reshard_after_forward: bool,
                 mp_policy: Any, batch_dims: Mapping[str, int]):
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
        # names this rank runs Muon on (owner == this rank's coordinate); fixed at setup
        self.owned_names: tuple[str, ...] = tuple(
            n for n in self.names if self.owners[n] == self.coord)
        self.orig_dtype: dict[str, torch.dtype] = {n: p.dtype for n, p in self.params.items()}
        self.shape: dict[str, tuple[int, ...]] = {n: tuple(p.shape) for n, p in self.params.items()}
        self.master_dtype = {n: master_dtype_for(d) for n, d in self.orig_dtype.items()}
        self.device = next(iter(self.params.values())).device
        self.batch_dims = dict(batch_dims)
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.groups: dict[str, GroupRuntime] = {}
        for key in groups.order:
            self.groups[key] = GroupRuntime(
                key=key, module=group_modules[key], names=groups.names(key),
                reshard_after_forward=reshard_after_forward and key != ROOT_GROUP)
        self.group_of = groups.as_mapping()
        self.order: list[str] = list(groups.order)  # forward order; refined at the first forward
        self._seen_order: list[str] = []
        self._order_final = False
        # weights change at every step: a gather made before the step is stale afterwards
        self.version = 0
        self.require_grad_sync = True
        self.local_grads: dict[str, torch.Tensor] = {}
        self.reduced_grads: dict[str, torch.Tensor] = {}
        self._pending_reduces: list[tuple[Any, dict[BucketKey, torch.Tensor]]] = []
        # HSDP publish of the last step not yet waited, per hook group (see ``publish``)
        self.pending_publish: dict[str, Any] = {}
        self._publish_scheds: Optional[dict[str, Schedule]] = None
        self._callback_queued = False
        self.ready = False
        self.unshard_layout: Optional[BucketLayout] = None
        self.reduce_layout: Optional[BucketLayout] = None
        self._owned_entries: dict[BucketKey, tuple[BucketEntry, ...]] = {}  # see ensure_ready
        self.unshard_buffers: dict[BucketKey, torch.Tensor] = {}
        # own-column reduce buckets: allocated at first use, reused every step (stable addresses,
        # so the optimizer's NS graph replays on them); busy while they hold unconsumed grads
        self.grad_buffers: dict[BucketKey, torch.Tensor] = {}
        self._grad_busy: set[BucketKey] = set()
        # True (default): give the grad buffers' memory back after each step (storage resized to
        # 0, as the gathered copies): forward runs without them (H200, 1B Llama: peak -3.6 GiB,
        # below FSDP2+AdamW), but their addresses may change between steps, so the NS engine's
        # graph rarely replays (eager NS measured as fast, benchmarks/NOTES_step.md). False:
        # persistent buffers, NS graph replay, peak = FSDP2+AdamW's.
        self.release_grad_buffers = True
        self.optimizer_generation = 0  # bumped by each dmuon.Muon(model); only the newest steps
        self.unshard_schedules: dict[str, Schedule] = {}
        self.reduce_schedules: dict[str, Schedule] = {}
        self._placeholders: dict[str, torch.Tensor] = {}
        self._build_masters()

    # ------------------------------------------------------------------ setup
    def _build_masters(self) -> None:
        """Copy each dedicated param into its master bucket (own column only), free the rest."""
        self.master_layout = bucket_layout(
            self.owners, self.shape, {n: self.master_dtype[n] for n in self.names},
            self.hook_groups, self.G, self.R)
        self.master_buffers: dict[BucketKey, torch.Tensor] = {}
        self.masters: dict[str, torch.Tensor] = {}
        s = self.coord[0]
        for b in self.master_layout.buckets:
            if b.key.column != s:
                continue
            buf = torch.empty(b.numel, dtype=self.master_dtype[b.entries[0].name], device=self.device)
            self.master_buffers[b.key] = buf
            for e in b.entries:
                view = buf[e.offset:e.offset + e.numel].view(e.shape)
                with torch.no_grad():
                    view.copy_(self.params[e.name].detach())
                self.masters[e.name] = view
        # the owner's Muon update reads these every step: built once (masters never move)
        self.owned_masters: dict[str, torch.Tensor] = {n: self.masters[n] for n in self.owned_names}
        for n, p in self.params.items():
            ph = torch.empty(0, dtype=p.dtype, device=p.device)
            self._placeholders[n] = ph
            p.data = ph

    def resolve_dtypes(self) -> None:
        """Compute / reduce dtypes of every group: the explicit ``mp_policy`` or the FSDP2 one."""
        from dmuon.stateful.mixed_precision import find_mp_policy
        model = self.model_ref()
        for g in self.groups.values():
            pol = self.mp_policy if self.mp_policy is not None else find_mp_policy(model, g.module)
            orig = {self.orig_dtype[n] for n in g.names}
            param_dtype = getattr(pol, "param_dtype", None) if pol is not None else None
            reduce_dtype = getattr(pol, "reduce_dtype", None) if pol is not None else None
            if param_dtype is None and len(orig) > 1:
                raise ValueError(
                    f"hook group {g.key or '<root>'!r} mixes param dtypes {sorted(map(str, orig))} "
                    "with no MixedPrecisionPolicy.param_dtype; give the params one dtype or pass "
                    "mp_policy=MixedPrecisionPolicy(param_dtype=...) to dedicate_params")
            g.compute_dtype = param_dtype or next(iter(orig))
            g.reduce_dtype = reduce_dtype or g.compute_dtype

    def ensure_ready(self) -> None:
        """Build the unshard / reduce layouts, schedules and buffers (first forward, once)."""
        if self.ready:
            return
        self.resolve_dtypes()
        cdt = {n: self.groups[self.group_of[n]].compute_dtype for n in self.names}
        rdt = {n: self.groups[self.group_of[n]].reduce_dtype for n in self.names}
        self.unshard_layout = bucket_layout(self.owners, self.shape, cdt, self.hook_groups,
                                            self.G, self.R)
        self.reduce_layout = bucket_layout(self.owners, self.shape, rdt, self.hook_groups,
                                           self.G, self.R)
        # own-column reduce buckets -> the entries this rank owns (what wait_reduces keeps)
        self._owned_entries = {
            b.key: tuple(e for e in b.entries if e.owner == self.coord)
            for b in self.reduce_layout.buckets if b.key.column == self.coord[0]}
        for g in self.unshard_layout.groups:
            self.unshard_schedules[g] = unshard_schedule(self.unshard_layout, g)
            self.reduce_schedules[g] = reduce_schedule(self.reduce_layout, g)
        for b in self.unshard_layout.buckets:
            buf = torch.empty(b.numel, dtype=cdt[b.entries[0].name], device=self.device)
            _free_storage(buf)
            self.unshard_buffers[b.key] = buf
        for n in self.names:
            self._placeholders[n] = torch.empty(0, dtype=cdt[n], device=self.device)
            self.params[n].data = self._placeholders[n]
        self.ready = True

    # ------------------------------------------------------------------ forward order
    def note_forward(self, key: str) -> None:
        """Record the order in which groups run forward (used for prefetching)."""
        if self._order_final or key in self._seen_order:
            return
        self._seen_order.append(key)

    def finalize_order(self) -> None:
        if not self._order_final and self._seen_order:
            rest = [k for k in self.order if k not in self._seen_order]
            self.order = self._seen_order + rest
            self._order_final = True

    def next_group(self, key: str, backward: bool = False) -> Optional[str]:
        if not self._order_final or key not in self.order:
            return None
        i = self.order.index(key)
        j = i - 1 if backward else i + 1
        if 0 <= j < len(self.order):
            return self.order[j]
        return None

    # ------------------------------------------------------------------ unshard
    def _fill_sources(self, key: str) -> None:
        """Copy this rank's masters into the group's unshard buckets (it is the broadcast source)."""
        s = self.coord[0]
        for b in self.unshard_layout.buckets_of(key):
            if b.key.column != s:
                continue
            buf = self.unshard_buffers[b.key]
            for e in b.entries:
                buf[e.offset:e.offset + e.numel].view(e.shape).copy_(self.masters[e.name])

    def launch_unshard(self, key: str) -> None:
        """Start gathering group ``key`` (no-op if gathered and current, or already in flight)."""
        g = self.groups[key]
        if g.pending_unshard is not None:
            return
        if g.gathered and g.gathered_version == self.version:
            return
        self.wait_publish(key)  # this rank may be a source: its master must be the published one
        for b in self.unshard_layout.buckets_of(key):
            _alloc_storage(self.unshard_buffers[b.key])
        with torch.no_grad():
            self._fill_sources(key)
        g.pending_unshard = self.executor.launch(self.unshard_schedules[key], self.unshard_buffers)

    def unshard(self, key: str) -> None:
        """Make group ``key``'s params valid full tensors in the compute dtype (waits)."""
        g = self.groups[key]
        self.launch_unshard(key)
        if self._wait_unshard(g):
            g.gathered = True
            g.gathered_version = self.version
        self._point_params(key)

    @staticmethod
    def _wait_unshard(g: GroupRuntime) -> bool:
        """Wait for ``g``'s in-flight gather, if any; True if there was one."""
        if g.pending_unshard is None:
            return False
        g.pending_unshard.wait()
        g.pending_unshard = None
        return True

    def _point_params(self, key: str) -> None:
        for b in self.unshard_layout.buckets_of(key):
            buf = self.unshard_buffers[b.key]
            for e in b.entries:
                p = self.params[e.name]
                p.data = buf[e.offset:e.offset + e.numel].view(e.shape)

    def reshard(self, key: str) -> None:
        """Free group ``key``'s gathered copy (storage to 0 bytes; params to placeholders)."""
        g = self.groups[key]
        self._wait_unshard(g)  # never free under an in-flight collective
        for n in g.names:
            self.params[n].data = self._placeholders[n]
        for b in self.unshard_layout.buckets_of(key):
            _free_storage(self.unshard_buffers[b.key])
        g.gathered = False

    def reshard_all(self) -> None:
        if not self.ready:
            return
        for key in self.groups:
            self.reshard(key)

    # ------------------------------------------------------------------ gradients
    def on_grad(self, name: str, param: nn.Parameter) -> None:
        """Post-accumulate-grad: move the local grad aside; reduce the group once complete."""
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        prev = self.local_grads.get(name)
        self.local_grads[name] = grad if prev is None else prev.add_(grad)
        if not self.require_grad_sync:
            return
        key = self.group_of[name]
        g = self.groups[key]
        g.accumulated.add(name)
        if len(g.accumulated) == len(g.names) and not g.reduced_this_backward:
            self.reduce_group(key)
            self.reshard(key)

    def reduce_group(self, key: str) -> None:
        """Average the group's local grads (zeros where none) to the owners, asynchronously."""
        g = self.groups[key]
        g.reduced_this_backward = True
        buffers: dict[BucketKey, torch.Tensor] = {}
        s = self.coord[0]
        dt = to_torch_dtype(g.reduce_dtype)  # every bucket's dtype: ensure_ready's layout used it
        with torch.no_grad():
            for b in self.reduce_layout.buckets_of(key):
                buf = None
                if b.key.column == s and b.key not in self._grad_busy:
                    buf = self.grad_buffers.get(b.key)
                    if buf is None:
                        buf = torch.empty(b.numel, dtype=dt, device=self.device)
                        self.grad_buffers[b.key] = buf
                    _alloc_storage(buf)
                    self._grad_busy.add(b.key)
                if buf is None:  # another column's (send only), or a second synced backward
                    buf = torch.empty(b.numel, dtype=dt, device=self.device)
                for e in b.entries:
                    view = buf[e.offset:e.offset + e.numel]
                    lg = self.local_grads.pop(e.name, None)
                    if lg is None:
                        view.zero_()
                    else:
                        view.view(e.shape).copy_(lg)
                buffers[b.key] = buf
        handle = self.executor.launch(self.reduce_schedules[key], buffers)
        self._pending_reduces.append((handle, buffers))

    def wait_reduces(self) -> None:
        """Wait for every in-flight reduce; the owner keeps (accumulates) its reduced grads."""
        pending, self._pending_reduces = self._pending_reduces, []
        for handle, buffers in pending:
            handle.wait()
            for key, buf in buffers.items():
                for e in self._owned_entries.get(key, ()):
                    view = buf[e.offset:e.offset + e.numel].view(e.shape)
                    prev = self.reduced_grads.get(e.name)
                    self.reduced_grads[e.name] = view if prev is None else prev.add_(view)

    def on_backward_start(self) -> None:
        """Called by the first pre-backward hook of a backward pass."""
        if self._callback_queued:
            return
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self.on_backward_end)

    def on_backward_end(self) -> None:
        """End-of-backward: reduce every group whose hooks did not complete (same order on all
        ranks, zeros for missing grads), free gathered copies, reset per-backward state."""
        self._callback_queued = False
        self.wait_publish()  # publishes of groups this forward did not use (see ``publish``)
        for key in self.order:
            g = self.groups[key]
            if self.require_grad_sync and not g.reduced_this_backward:
                self.reduce_group(key)
            # weights change only at step(): Z2 keeps its gathered copy across no_sync micro-batches
            keep = not self.require_grad_sync and not g.reshard_after_forward
            if (g.gathered or g.pending_unshard is not None) and not keep:
                self.reshard(key)
            g.accumulated.clear()
            g.reduced_this_backward = False

    def clear_grads(self) -> None:
        """Drop local and reduced grads (``Muon.zero_grad``, ``step``)."""
        self.wait_reduces()
        self.local_grads.clear()
        self.reduced_grads.clear()
        self._grad_busy.clear()
        if self.release_grad_buffers:
            for buf in self.grad_buffers.values():
                _free_storage(buf)

    # ------------------------------------------------------------------ after the step
    def masters_changed(self) -> None:
        """The masters were written (a step, a state-dict load): gathered copies are stale, so
        bump :attr:`version` and free them (the next forward gathers the new values)."""
        self.version += 1
        self.reshard_all()

    def after_step(self, *, replicate_async: bool = True) -> None:
        """Masters changed: invalidate gathered copies, then :meth:`publish` (HSDP)."""
        self.masters_changed()
        self.publish(replicate_async=replicate_async)

    # ------------------------------------------------------------------ HSDP publish
    def publish_schedules(self) -> dict[str, Schedule]:
        """``group -> publish schedule`` (built once; in the static group order, the same on every
        rank, so the replicate groups see their collectives in one order everywhere)."""
        if self._publish_scheds is None:
            self._publish_scheds = {
                key: publish_schedule(self.master_layout, key)
                for key in self.hook_groups.order if key in self.master_layout.groups}
        return self._publish_scheds

    def publish(self, *, replicate_async: bool = True) -> None:
        """HSDP: broadcast each new master from its global owner ``(s, r_o)`` to the other ranks of
        column ``s`` (the forward broadcast sources of the other replicas). No-op when R == 1.

        ``replicate_async=True``: one launch per hook group, left pending; the group's next
        gather (its forward pre-hook, or a prefetch) waits it first. Publishes of groups that no
        forward used are waited at the end of the next backward, so a training loop never leaves
        one behind; :meth:`wait_publish` (``dmuon.wait_all_replicate_broadcasts``) waits them all.
        ``replicate_async=False``: launch and wait here.

        Raises:
          RuntimeError: a publish of an earlier step is still pending (see
            :meth:`check_publish_consumed`).
        """
        if self.R == 1:
            return
        self.check_publish_consumed()
        scheds = {k: sc for k, sc in self.publish_schedules().items() if len(sc) > 0}
        for key, sched in scheds.items():
            self.pending_publish[key] = self.executor.launch(sched, self.master_buffers)
        if not replicate_async:
            self.wait_publish()

    def check_publish_consumed(self, what: str = "optimizer.step()") -> None:
        """Raise if a publish is still pending: the owners would overwrite masters that are still
        being broadcast, and the replicas would miss a step. Deterministic (the same decision on
        every rank): "pending" means not yet waited, never "not yet finished"."""
        if not self.pending_publish:
            return
        groups = [k or "<root>" for k in self.pending_publish]
        raise RuntimeError(
            f"dmuon: {what} would publish new HSDP weights while the previous step's publish is "
            f"still pending for hook groups {groups[:6]}{' ...' if len(groups) > 6 else ''} (no "
            "forward/backward ran since that step). Nothing was updated. Run a forward and "
            "backward before the next step, or call dmuon.wait_all_replicate_broadcasts(model) "
            "first (or build the optimizer with dmuon.Muon(..., replicate_async=False)).")

    def wait_publish(self, key: Optional[str] = None) -> None:
        """Wait for the pending HSDP publish of group ``key`` (``None``: of every group; this is
        ``dmuon.wait_all_replicate_broadcasts``). Idempotent, local (no new collective)."""
        if key is not None:
            pending = self.pending_publish.pop(key, None)
            if pending is not None:
                pending.wait()
            return
        pending, self.pending_publish = self.pending_publish, {}
        for handle in pending.values():
            handle.wait()


def local_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t.to_local()`` for a DTensor (this rank's shard, a view); else ``t`` itself (or None)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def find_runtime(model: Any) -> Optional[DedicatedRuntime]:
    """The runtime ``dedicate_params`` attached to ``model`` (``None`` if it has none)."""
    return getattr(model, RUNTIME_ATTR, None)


def get_runtime(model: nn.Module, what: str = "this call") -> DedicatedRuntime:
    """The runtime ``dedicate_params`` attached to ``model``; clear error when there is none."""
    rt = find_runtime(model)
    if rt is None:
        raise RuntimeError(
            f"{what} needs a model prepared by dmuon.dedicate_params(model, mesh, predicate) "
            "(call it before fully_shard), but this model has no dedicated parameters.")
    return rt
