"""Owner NS overlapped with the backward (``dmuon.Muon.set_ns_overlap``): :class:`NSOverlap`
launches a hook group's owner update as soon as its reduce is issued (CUDA: on a side stream
that waits for the reduce's events; CPU: once the reduce is waited, in the backward), out of
place; ``step()`` commits it or discards it. The decisions are
:mod:`dmuon.functional.ns_overlap`'s, the out-of-place trees :mod:`dmuon.functional.speculation`'s.

The side stream has CUDA's lowest priority, which is also the default stream's (where the
backward runs): the backward is not favoured by priority, only by being queued first; what the
overlap gains is the GPU's idle time in the backward (small batches, waits for reduces)."""
from __future__ import annotations

import contextlib
import logging
import weakref
from statistics import median
from typing import Any, NamedTuple, Optional

import torch

from dmuon.functional import ns_overlap as O
from dmuon.functional import phases as P
from dmuon.functional.speculation import commit_, speculative_fields, speculative_inputs
from dmuon.functional.step_checks import write_count
from dmuon.kernels.streams import side_stream

logger = logging.getLogger(__name__)

__all__ = ["NSOverlap"]

_AUTO_WARMUP, _AUTO_EACH = 4, 5  # "auto": iterations skipped, then timed each way (alternating)


class _Spec(NamedTuple):
    names: list
    stamp: O.Stamp
    fields: dict
    params: dict
    reduces: list  # [reduces of the group launched since]


class NSOverlap:
    """The overlap of one ``dmuon.Muon`` (see the module docstring); ``stats``: counters."""

    def __init__(self, optimizer: Any):
        self.ref = weakref.ref(optimizer)
        self.mode, self.reason = "off", "off (set_ns_overlap)"
        self.specs: dict[str, _Spec] = {}
        self.events: list = []
        self.bufs: dict[tuple, torch.Tensor] = {}
        self.stats = dict(launched=0, committed=0, discarded=0, early_matrices=0, side_stream=0)
        self._ends: list = []  # "auto": (mode of the iteration, its step-end event)

    def set_mode(self, mode: str) -> None:
        opt = self.ref()
        st = opt._owner.storage
        blocker = O.overlap_blocker(
            tensor_parallel=opt._tp is not None, split_ns=opt._split is not None,
            stored_momentum=None if st is None else ("offload" if st.offload else str(st.dtype)))
        self.discard()
        self.mode, self.reason = O.resolve_mode(mode, blocker, opt.dedicated_state.device.type)
        self._ends = []
        if mode != "off":
            logger.info("dmuon: ns_overlap=%r: %s", mode, self.reason)

    def _active(self) -> bool:
        return self.mode == "on" or (self.mode == "auto" and len(self._ends) % 2 == 1)

    def _stamp(self, opt: Any, names: list, grads: dict, reduces: int = 0) -> O.Stamp:
        owner, masters = opt._owner, opt.dedicated_state.owned_masters()
        live = [{n: owner.field_values(f.key)[n] for n in names} for f in owner.fields]
        hp = O.stamp_key((*opt.muon_hparams(), opt.elementwise, id(opt._ns)))
        return O.Stamp(hp, opt.num_steps, reduces, tuple(
            (n, None if grads.get(n) is None else (grads[n].data_ptr(), grads[n]._version))
            for n in names), write_count(live, {n: masters[n] for n in names}))

    def _buffer(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        b = self.bufs.get(key)
        if b is None or b.shape != like.shape or b.dtype != like.dtype:
            b = self.bufs[key] = torch.empty_like(like)
        return b.copy_(like)

    # ------------------------------------------------------------------ in the backward
    def reduce_issued(self, names: Any) -> None:
        """A hook group's reduce was issued (the runtime's listener): launch its speculation."""
        opt = self.ref()
        if opt is None or not self._active():
            return
        rt = opt.dedicated_state
        key = rt.group_of[names[0]]
        if key in self.specs:  # another backward reduces into its gradients: invalid at step()
            self.specs[key].reduces[0] += 1
            return
        cuda = rt.device.type == "cuda"
        stream = side_stream(rt.device, "ns_overlap") if cuda else None
        try:
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                spec = self._launch(opt, rt, key)
                if cuda:
                    self.events.append(stream.record_event())
                    self.stats["side_stream"] += spec is not None
        except Exception as e:  # noqa: BLE001 - step() computes it as without the overlap
            logger.warning("dmuon: ns_overlap: the early update of hook group %r failed (%s); "
                           "step() computes it", key, e)
            return
        if spec is not None:
            self.specs[key] = spec
            self.stats["launched"] += 1

    def _launch(self, opt: Any, rt: Any, key: str) -> Optional[_Spec]:
        rec = rt.groups[key].inflight_reduces[-1]
        rec.pending.wait()  # CUDA: the side stream waits for the reduce; CPU: it has landed
        rgs = P.reduced(rt.program, key, rt.coord, rec.buffers, rec.owned_here)
        names = O.early_names({r.name: r.present_here for r in rgs},
                              {r.name: rt.grad_scale(r.name) for r in rgs})
        if not names:
            return None
        grads = {r.name: r.grad for r in rgs if r.name in names}
        stamp = self._stamp(opt, names, grads)
        return _Spec(names, stamp, *self._compute(opt, names, grads), [0])

    def _compute(self, opt: Any, names: list, grads: dict) -> tuple[dict, dict]:
        """One hook group's owner update of ``names``, out of place: ``(fields, params)``."""
        owner = opt._owner
        state, params = speculative_inputs(owner.state, owner.fields,
                                           opt.dedicated_state.owned_masters(), names, self._buffer)
        params, state = owner.run(grads, state, params, opt.muon_hparams(), donate_grads=False,
                                  orthogonalizer=opt._orthogonalizer,
                                  elementwise=opt._elementwise())
        return speculative_fields(state, owner.fields), params

    # ------------------------------------------------------------------ in step()
    def commit(self, grads: dict) -> tuple[dict, list]:
        """In ``step()``, after the reduces were waited: commit every valid speculation (the
        current stream waits for them first) and, while on, compute every other hook group's
        update the same way now (the same NS batches, early or not: a batched NS rounds with its
        batch); returns ``(grads left for the chain's own step, names updated here)``."""
        opt = self.ref()
        valid = []
        for key, spec in self.specs.items():
            why = O.invalid_reason(spec.stamp, self._stamp(opt, spec.names, grads, spec.reduces[0]))
            if why is None:
                valid.append(spec)
            else:
                logger.debug("dmuon: ns_overlap: hook group %r recomputed: %s", key, why)
        self._wait()
        owner, rt = opt._owner, opt.dedicated_state
        done = [n for spec in valid for n in spec.names]
        self.stats["committed"] += len(valid)
        self.stats["early_matrices"] += len(done)
        self.stats["discarded"] += len(self.specs) - len(valid)
        self.specs.clear()
        results = [(spec.fields, spec.params) for spec in valid]
        if self._active():
            rest: dict[str, list] = {}
            for n, g in grads.items():
                if g is not None and n not in done:
                    rest.setdefault(rt.group_of[n], []).append(n)
            for names in rest.values():
                results.append(self._compute(opt, names, {n: grads[n] for n in names}))
                done += names
        for fields, params in results:
            commit_(owner.state, owner.fields, rt.owned_masters(), fields, params)
        return {n: None if n in done else g for n, g in grads.items()}, done

    def discard(self) -> None:
        """Drop every speculation (``zero_grad``, a cleared gradient, a new mode)."""
        self.stats["discarded"] += len(self.specs)
        self.specs.clear()
        self._wait()

    def _wait(self) -> None:
        if self.events:
            cur = torch.cuda.current_stream(self.ref().dedicated_state.device)
            for ev in self.events:
                cur.wait_event(ev)
        self.events.clear()

    # ------------------------------------------------------------------ "auto"
    def step_done(self) -> None:
        """End of ``step()``: ``"auto"`` times alternating iterations (CUDA events, not read
        until the decision), then agrees once on every rank whether to keep the overlap."""
        if self.mode != "auto":
            return
        opt = self.ref()
        rt = opt.dedicated_state
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(rt.device))
        self._ends.append(ev)
        its = range(_AUTO_WARMUP + 1, _AUTO_WARMUP + 2 * _AUTO_EACH + 1)  # iteration k: odd = on
        if len(self._ends) <= its[-1]:
            return
        ev.synchronize()  # one host sync, once: the decision
        ms = {k: self._ends[k - 1].elapsed_time(self._ends[k]) for k in its}
        on, off = [ms[k] for k in its if k % 2], [ms[k] for k in its if not k % 2]
        from dmuon.stateful.optimizer.step_checks import host_all_reduce
        votes = rt.mesh_groups.control_collective("ns_overlap auto", lambda g: host_all_reduce(
            [int(O.auto_choice(off, on)), 1], g, rt.device))
        self.mode = "on" if 2 * votes[0] > votes[1] else "off"
        self.reason = (f"auto: {self.mode} (this rank's median iteration {median(off):.2f} ms "
                       f"without, {median(on):.2f} ms with; {votes[0]} of {votes[1]} ranks "
                       "faster with it)")
        self._ends = []
        logger.info("dmuon: ns_overlap %s", self.reason)
