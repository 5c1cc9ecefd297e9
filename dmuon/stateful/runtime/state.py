"""The root state of a dedicated model (:class:`DedicatedState`): its storage, hook groups, ledger,
forward order, weights version, and the backward, step and HSDP-publish protocols. Every rank issues
the same collectives in the same order (reduces in one fixed order, whatever arrives when).

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.state".
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from dmuon.functional.backward_log import BackwardLog
from dmuon.functional.buckets import ROOT_GROUP, HookGroups
from dmuon.functional.copy_log import MODEL, CopyLog
from dmuon.functional.forward_log import ForwardLog
from dmuon.functional.matrix_settings import MatrixSettings
from dmuon.functional.program import StepProgram, step_program
from dmuon.functional.renames import renamed, renamed_message
from dmuon.functional.step_checks import LaunchLog, check_publish_consumed
from dmuon.functional.split_plan import runtime_owners
from dmuon.functional.tp_plan import grid_tp_schedule
from dmuon.functional.policy import resolve_model_dtypes
from dmuon.compat.wrappers import unwrap_model
from dmuon.compat.fsdp_info import (find_fsdp_state, fsdp_holders, keep_fsdp_gathered,
                                    mean_to_fsdp_scales, release_fsdp_kept)
from dmuon.compat.fsdp_patch import check_not_taken_over
from dmuon.compat.torch_api import fsdp_mp_policy, queue_backward_callback
from dmuon.stateful.runtime.agree import gather, join as join_ranks
from dmuon.stateful.runtime.executor import Executor
from dmuon.stateful.runtime.guards import check_not_written, keep_dmuon_hook_last
from dmuon.stateful.runtime.ledger import GradLedger
from dmuon.stateful.runtime.param_group import DedicatedParamGroup
from dmuon.stateful.runtime.process_groups import MeshGroups
from dmuon.stateful.runtime.storage import DedicatedStorage, GradBufferPool

logger = logging.getLogger(__name__)

#: the model attribute ``dedicate_params`` stores the state in (read it with :func:`get_state`)
STATE_ATTR = "_dmuon_state"

__all__ = ["ROOT_GROUP", "STATE_ATTR", "DedicatedState", "find_state", "get_state", "local_tensor"]


class DedicatedState:
    """Root state of the dedicated params of one model; its mode (Z2 / Z3, ``data_parallel``, the
    collective style, TP) is fixed here by ``dedicate_params``."""

    def __init__(self, *, model: nn.Module, params: Mapping[str, nn.Parameter], plan: Any,
                 mesh_groups: MeshGroups, executor: Executor, groups: HookGroups,
                 group_modules: Mapping[str, nn.Module], reshard_after_forward: bool,
                 mp_policy: Any,
                 meta_shapes: Optional[Mapping[str, tuple[int, ...]]] = None,
                 meta_device: Optional[torch.device] = None,
                 matrices: MatrixSettings = MatrixSettings(),
                 tp_layouts: Optional[Mapping[str, Any]] = None,
                 data_parallel: str = "fsdp", collectives: str = "per_owner",
                 shard_mesh: Any = None, dp_dims: Optional[tuple] = None):
        self.model_ref = weakref.ref(model)
        self.names: tuple[str, ...] = tuple(params)
        self.plan = plan
        self.mesh_groups, self.executor, self.hook_groups = mesh_groups, executor, groups
        self.G, self.R, self.rank = mesh_groups.shard_size, mesh_groups.replicate_size, mesh_groups.rank
        self.coord: tuple[int, int] = tuple(mesh_groups.coord)
        self.owners = {n: tuple(o[n]) for o in [runtime_owners(plan)] for n in self.names}
        self.owner_rank = {n: mesh_groups.global_rank(*self.owners[n]) for n in self.names}
        #: the policy's decisions (dedicate_params): views, dtypes, hp_mults (read them there)
        self.matrices = matrices
        # TP: {name: TPLayout} of the TP-sliced matrices (tensor_parallel)
        self.tp_layouts: dict[str, Any] = dict(tp_layouts or {})
        #: the handles of every hook dedicate_params registered (:func:`dmuon.release` removes them)
        self.hook_handles: list[Any] = []
        self.mp_policy = mp_policy
        # resolved at the first forward (FSDP2's policy, the rules' dtypes in matrices)
        self.compute_dtype: dict[str, torch.dtype] = {}  # {name: gathered-copy dtype}
        self.reduce_dtype: dict[str, torch.dtype] = {}   # {name: reduce dtype}
        #: "fsdp" or "ddp" (DDP mode: nothing is resharded, :mod:`dmuon.stateful.modes.ddp`)
        self.data_parallel, self.collectives = data_parallel, collectives
        self.reshard_after_forward = reshard_after_forward and data_parallel != "ddp"
        self.storage = DedicatedStorage(params, self.owners, groups, self.G, self.R,
                                        self.coord, shapes=meta_shapes, device=meta_device,
                                        master_dtypes=matrices.master_dtypes)
        # the storage's facts, read-only (masters: this rank's column's; HSDP: the owner's column)
        st = self.storage
        self.params: dict[str, nn.Parameter] = st.params  # {name: param}, in the given order
        self.owned_names = tuple(st.owned_masters)  # this rank's Muon matrices, in that order
        self.device, self.masters, self.shape = st.device, st.masters, st.shape
        self.orig_dtype, self.master_dtype = st.orig_dtype, st.master_dtype
        self.pool = GradBufferPool(self.coord[0], self.device)
        #: the hook groups' launches since the last step (compared across ranks before it)
        self.launches = LaunchLog()
        self.groups: dict[str, DedicatedParamGroup] = {
            key: DedicatedParamGroup(
                key=key, module=group_modules[key], names=groups.names(key), storage=self.storage,
                executor=executor, launches=self.launches)
            for key in groups.order}
        self.group_of = groups.as_mapping()
        #: the forward order (agreed once across ranks), reused groups, per-forward counts
        self.forwards = ForwardLog(groups.order)
        #: this backward's gradient arrivals per group and the fixed reduce order's cursor
        self.backward = BackwardLog({k: g.names for k, g in self.groups.items()})
        self.version = 0               # weights change at every step: older gathers are stale
        self.require_grad_sync = True  # False inside dmuon.no_sync
        self._callback_queued = False
        self._deferred_grads: dict[str, nn.Parameter] = {}  # on_grad: taken at the backward's end
        self._keep_gathered = False  # this backward has create_graph=True (on_backward_start)
        self._fsdp_kept: list[Any] = []  # FSDP2's groups kept gathered for a create_graph graph
        self.listener: Any = None  # set_listener
        self.fsdp_usage: Any = None  # dmuon.Muon's FSDPGradUsage: its window ends with the grads
        self.ready = False
        #: the step program (:mod:`dmuon.functional.program`), built at the first forward
        self.program: Optional[StepProgram] = None
        self._optimizer_generation = 0
        #: where every matrix's gradient is on this rank, and its ``.grad`` markers
        self.ledger = GradLedger(self.params, self.owned_names, self.storage.is_placeholder,
                                 self._collect)
        # the 1-D shard mesh (DTensor rows of model.state_dict(), see torch_state_dict.py; None in
        # DDP mode: plain full tensors); raw_state_dict: model.state_dict() keeps placeholders
        self.shard_mesh: Any = shard_mesh
        self.dp_dims = dp_dims  # dedicate_params' dp_mesh_dims (shard, replicate names) or None
        self.raw_state_dict = False
        self.state_dict_copies = CopyLog()  # what state dicts handed out (written, not loaded?)
        self._transfer: Any = None
        self._fsdp_states: dict[str, Any] = {}  # {name: innermost FSDP2 state} (lazy init)
        #: the open init window of a meta-built model (:mod:`dmuon.stateful.modes.meta_init`,
        #: opened by dedicate_params), or None
        self.meta_init: Any = None

    def finish_meta_init(self, what: str) -> None:
        """Close the init window of a meta-built model (collective; no-op when none is open;
        see :meth:`dmuon.stateful.modes.meta_init.MetaInit.finish`)."""
        if self.meta_init is not None:
            self.meta_init.finish(self, what)

    def join(self, what: str, *, always: bool = False, drain: bool = False) -> None:
        """Before a state-dict / checkpoint call with collectives: every rank must make it
        (:func:`dmuon.stateful.runtime.agree.join`); then a meta-built model's init window closes
        (:meth:`finish_meta_init`). ``always=False``: only when the call moves dedicated matrices
        (``G > 1``, TP, meta init; DDP mode's saves are local). ``drain``: then :meth:`drain`."""
        if always or self.G > 1 or self.tp_layouts or self.meta_init is not None:
            join_ranks(what)
        self.finish_meta_init(what)
        if drain:
            self.drain()

    def owned_masters(self) -> dict[str, torch.Tensor]:
        """``{name: master}`` of the matrices this rank runs Muon on (fixed at setup)."""
        return self.storage.owned_masters

    # ------------------------------------------------------------------ lazy init
    def lazy_init(self) -> None:
        """Resolve dtypes (FSDP2's policy), build the step program, layouts and buffers; the first
        forward, once."""
        if not self.ready:
            self._init_at_first_forward()

    @torch.inference_mode(False)  # what it builds outlives a first forward under inference_mode
    def _init_at_first_forward(self) -> None:
        self.finish_meta_init("dmuon (first forward)")
        if (model := self.model_ref()) is not None:
            check_not_taken_over(model, self.params, "dmuon (first forward)")
            if _renamed_params(self, model):
                raise _renamed_error(self, model, "dmuon (first forward)")
        holders = fsdp_holders(model, self.names, lambda n: self.groups[self.group_of[n]].module)
        pols = {id(h): self.mp_policy if self.mp_policy is not None else fsdp_mp_policy(h)
                for h in holders.values()}  # each matrix follows the fully_shard module holding it
        defaults, gathered, reduce = resolve_model_dtypes(
            {k: g.names for k, g in self.groups.items()}, {n: id(h) for n, h in holders.items()},
            {k: id(find_fsdp_state(model, g.module)) for k, g in self.groups.items()},
            {h: (getattr(p, "param_dtype", None), getattr(p, "reduce_dtype", None))
             for h, p in pols.items()}, self.orig_dtype,
            rule_param_dtype=self.matrices.param_dtypes,
            rule_reduce_dtype=self.matrices.reduce_dtypes)
        for k, g in self.groups.items():
            g.compute_dtype, g.reduce_dtype = defaults.get(k, (None, None))
        self.compute_dtype.update(gathered)
        self.reduce_dtype.update(reduce)
        self._fsdp_states.update(holders)
        cdt, rdt, lay = self.compute_dtype, self.reduce_dtype, self.tp_layouts
        tp = None if not lay else grid_tp_schedule(  # TP's NS gathers / scatters
            self.mesh_groups.tp_grids, self.owners,
            {n: lay[n].shape for n in self.names if n in lay},
            {n: str(self.master_dtype[n]) for n in lay}, dist.get_world_size())
        self.program = step_program(
            self.owners, self.shape, cdt, reduce_dtypes=rdt, master_dtypes=self.master_dtype,
            shard_size=self.G, replicate_size=self.R, groups=self.hook_groups,
            reshard_after_forward=self.reshard_after_forward, tp=tp,
            collectives=self.collectives, data_parallel=self.data_parallel)
        for g in self.groups.values():
            g.setup(self.program)
        self.backward.set_order(self.program.reduce_order)
        self.storage.set_placeholder_dtypes(cdt)
        self.ready = True

    # ------------------------------------------------------------------ the listener
    def set_listener(self, listener: Any) -> None:
        """Set the model's one listener: ``listener.reduce_issued(names)`` at each gradient reduce
        issued, ``listener.group_forward()`` once per forward at its first hook group,
        ``listener.grads_cleared()`` before the held gradients are dropped. A replaced
        listener gets one ``group_forward()`` first (design notes: "The listener")."""
        old, self.listener = self.listener, listener
        if old is not None:
            old.group_forward()

    def notify_group_forward(self) -> None:
        """A hook group's forward starts (the hooks call it): the first of a forward tells the
        listener."""
        if self.forwards.first_group() and self.listener is not None:
            self.listener.group_forward()

    # ------------------------------------------------------------------ forward order
    def begin_forward(self) -> None:
        """A forward of the model starts (its forward pre-hook; not a checkpoint recomputation):
        not while any model state-dict copy was written but not loaded (a group's own, below)."""
        self.state_dict_copies.check([MODEL], "dmuon (forward)")
        self._close_raised_backward()
        self.forwards.new_forward()

    def _close_raised_backward(self) -> None:
        """A forward outside any backward while a backward's end is still queued: that backward
        raised before its end (torch drops the callback it queued); close it here."""
        if self._callback_queued:
            self.on_backward_end(raised=True)

    def note_forward(self, key: str) -> None:
        """A hook group's forward (not a recomputation; its state-dict copies checked first)."""
        self.state_dict_copies.check([MODEL], "dmuon (forward)", self.groups[key].names)
        self._close_raised_backward()
        self.forwards.note(key)

    def finalize_order(self) -> None:
        """Agree the forward order across ranks (one all-gather, once): at the end of the first
        forward of the model, or at the first step where no forward of the model ran (only its
        blocks'); on a mismatch every rank falls back to the static group order."""
        if self.forwards.final:
            return
        orders = gather(self.forwards.proposal(), what="forward-order agreement (first forward)",
                        via=self.mesh_groups)
        if not self.forwards.agree(orders):
            logger.warning("dmuon: the first forward ran the hook groups in different orders on "
                           "different ranks; prefetching in the static module order instead")

    # ------------------------------------------------------------------ gather / free
    def unshard(self, key: str, regather: bool = False, *, wait: bool = True) -> None:
        """Gather group ``key`` (``regather``: again, in a backward); ``wait``: and wait."""
        g = self.groups[key]
        self.ledger.take_markers(g.names, gather=True)
        (g.unshard if wait else g.launch_unshard)(self.version, regather)

    def reshard_all(self) -> None:
        if self.ready:
            for g in self.groups.values():
                g.reshard()
                g.forward_gathered = g.regathered = False  # a forward before cannot be backwarded
        self._fsdp_kept = release_fsdp_kept(self._fsdp_kept)  # a create_graph backward's

    # ------------------------------------------------------------------ backward protocol
    def on_backward_start(self) -> None:
        """The first dmuon hook of a backward: queue :meth:`on_backward_end` once (``create_graph``:
        keep the gathered copies, FSDP2's too, until a backward without it ends, or the step)."""
        if not self._callback_queued:
            self.state_dict_copies.settle()  # a state dict's copies are not held through it
            self._callback_queued = True
            queue_backward_callback(self.on_backward_end)
        if torch.is_grad_enabled() and not self._keep_gathered:
            self._keep_gathered = True
            self._fsdp_kept += keep_fsdp_gathered(self.model_ref())

    def on_grad(self, name: str, param: nn.Parameter) -> None:
        """Post-accumulate-grad of a dedicated param: move the local grad aside and launch the
        reduces that are due; user hooks registered later still see ``.grad`` (taken at the end).

        Raises:
          DedicatedParamError: a user hook wrote the gathered copy (:func:`check_not_written`).
        """
        if param.grad is None:
            return
        if len(param._post_accumulate_grad_hooks or ()) > 1:
            check_not_written(name, param, self.owner_rank[name])
            if keep_dmuon_hook_last(param):  # later hooks run after this one, now
                self.on_backward_start()
                self._deferred_grads[name] = param
                return
        self._take_grad(name, param)

    def _take_grad(self, name: str, param: nn.Parameter) -> None:
        if (grad := param.grad) is None:
            return
        self.on_backward_start()  # forward outputs dmuon found no tensor in still end here
        param.grad = None
        self.ledger.add_local(name, grad)
        if not self.require_grad_sync:
            return
        key = self.group_of[name]
        self.backward.arrive(key, name, defer=key in self.forwards.reused)
        self._launch_due_reduces()

    def _launch_due_reduces(self, every: bool = False) -> None:
        """Launch, in the fixed reduce order, each complete group whose predecessors are launched
        (``every``: complete or not, at the end of a backward)."""
        while (key := self.backward.next_due(every)) is not None:
            g = self.groups[key]
            self.ledger.take_markers(g.names)  # markers of an earlier no_sync backward: there?
            g.launch_reduce(self.ledger.send(g.names), self.pool)
            self.backward.launched(key)
            if self.listener is not None:  # the optimizer's policy (offload: the copies in start)
                self.listener.reduce_issued(g.names)
            if not self._keep_gathered:
                g.reshard()  # its gradients are out: no need for its gathered copy in this backward

    def on_backward_end(self, raised: bool = False) -> None:
        """End of a backward: launch every reduce not launched yet, in the fixed order (zeros and
        presence 0 for missing grads), free gathered copies, reset per-backward state.
        ``raised``: the backward raised before its end (torch drops its queued callback; the next
        forward closes it here): nothing is launched, the reduces it launched stay (the user's
        ``zero_grad`` drops them, or the next backward's add to them, as torch keeps what a failed
        backward accumulated), every gathered copy is freed."""
        deferred, self._deferred_grads = self._deferred_grads, {}
        for name, param in () if raised else deferred.items():  # left in .grad for later hooks
            check_not_written(name, param, self.owner_rank[name])
            self._take_grad(name, param)
        self._callback_queued = False
        if not raised:
            self.wait_publish()  # publishes of groups this forward did not use
            for g in map(self.groups.get, reversed(self.forwards.order)):  # every rank re-gathers a Z3
                if g.forward_gathered and not g.regathered and g.reshard_after_forward:  # group
                    g.launch_unshard(self.version, regather=True)  # once: where not reached, here
            if self.require_grad_sync:
                self._launch_due_reduces(every=True)
            self.ledger.fresh = self.require_grad_sync  # a no_sync backward last: no step on it
        self.backward.end()
        self.forwards.new_forward()
        create_graph, self._keep_gathered = self._keep_gathered, False
        if not create_graph:  # FSDP2's groups a create_graph backward kept (dmuon's own: below)
            self._fsdp_kept = release_fsdp_kept(self._fsdp_kept)
        for g in self.groups.values():
            # Z2 keeps its copy across no_sync micro-batches; create_graph: on_backward_start
            keep = not raised and (create_graph or (not self.require_grad_sync
                                                    and not g.reshard_after_forward))
            if g.holds_gathered and not keep:
                g.reshard()
            g.reset_backward()
            if not raised:
                self.ledger.show_markers(g.names, gathered=not create_graph)

    # ------------------------------------------------------------------ the publish
    @property
    def pending_publish(self) -> list[str]:
        """Hook groups whose post-step publish has not been waited yet."""
        return [k for k, g in self.groups.items() if g.inflight_publish is not None]

    def check_publish_consumed(self, what: str = "optimizer.step()") -> None:
        """Raise if a publish is still pending (not yet waited: the same decision on every rank)."""
        check_publish_consumed(self.pending_publish, what)

    def wait_publish(self) -> None:
        """Wait for the pending HSDP publish of every group (this is
        ``dmuon.wait_all_replicate_broadcasts``). Idempotent, local (no new collective)."""
        for g in self.groups.values():
            g.wait_publish()

    # ------------------------------------------------------------------ step protocol
    def _collect(self) -> None:
        """Wait for the in-flight reduces; add the owner's grads to the ledger (FSDP2's divide
        factor applied)."""
        for key in self.backward.order:
            rgs = self.groups[key].wait_reduces()
            for rg, scale in zip(rgs, self.grad_scales(rgs)):
                self.ledger.add_reduced(rg, scale)

    def grad_scales(self, rgs: list[Any]) -> list[Optional[float]]:
        """FSDP2's divide factor for each ``ReducedGrad``'s average (``None``: the mean itself)."""
        return mean_to_fsdp_scales([self._fsdp_states.get(r.name) for r in rgs], self.G * self.R)

    def reduced_grads(self) -> dict[str, Optional[torch.Tensor]]:
        """Wait for the pending reduces; ``{owned name: averaged gradient, or None}`` (``None``:
        no rank had a gradient for it since the last :meth:`clear_grads`, or no backward ran)."""
        self.ledger.take_markers(self.ledger.held_markers(), remove=False)
        self._collect()
        return self.ledger.resolve()

    def drain(self) -> None:
        """Wait for every collective dmuon has in flight (reduces and HSDP publishes), so that a
        caller can issue its own collectives (state dicts, checkpoints). Local."""
        self._collect()
        self.wait_publish()

    def clear_grads(self) -> None:
        """Drop local and reduced grads (``Muon.zero_grad``, ``step``); buffers back to the pool."""
        if self.listener is not None:  # the optimizer's early updates read them: dropped
            self.listener.grads_cleared()
        self.ledger.clear()
        self.pool.release_all()
        if self.fsdp_usage is not None:
            self.fsdp_usage.reset()

    def masters_changed(self, loaded: Optional[str] = None, keys: Any = None) -> None:
        """The masters were written (a step, a state-dict load of kind ``loaded``, of ``keys``): bump
        :attr:`version`, free the gathered copies (the next forward gathers the new values)."""
        self.state_dict_copies.loaded(loaded, keys)
        self.version += 1
        self.reshard_all()
        self.forwards.new_forward()

    def after_step(self, *, replicate_async: bool = True) -> None:
        """After the owners updated their masters: :meth:`masters_changed`, then (HSDP, R > 1)
        broadcast each new master from its owner to its column; ``replicate_async``: leave the
        launches pending (design notes: "The HSDP publish").

        Raises:
          RuntimeError: a publish of an earlier step is still pending (see
            :meth:`check_publish_consumed`).
        """
        self.masters_changed()  # (R == 1: the program's publish phases are empty)
        self.check_publish_consumed()
        for key in self.hook_groups.order:
            self.groups[key].launch_publish(self.storage.master_buffers)
        if not replicate_async:
            self.wait_publish()

    def attach_optimizer(self) -> int:
        """A new ``dmuon.Muon`` on this model: returns its generation (it supersedes older ones)."""
        self._optimizer_generation += 1
        return self._optimizer_generation

    def is_current(self, generation: int) -> bool:
        return generation == self._optimizer_generation


def local_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t.to_local()`` for a DTensor (this rank's shard, a view); else ``t`` itself (or None)."""
    return t.to_local() if hasattr(t, "to_local") else t


def find_state(model: Any) -> Optional[DedicatedState]:
    """The state ``dedicate_params`` attached to ``model`` (``None`` if it has none); through a
    ``DistributedDataParallel`` wrapper (DDP mode), the wrapped module's."""
    return getattr(unwrap_model(model), STATE_ATTR, None)


def get_state(model: nn.Module, what: str = "this call") -> DedicatedState:
    """The state ``dedicate_params`` attached to ``model``; clear error when there is none (also
    when ``model`` wraps a dedicated model, as PEFT's ``get_peft_model`` applied afterwards, and
    when it is no module: ``model.parameters()`` given as torch's clipping takes them)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} takes the model itself (the nn.Module dedicate_params prepared: "
                        f"dmuon finds its params and their owners), not a {type(model).__name__} "
                        "(e.g. dmuon.clip_grad_norm_(model, 1.0), not model.parameters())")
    if (st := find_state(model)) is None:
        for path, m in model.named_modules():
            if (inner := getattr(m, STATE_ATTR, None) if path else None) is not None:
                raise _renamed_error(inner, model, what, path)
        raise RuntimeError(
            f"{what} needs a model prepared by dmuon.dedicate_params(model, mesh, predicate) "
            "(call it before fully_shard), but this model has no dedicated parameters.")
    return st


def _renamed_params(st: DedicatedState, root: nn.Module) -> list[tuple[str, str]]:
    """``(name at dedicate_params, name in root now)`` of the dedicated params that ``root`` now
    names otherwise (beyond compile / checkpoint / DDP wrapper segments), or does not hold."""
    now: dict[int, list[str]] = {}
    for n, p in root.named_parameters(remove_duplicate=False):
        now.setdefault(id(p), []).append(n)
    return renamed({n: id(p) for n, p in st.params.items()}, now)


def _renamed_error(st: DedicatedState, root: nn.Module, what: str, inner: str = "") -> RuntimeError:
    """The error for a model wrapped or renamed after ``dedicate_params``."""
    return RuntimeError(renamed_message(_renamed_params(st, root), what, inner))
