"""``dmuon.Muon``: a ``torch.optim.Optimizer`` over a model prepared by ``dedicate_params``:
``param_groups[0]`` the dedicated matrices (Muon, run by the owner driver), ``param_groups[1]``
every other trainable param (AdamW on FSDP2's local shards). ``step()`` checks before it changes
anything, then owners' update, publish, AdamW. Design notes: docs/design/optimizer.md, "`dmuon.Muon`
and its step"."""
from __future__ import annotations

import dataclasses
import logging
import warnings
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from dmuon.functional import adamw as fadamw
from dmuon.functional import muon as fmuon
from dmuon.functional import muon_options as fopts
from dmuon.functional import state_dtype as sd
from dmuon.compat.fsdp_patch import check_not_taken_over
from dmuon.compat.fsdp_info import (drop_unreduced_fsdp_grads, fsdp_groups, replaced_params,
                                    reshard_unsharded, unmanaged_params)
from dmuon.functional.optimizer_format import load_with_hooks, state_dict_with_hooks
from dmuon.functional.split_exec import split_orthogonalizer
from dmuon.functional.state_views import StateViews, assign_refused
from dmuon.functional.stages.orthogonalize import OrthogonalizerFor
from dmuon.kernels.ns_engine import NSEngine
from dmuon.newton_schulz.timing import NSTimer
from dmuon.stateful.optimizer.split_step import SplitStep
from dmuon.stateful.modes.ddp import check_backend
from dmuon.stateful.modes.deferred import finish_pending
from dmuon.stateful.runtime.state import DedicatedState, get_state, local_tensor
from dmuon.compat.wrappers import unwrap_model
from dmuon.stateful.optimizer.state_storage import (AdamWStorage, MomentumStorage,
                                                     StorageListener)
from dmuon.stateful.optimizer.telemetry import StepStats, StepTelemetry
from dmuon.functional.setup_check import require_fsdp_meshes
from dmuon.functional.step_checks import (broken_step_message, check_outside_grads,
                                          check_step_ready, step_broken, write_count)
from dmuon.stateful.optimizer.step_checks import agree_before_step, check_finite
from dmuon.stateful.runtime.agree import agree, host_sum
from dmuon.stateful.runtime.guard_base import plain_access
from dmuon.stateful.runtime.guards import make_marker
from dmuon.stateful.modes.tensor_parallel import TPStep

logger = logging.getLogger(__name__)


class Muon(torch.optim.Optimizer):
    """Distributed Muon for dedicated matrices + AdamW for everything else.

    Args:
      model: a model on which ``dmuon.dedicate_params`` ran (then ``fully_shard``).
      lr, momentum, nesterov, weight_decay, ns_steps, ns_coefficients, eps, ns_dtype, adjust_lr_fn:
        Muon's hyper-parameters, under ``torch.optim.Muon``'s names
        (:mod:`dmuon.functional.muon_options`: ``eps`` is ε of NS's normalization;
        ``adjust_lr_fn`` the shape scale: ``"match_rms_adamw"`` (default, ``0.2·sqrt(max(m,
        n))``), ``"original"`` / ``None`` (``sqrt(max(1, m/n))``), ``"spectral_unclamped"``,
        ``"none"`` (dmuon's: 1); ``ns_coefficients`` a named schedule, a table or torch's flat
        ``(a, b, c)``); ``param_groups[0]`` holds them under the functional core's names
        (``ns_eps``, ``lr_scale``: the checkpoint format; a group key spelled ``eps`` /
        ``adjust_lr_fn`` raises at the next step). ``lr`` may be given by position, as torch's
        optimizers take it; every other option by name.
      adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW hyper-parameters for every
        trainable param the predicate rejected.
      transform: the chain the owners run: ``None`` (default) is Muon itself
        (``dmuon.functional.variants.muon()``); a function ``MuonHParams -> Transform``
        (:mod:`dmuon.functional.variants`' ``normuon()``, ``muon_hyperball()``,
        ``normuon_hyperball()``, or your own chain of stages) built from ``param_groups[0]``
        each step (lr schedulers, ``lr_mult`` / ``wd_mult`` apply), or a fixed ``Transform`` (a
        change of ``param_groups[0]``'s raises at the next step). One driver for every chain
        (:mod:`dmuon.stateful.optimizer.owner`): same dedication, hooks, modes, clipping, state
        saved and restored by name. Its momentum stage's ``momentum_dtype`` (e.g.
        ``variants.muon(momentum_dtype=torch.bfloat16)``) is how the owners store the momentum
        (fp32 / bf16 / fp8: :mod:`dmuon.stateful.optimizer.state_storage`).
      offload_state: keep the owners' momentum in host memory between steps.
      adamw_state_dtype: the dtype of FSDP2's AdamW moments (fp32 / bf16).
      check_finite: before updating anything, check every gradient (one small all-reduce per
        step); NaN/Inf raises ``FloatingPointError`` on every rank and leaves params, state and
        gradients untouched (``zero_grad()`` then skips the batch). Raising needs the flag on the
        host, so on CUDA the check costs one host synchronization per step: ``"auto"`` (default)
        means on for CPU params, off on CUDA, where it is opt-in (``True``;
        ``last_step_stats().host_syncs`` shows it).

    Execution knobs are setters (as FSDP2's ``set_*``): :meth:`set_replicate_async`,
    :meth:`set_ns_engine`, :meth:`set_elementwise`, :meth:`set_adamw_impl`,
    :meth:`set_persistent_grad_buffers`, :meth:`set_ns_overlap`. The former spellings (``ns_eps``, ``lr_scale``,
    ``momentum_dtype`` and those knobs as constructor options) work for one release with a
    ``DeprecationWarning``.

    Raises:
      RuntimeError: ``dedicate_params`` was not called on ``model``; ``step()`` of an optimizer
        superseded by a newer ``Muon(model)`` on the same model.
      ValueError, TypeError: an invalid option (checked here, before anything changes, so never at
        the first ``step()``); ``fully_shard`` used a mesh over other ranks (or another device
        type) than ``dedicate_params``.
    """

    def __init__(self, model: nn.Module, lr: float = 0.02, *positional: Any,
                 momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0,
                 ns_steps: int = 5, ns_coefficients: Any = "polar_express", eps: float = 1e-7,
                 adjust_lr_fn: Any = "match_rms_adamw", ns_dtype: Optional[torch.dtype] = None,
                 adamw_lr: float = 1e-3, adamw_betas: tuple[float, float] = (0.9, 0.999),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.01,
                 transform: Any = None, offload_state: bool = False,
                 adamw_state_dtype: Any = None, check_finite: Any = "auto", **deprecated: Any):
        if not isinstance(model, nn.Module):
            raise TypeError("dmuon.Muon(model, ...) takes the model (after dedicate_params and "
                            f"fully_shard), not {type(model).__name__}")
        # every option is checked before anything changes (a bad value raises here, not at step())
        muon_group, adamw_hp, knobs, old_mu_dtype, notes = fopts.check_options(
            positional, locals(), deprecated)
        for note in notes:
            warnings.warn(note, DeprecationWarning, stacklevel=2)
        transform, mu_dtype = fopts.momentum_dtype_of(transform, old_mu_dtype,
                                                fopts.hparams_of_group(muon_group))
        self._adamw_storage = AdamWStorage(adamw_state_dtype)  # checked before any change
        self._storage = MomentumStorage(mu_dtype, offload_state, None)
        self._scaled = sd.is_scaled(self._storage.dtype)  # 8-bit: state views are decoded copies
        self._adamw_decoded = not self._adamw_storage.identity  # AdamW steps decoded moments
        fopts.ns_of(knobs["ns_engine"], "cpu", NSEngine)  # a bad ns_engine raises here
        model = unwrap_model(model)
        finish_pending(model)  # dedicate_params before TP: the dedication completes here
        rt = get_state(model, "dmuon.Muon(model)")
        rt.finish_meta_init("dmuon.Muon(model)")  # meta-built model: close its init window
        check_not_taken_over(model, rt.params, "dmuon.Muon(model)")
        check_backend(model, rt, "dmuon.Muon(model)")
        from dmuon.compat.fsdp_info import (FSDPGradUsage, fsdp_dp_dims, fsdp_meshes,
                                            reduce_unused_fsdp_params)
        require_fsdp_meshes(rt.mesh_groups.grid, rt.device.type, fsdp_meshes(model),  # or raise
                            rt.dp_dims, fsdp_dp_dims(model))
        self._storage.bind(rt.device)
        self._fsdp_groups = fsdp_groups(model)  # resharded before AdamW writes their shards,
        reshard_unsharded(self._fsdp_groups)  # and now: a forward's unsharded params are no shards
        dedicated = set(rt.params.values())
        others = [(n, p) for n, p in model.named_parameters() if p not in dedicated]
        self._adamw_named = tuple((n, p) for n, p in others if p.requires_grad)
        if rt.data_parallel == "fsdp" and rt.G * rt.R > 1 and (
                lost := unmanaged_params(model, self._adamw_named)):
            raise RuntimeError(fopts.unmanaged_by_fsdp(lost))  # never trained, or per rank
        # frozen at construction: in no param group (a gradient there after unfreezing raises)
        self._outside = tuple((n, p) for n, p in others if not p.requires_grad)
        groups = [
            dict(params=[rt.params[n] for n in rt.names], name="muon", **muon_group,
                 momentum_dtype=str(self._storage.dtype), offload_state=offload_state),
            dict(params=[p for _, p in self._adamw_named], name="adamw", **adamw_hp,
                 adamw_state_dtype=str(self._adamw_storage.dtype)),
        ]
        super().__init__(groups, defaults={})
        self._groups_fixed = True  # add_param_group and assigning self.state raise from here on
        self._fixed_keys = [{k: g[k] for k in fopts.FIXED_KEYS if k in g} for g in groups]
        self._rt: DedicatedState = rt
        self.check_finite = rt.device.type != "cuda" if check_finite == "auto" else check_finite
        rt.ledger.track_finite = self.check_finite
        self._host_syncs = 0
        owned = rt.owned_names  # what every step's telemetry reports, fixed at setup:
        self.telemetry = StepTelemetry(
            rt.executor, device=str(rt.device), owned_matrices=len(owned),
            dedicated_matrices=len(rt.names), adamw_params=len(self._adamw_named),
            owned_elements=sum(rt.masters[n].numel() for n in owned))
        self.num_steps = 0  # completed step() calls (the same on every rank)
        # FSDP2 params used on some ranks only: FSDP2's zero-fill where this torch has it (None put
        # back where no rank used one), else a check that each has a gradient on all ranks or none
        rt.fsdp_usage = (reduce_unused_fsdp_params(model) or FSDPGradUsage(zeros_sent=False)
                         ) if self._adamw_named else None
        # a newer Muon(model) supersedes this one: stepping both would update twice per step
        self._generation = rt.attach_optimizer()
        from dmuon.stateful.optimizer.ns_overlap import NSOverlap
        self._overlap = NSOverlap(self)  # set_ns_overlap (off)
        # the runtime's listener only where a policy needs it (offloaded momentum: its copies;
        # set_ns_overlap: its early updates): decided here, not at each notification
        rt.set_listener(StorageListener(self) if self._storage.offload else None)
        # the states exist from the start (zeros): torch's get_optimizer_state_dict then never
        # runs its zero-gradient "materializing" step on this optimizer. One driver for Muon
        # (transform=None: variants.muon()) and every variant: its chain, state and fields
        from dmuon.stateful.optimizer.owner import OwnerDriver
        self._owner = OwnerDriver(transform, self.muon_hparams(), rt, self._storage)
        self.adamw_state: Optional[fadamw.AdamWState] = self._adamw_storage.stored_state(
            fadamw.init(self.adamw_local_tensors()[0])) if self._adamw_named else None
        self.adamw_skipped: dict[str, int] = {}  # torch's per-param counts (fadamw.update_per_param)
        #: the state a matrix held by its owner lists: a marker per field that refuses math
        #: (torch's tools read the keys), made once
        self._markers = {(n, f.key): make_marker(rt.params[n], n, None, what="momentum" if
                                                 f.key == "momentum_buffer" else f.key)
                         for n in rt.names if n not in owned for f in self._owner.fields}
        self._name_of = {p: n for n, p in (*rt.params.items(), *self._adamw_named)}
        self.invalidate_state_views()
        if not self._scaled:  # views alias the live state: build them now
            self.refresh_state_views()
        # tensor parallelism: the owners' gathers / scatters of the TP-sliced matrices' NS
        self._tp: Optional[TPStep] = TPStep(rt) if rt.tp_layouts else None
        if self._tp is not None:  # an 8-bit momentum: each slice's scale is its matrix's (one
            self._storage.share_scales(self._tp.names, self._tp.max_over_group)  # MAX over TP)
        custom = transform if self._owner.custom else None  # split NS: this rank's units
        self._split = SplitStep(rt, custom, self.muon_hparams()) if rt.plan.splits else None
        for knob, value in knobs.items():  # the execution knobs (ns_engine: the owners' NS,
            getattr(self, f"set_{knob}")(value)  # behind TP's gathers or split NS's units)

    # ------------------------------------------------------------------ read-only views
    @property
    def dedicated_state(self) -> DedicatedState:
        """The :class:`~dmuon.stateful.runtime.state.DedicatedState` of the model this optimizer steps
        (the one ``dedicate_params`` attached; see :func:`dmuon.stateful.runtime.state.get_state`)."""
        return self._rt

    @property
    def program(self) -> Any:
        """The step program as this optimizer runs it: the model's
        (:attr:`~dmuon.stateful.runtime.state.DedicatedState.program`, built at the first forward;
        ``None`` before it) with this optimizer's split NS schedules (its NS settings decide their
        ops). A derived value: the model's program is never rewritten."""
        prog = self._rt.program
        return prog if prog is None or self._split is None else dataclasses.replace(
            prog, splits=self._split.schedules)

    @property
    def adamw_named_params(self) -> tuple[tuple[str, nn.Parameter], ...]:
        """``(name, param)`` of every param AdamW updates (``param_groups[1]``: the trainable
        params the predicate rejected, FSDP2's DTensors), in ``model.named_parameters()`` order."""
        return self._adamw_named

    # ------------------------------------------------------------------ optimizer.state
    #: ``step()`` changed the functional states since ``self.state`` was last built.
    _state_views_stale = False

    @property
    def state(self) -> Any:
        """torch-style ``{param: {"momentum_buffer" (or a variant's fields), "step"} | {"step",
        "exp_avg", "exp_avg_sq"}}`` views of the functional states (read by ``state_dict()`` and
        torch's tools), rebuilt lazily: ``step()`` only marks them stale, so the hot path never
        rebuilds them."""
        if self._state_views_stale:
            self.refresh_state_views()
        self._storage.copies.staged.clear()  # offload: the caller may write the host buffers:
        return self._state_views  # the step copies them again

    @state.setter
    def state(self, value: Any) -> None:  # torch.optim.Optimizer.__init__ assigns it
        if getattr(self, "_groups_fixed", False):
            raise RuntimeError(assign_refused())
        self._state_views = StateViews()  # (torch's defaultdict: views of dmuon's states instead)

    def invalidate_state_views(self) -> None:
        """Mark ``self.state`` stale (rebuilt when next read). With an 8-bit momentum its entries
        are decoded copies, not views: they are dropped now, so that a read (a checkpoint, torch's
        tools) does not keep a copy of every owned momentum alive for the rest of training (a bf16
        copy: 1.8 GiB on the H200's 1.1B model, held from construction before this)."""
        self._state_views_stale = True
        if self._scaled:
            self._state_views.empty()

    @torch.inference_mode(False)  # (read under inference_mode: the step copies track versions)
    def refresh_state_views(self) -> None:
        """Rebuild ``self.state[param]`` (torch-style views) from the functional states: the owned
        matrices' state by key, a marker that refuses math for a matrix held by its owner,
        AdamW's moments."""
        self._state_views_stale = False
        rt = self._rt
        self._storage.copies.synchronize()  # offload: the host buffers hold the last step's values
        views: dict = {}
        owner = self._owner
        step_m = torch.tensor(float(owner.step_count if rt.owned_names else self.num_steps))
        own = {f.key: owner.value_of(f.key, rt.owned_masters(), view=True)  # the stored momentum:
               for f in owner.fields}  # its stored tensors (fp8: decoded, inference tensors)
        for n in rt.names:  # held by its owner: the field's marker
            views[rt.params[n]] = dict({key: vals[n] if n in vals else self._markers[(n, key)]
                                        for key, vals in own.items()}, step=step_m)
        if self.adamw_state is not None:
            torch_form = fadamw.torch_entries(self.adamw_state, self.adamw_skipped)
            views.update({p: torch_form[n] for n, p in self._adamw_named})
        self._state_views.fill(views, self._name_of)

    # ------------------------------------------------------------------ hparams
    def muon_hparams(self) -> fmuon.MuonHParams:
        """The Muon hyper-parameters the next ``step()`` uses (read from ``param_groups[0]``)."""
        return fopts.hparams_of_group(self.param_groups[0])

    def adamw_hparams(self) -> fadamw.AdamWHParams:
        """The AdamW hyper-parameters the next ``step()`` uses (read from ``param_groups[1]``)."""
        return fadamw.hparams_of_group(self.param_groups[1])

    # ------------------------------------------------------------------ execution knobs
    def set_replicate_async(self, enabled: bool) -> None:
        """HSDP / DDP mode: ``True`` (default): the publish of the new masters to the replicas of
        each owner's shard column is dispatched at the end of ``step()`` and waited by the next
        forward's pre-hook of each hook group (groups forward did not use: at the end of the next
        backward); ``False``: it runs and is waited inside ``step()``. Bitwise the same weights.
        A ``step()`` while the previous step's publish is pending (no forward/backward since)
        raises; ``dmuon.wait_all_replicate_broadcasts`` drains it."""
        self.replicate_async = fopts.check_knob("replicate_async", enabled)

    def set_ns_engine(self, engine: Any) -> None:
        """Who runs the owners' Newton–Schulz: ``"auto"`` (default: on CUDA a
        :class:`dmuon.kernels.ns_engine.NSEngine`, batched per shape with CUDA-graph replay;
        elsewhere the functional core's batched NS, bitwise the functional Muon), ``"engine"``
        (that engine on any device), ``"functional"``, or an ``NSEngine`` (its execution
        settings; what it computes must be this optimizer's NS hyper-parameters, checked at
        every step). Decided here, once: the orthogonalizer every ``orthogonalize`` stage runs
        (:class:`~dmuon.functional.stages.orthogonalize.OrthogonalizerFor`; its identity names
        the NS settings)."""
        ns = fopts.ns_of(engine, self._rt.device.type, NSEngine)  # checks engine first
        split, tp = self._split, self._tp
        wrap = (partial(split_orthogonalizer, owned=split.owned, run_units=split.run)
                if split is not None else tp.orthogonalizer if tp is not None else None)
        self.telemetry.ns_timer = timer = NSTimer()
        self._orthogonalizer = OrthogonalizerFor(ns, timer=timer, wrap=wrap)

    def set_elementwise(self, mode: str) -> None:
        """Muon's elementwise stages (momentum + Nesterov input; weight decay + update):
        ``"auto"`` (default: fused Triton passes, :mod:`dmuon.kernels.muon_elementwise`, on
        CUDA when Triton imports, else foreach), ``"foreach"``, ``"fused"``. Decided here, once."""
        self.elementwise = fopts.check_knob("elementwise", mode)
        self._elementwise: Optional[fmuon.MuonElementwise] = None
        if mode == "fused" or (mode == "auto" and self._rt.device.type == "cuda"):
            from dmuon.kernels.muon_elementwise import fused_elementwise
            self._elementwise = fused_elementwise()

    def set_adamw_impl(self, impl: str) -> None:
        """The ``impl`` of :func:`dmuon.functional.adamw.update` for FSDP2's local shards:
        ``"auto"`` (default: ``"fused"`` on CUDA, ``"reference"`` (bitwise
        ``torch.optim.AdamW(foreach=False)``) elsewhere) or one of
        :data:`dmuon.functional.adamw.IMPLS`. Decided here, once."""
        self.adamw_impl = fopts.check_knob("adamw_impl", impl)
        dev = self._adamw_named[0][1].device if self._adamw_named else self._rt.device
        self._adamw_impl = fadamw.resolve_impl(impl, dev.type)

    def set_persistent_grad_buffers(self, enabled: bool) -> None:
        """Keep the owners' gradient buckets allocated between steps (stable addresses: the NS
        engine's graph replays every step) instead of giving their memory back after each step
        (default ``False``: forward runs without them)."""
        self._rt.pool.persistent = fopts.check_knob("persistent_grad_buffers", enabled)

    def set_ns_overlap(self, mode: str) -> None:
        """Overlap the owners' update with the backward: ``"off"`` (default), ``"on"``,
        ``"auto"`` (CUDA: keep it where alternating timed iterations were faster on most ranks;
        CPU: off). On, each hook group's update (momentum, NS, update of its owned matrices)
        starts when its reduce is issued (CUDA: on a side stream of the lowest priority, the
        default stream's too; from its second step with the same hyper-parameters, as one
        replay of a CUDA graph captured per group; with an lr schedule eagerly), out of place
        into buffers kept across steps (one more copy of the owned masters and their per-param
        state); ``step()`` commits it, bitwise what it would
        compute, unless a gradient, hyper-parameter, knob, the state or a master changed since
        (accumulation, clipping, ``zero_grad``, lr, load): then it recomputes; every group's
        update is computed per group (its own NS batches). Not applied (``ns_overlap_stats``
        says why) with TP, split NS, your own ``transform=`` chain (its stages may couple
        matrices), or a momentum stored in another dtype or offloaded."""
        self._overlap.set_mode(mode)  # not off: the listener (an offloaded momentum's is set)
        rt = self._rt
        if self._overlap.mode != "off" and rt.listener is None and rt.is_current(self._generation):
            rt.set_listener(StorageListener(self))

    @property
    def ns_overlap_stats(self) -> dict[str, Any]:
        """The overlap's mode, reason and counters (hook groups ``launched`` early, ``committed``,
        ``discarded``; ``early_matrices``; ``side_stream``: launches on the CUDA side stream;
        ``replayed``: of those, replays of the group's captured CUDA graph)."""
        return dict(mode=self._overlap.mode, reason=self._overlap.reason, **self._overlap.stats)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer step (see the module docstring). Returns ``closure()``'s value if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rt = self._rt
        check_step_ready(rt.is_current(self._generation), rt.ledger.fresh, self._owner.broken)
        check_outside_grads(self._outside)
        if not self.num_steps and (gone := replaced_params(  # fully_shard after the constructor
                rt.model_ref(), self._fsdp_groups, self._adamw_named)):
            raise RuntimeError(fopts.replaced_params(gone))
        rt.check_publish_consumed()  # HSDP: before anything changes (raises on every rank)
        grads = rt.reduced_grads()
        rt.finalize_order()  # (once; where the model's own forward never ran, only its blocks')
        agree_before_step(rt, self._adamw_named, self.param_groups, drop_batch=self.zero_grad,
                          fixed=self._fixed_keys, views=self._state_views)
        if self.check_finite and check_finite(self._adamw_named, rt, grads):
            self._host_syncs += 1  # its verdict waited for the device
        self.invalidate_state_views()  # the states change from here: views rebuilt when read
        writes = lambda: (write_count(self._owner.state, rt.owned_masters(), grads)  # noqa: E731
                          + self._storage.copies.copies_out)  # a write to state, masters or grads
        before = writes()
        try:
            stepped = self._muon_step(rt, grads, rt.ledger.take_zero_next())
            before = None  # changed (a later failure leaves a half-applied step)
            self._storage.copies.staged.clear()  # offload: copies of matrices not stepped
            rt.clear_grads()
            rt.after_step(replicate_async=self.replicate_async)
            rt.ledger.consume(stepped)  # torch keeps grads until zero_grad: markers stand in
            self._adamw_update()
            self.telemetry.finish_step(
                step=self.num_steps + 1, host_syncs=self._host_syncs, adamw_impl=self._adamw_impl,
                ns_mode=self.telemetry.ns_timer.mode if rt.owned_names else "none")
            self._host_syncs = 0
            self._storage.copies.end_step()  # offload: the copies' budget measures the step
            self.num_steps += 1
            self._overlap.step_done()  # "auto": timing, then its decision
        except BaseException as e:  # every rank learns of it (a retry must not apply it twice)
            changed = before is None or writes() != before
            if isinstance(e, Exception):
                try:
                    self._settle(e, changed)
                except RuntimeError as broken:  # the rank's own error is its cause
                    raise broken from e
            elif changed:  # an interrupt: no collective; broken, as its state changed
                self._break(f"rank {rt.rank}: {type(e).__name__}")
            raise
        self._settle(None, True)
        return loss

    def _settle(self, failure: Optional[Exception], changed: bool) -> None:
        """Collective, ending every step: a failure after any change raises on every rank."""
        rt, mine = self._rt, [] if failure is None else [f"{type(failure).__name__}: {failure}"]
        try:
            counts = host_sum([failure is not None, changed], what="step outcome all-reduce",
                              via=rt.mesh_groups, device=rt.device)
        except RuntimeError as e:  # not agreed (a rank missing): no rank may trust its state
            raise self._break(f"rank {rt.rank}: the step's outcome was not agreed: {e}") from e
        if step_broken(counts):
            agree(mine, what="failed step", via=rt.mesh_groups, error=self._break)

    def _break(self, detail: str) -> RuntimeError:
        self._owner.broken = broken_step_message(detail)  # later steps and saves raise it
        return RuntimeError(self._owner.broken)

    @property
    def elementwise_mode(self) -> str:
        """``"fused"`` (Triton kernels) or ``"foreach"``: how the owner's elementwise Muon stages run."""
        return "foreach" if self._elementwise is None else "fused"

    def _muon_step(self, rt: DedicatedState, grads: dict[str, Optional[torch.Tensor]],
                   zeroed: set[str]) -> list[str]:
        """The owners' update of this step (:class:`~dmuon.stateful.optimizer.owner.OwnerDriver`,
        one path for Muon and every variant; split NS: this rank's units run once per step);
        returns the names stepped (those with a gradient). ``zeroed``: matrices whose consumed
        marker the user zeroed since the last step (:mod:`dmuon.stateful.runtime.ledger`); with
        no gradient this step, they step with zeros."""
        hp = self.muon_hparams()
        if self._split is not None:
            self._split.begin(hp)
        params = rt.owned_masters()
        if self._tp is not None:  # TP: the TP group agrees on its gradients (every rank joins)
            grads = self._tp.agree_grads(grads, params)
        # a zeroed (not dropped) gradient kept by torch since the last step: step with zeros
        grads = {n: torch.zeros_like(params[n]) if g is None and n in zeroed else g
                 for n, g in grads.items()}
        grads, early = self._overlap.commit(grads)  # ns_overlap: valid early updates committed
        stepped = self._owner.step(grads, params, hp, orthogonalizer=self._orthogonalizer,
                                   elementwise=self._elementwise, committed=early,
                                   sum_hook=self._tp.sum_partials if self._tp else None)
        if self._split is not None:
            self._split.finish()
        return stepped

    def routing_table(self) -> Any:
        """Where every param went (Muon with its view and owner / AdamW / frozen) and what decided
        (:class:`dmuon.functional.routing.RoutingTable`; ``print()`` it)."""
        return getattr(self._rt, "routing", None)

    @property
    def muon_state(self) -> Optional[fmuon.MuonState]:
        """The owned matrices' Muon state as :class:`~dmuon.functional.muon.MuonState`
        ``(step, momentum as stored)``: views of the chain state (``None`` on a rank that owns
        no matrix, or for a chain without a momentum stage)."""
        o = self._owner
        if not self._rt.owned_names or o.stored_field is None:
            return None
        return fmuon.MuonState(o.step_count, o.stored_momentum())

    @property
    def variant_state(self) -> Any:
        """The chain state of ``transform=`` on this rank's owned matrices (``None`` without
        one: Muon's state is :attr:`muon_state`)."""
        return self._owner.state if self._owner.custom else None

    def adamw_local_tensors(self) -> tuple[dict[str, torch.Tensor],
                                           dict[str, Optional[torch.Tensor]]]:
        """``(params, grads)``: the trees :func:`dmuon.functional.adamw.update` steps, keyed as
        :attr:`adamw_named_params`: ``{name: local shard}`` (``DTensor.to_local()``, a view:
        writing it writes the param) and ``{name: local gradient shard, or None}``."""
        params = {n: local_tensor(p) for n, p in self._adamw_named}
        grads = {n: local_tensor(p.grad) for n, p in self._adamw_named}
        return params, grads

    def _adamw_update(self) -> None:
        """AdamW on FSDP2's local shards (none, or none with a gradient: nothing to do)."""
        params, grads = self.adamw_local_tensors()  # (the state exists from construction)
        store = self._adamw_storage  # adamw_state_dtype: stored rounded, updated decoded
        if all(g is None for g in grads.values()):
            return
        reshard_unsharded(self._fsdp_groups)  # an unsharded copy would go stale
        st = store.working_state(self.adamw_state, params) if self._adamw_decoded else \
            self.adamw_state
        _, work, self.adamw_skipped = fadamw.update_per_param(
            grads, st, params, self.adamw_hparams(), skipped=self.adamw_skipped, donate=True,
            impl=self._adamw_impl)
        self.adamw_state = store.commit_state(self.adamw_state, work) if self._adamw_decoded \
            else work

    def last_step_stats(self) -> Optional[StepStats]:
        """What the last ``step()`` did on this rank (None before the first): collectives and
        payload bytes per lane since the previous step, the owner's NS time (CUDA events; reading
        it waits for that step's NS), NS mode, owned matrices and elements, host syncs.
        See :mod:`dmuon.stateful.optimizer.telemetry`."""
        return self.telemetry.last()

    # ------------------------------------------------------------------ grads
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the dedicated matrices' pending grads (and their ``.grad`` markers) and zero
        FSDP2's grads (torch semantics)."""
        self._rt.clear_grads()
        drop_unreduced_fsdp_grads(self._fsdp_groups)  # FSDP2's, out of torch's reach (no_sync)
        self._storage.copies.staged.clear()  # a batch skipped after its backward: copies not needed
        # the consumed markers of the last step (dmuon.stateful.runtime.ledger) are zeroed or
        # dropped here like any .grad: set_to_none=False then steps a matrix with no new gradient
        # with zeros, as a single-device optimizer would (momentum and weight decay apply; the
        # markers' zero_ is a guard's: only set_to_none=True, a get and a set of .grad, goes around)
        (plain_access(super().zero_grad) if set_to_none else super().zero_grad)(set_to_none)

    # ------------------------------------------------------------------ state dict
    def param_name(self, p: Any) -> str:
        """The fully-qualified name of one of this optimizer's params."""
        return self._name_of[p]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once built: ``step()`` updates exactly ``param_groups[0]`` (the dedicated
        matrices) and ``param_groups[1]`` (the trainable FSDP2 params at construction); a group
        added later would never be stepped. Raises ``RuntimeError`` (the same on every rank)."""
        if not getattr(self, "_groups_fixed", False):  # torch's __init__ adds the two groups
            return super().add_param_group(param_group)
        raise RuntimeError(fopts.GROUPS_FIXED)

    def state_dict(self) -> dict[str, Any]:
        """Collective: torch's optimizer state-dict protocol, topology-free (param groups carry
        ``param_names``; dedicated momentum as ``Shard(0)`` DTensor rows, AdamW moments as
        FSDP2-like DTensors), see :mod:`dmuon.stateful.checkpoint.optimizer_state_dict`."""
        from dmuon.stateful.checkpoint.optimizer_state_dict import torch_optimizer_state_dict
        return state_dict_with_hooks(self, partial(torch_optimizer_state_dict, self))

    def load_state_dict(self, state_dict: dict) -> None:
        """Collective: load :meth:`state_dict`'s dict (or torch's ``get_optimizer_state_dict``'s,
        or dmuon's full format) saved at any topology; validated on every rank before anything
        changes (:func:`dmuon.stateful.checkpoint.optimizer_state_dict.load_optimizer_state`)."""
        from dmuon.stateful.checkpoint.optimizer_state_dict import torch_load_optimizer_state_dict
        load_with_hooks(self, state_dict, partial(torch_load_optimizer_state_dict, self))

