"""Owner NS overlapped with the backward (``dmuon.Muon.set_ns_overlap``): :class:`NSOverlap`
launches a hook group's owner update out of place when its reduce is issued (CUDA: on a side
stream waiting for the reduce's events; CPU: once it is waited) and commits or discards it in
``step()``. Decisions: :mod:`dmuon.functional.ns_overlap`; trees: :mod:`dmuon.functional.speculation`.
The side stream has CUDA's lowest priority, which is also the default stream's (the backward's):
the backward is favoured only by being queued first."""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

import optree

import torch

from dmuon.functional import ns_overlap as O
from dmuon.functional import phases as P
from dmuon.functional.variants import Variant
from dmuon.functional.speculation import commit_, live_tensors, result_tensors, speculate
from dmuon.kernels.graph_replay import RecurringGraphs
from dmuon.kernels.streams import side_stream
from dmuon.stateful.runtime.agree import host_sum

logger = logging.getLogger(__name__)


class NSOverlap:
    """The overlap of one ``dmuon.Muon``; ``stats``: its counters."""

    def __init__(self, optimizer: Any):
        self.ref, self.rt = weakref.ref(optimizer), optimizer.dedicated_state
        self.cuda = self.rt.device.type == "cuda"
        self.mode, self.reason = "off", "off (set_ns_overlap)"
        self.specs: dict[str, tuple] = {}  # {group: (names, stamp, fields, params, [reduces])}
        self.events: list = []  # CUDA: the side stream's, waited before commit / reuse
        self.bufs: dict[tuple, torch.Tensor] = {}  # the speculations' copies, kept across steps
        self.stats = dict(launched=0, committed=0, discarded=0, early_matrices=0, side_stream=0,
                          replayed=0)
        self._ends: list = []  # "auto": step-end events of the iterations since the mode was set
        self.twins: dict = {}  # {hook group: (the optimizer's orthogonalizer, its twin)}
        self.graphs = RecurringGraphs()  # CUDA: a graph per hook group, replayed while it recurs

    def set_mode(self, mode: str) -> None:
        opt = self.ref()
        st = opt._owner.storage
        self.discard()
        self.mode, self.reason = O.resolve_mode(mode, O.overlap_blocker(
            tensor_parallel=opt._tp is not None, split_ns=opt._split is not None,
            own_chain=not isinstance(opt._owner.transform, Variant),
            stored_momentum=None if st is None else ("offload" if st.offload else str(st.dtype))),
            self.rt.device.type)
        self._ends = []
        logger.info("dmuon: ns_overlap=%r: %s", mode, self.reason)

    def _active(self) -> bool:
        return self.mode == "on" or (self.mode == "auto" and len(self._ends) % 2 == 1)

    def _stamp(self, opt: Any, names: list, grads: dict, reduces: int = 0) -> O.Stamp:
        live = live_tensors(opt._owner.state, opt._owner.fields, self.rt.owned_masters(), names)
        return O.take_stamp((*opt.muon_hparams(), opt.elementwise, id(opt._orthogonalizer)),
                            opt.num_steps, reduces, names, grads, [live])

    def _buffer(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        b = self.bufs.get(key)
        if b is None or b.shape != like.shape or b.dtype != like.dtype:
            b = self.bufs[key] = torch.empty_like(like)
        return b.copy_(like)

    def _compute(self, opt: Any, names: list, grads: dict) -> tuple[dict, dict]:
        """One hook group's owner update of ``names``, out of place: ``(fields, params)``."""
        owner, hp, key = opt._owner, opt.muon_hparams(), self.rt.group_of[names[0]]
        # the optimizer's NS on engines of the group's own (same results; the optimizer's programs
        # stay in place), untimed (telemetry's ns_ms: NS in step() only; no events in a graph)
        kept = self.twins.get(key)
        if kept is None or kept[0] is not opt._orthogonalizer:  # (set_ns_engine: a new one)
            kept = self.twins[key] = (opt._orthogonalizer, opt._orthogonalizer.twin())
        orthogonalizer = kept[1]
        return speculate(lambda st, ps: owner.run(
            grads, st, ps, hp, donate_grads=False, orthogonalizer=orthogonalizer,
            elementwise=opt._elementwise), owner.state, owner.fields,
            self.rt.owned_masters(), names, self._buffer)

    def reduce_issued(self, names: Any) -> None:
        """A hook group's reduce was issued (the runtime's listener): launch its update (CUDA: on
        the side stream, after the reduce; a CUDA graph replayed where it may; CPU: now, the
        reduce waited)."""
        opt = self.ref()
        if opt is None or not self._active():
            return
        rt, cuda = self.rt, self.cuda
        key = rt.group_of[names[0]]
        if key in self.specs:  # another backward reduces into its gradients: invalid at step()
            self.specs[key][4][0] += 1
            return
        stream = side_stream(rt.device, "ns_overlap") if cuda else None
        if cuda:  # the reduce's packing (and, at world 1, its whole result) is this stream's
            stream.wait_stream(torch.cuda.current_stream(rt.device))
        try:
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                rec = rt.groups[key].inflight_reduces[-1]
                rec.pending.wait()  # CUDA: the side stream waits for the reduce; CPU: landed
                rgs = P.reduced(rt.program, key, rt.coord, rec.buffers, rec.owned_here)
                names = O.early_names({r.name: r.present_here for r in rgs},
                                      dict(zip([r.name for r in rgs], rt.grad_scales(rgs))))
                grads = {r.name: r.grad for r in rgs if r.name in names}
                if names:
                    stamp = self._stamp(opt, names, grads)
                    run = (self._replayed(opt, key, names, grads, stamp) if cuda
                           else self._compute(opt, names, grads))
                    self.specs[key] = (names, stamp, *run, [0])
                    self.stats["launched"] += 1
                    self.stats["side_stream"] += cuda
        except Exception as e:  # noqa: BLE001 - step() computes it as without the overlap
            self.specs.pop(key, None)
            logger.warning("dmuon: ns_overlap: the early update of hook group %r failed (%s); "
                           "step() computes it", key, e)
        finally:
            if cuda:
                self.events.append(stream.record_event())

    def _replayed(self, opt: Any, key: str, names: list, grads: dict, stamp: O.Stamp
                  ) -> tuple[dict, dict]:
        """:meth:`_compute` of group ``key`` as one replay of its CUDA graph while its
        :func:`~dmuon.functional.ns_overlap.replay_key` recurs (the host cost of one launch
        instead of the update's, which delay the backward's); the results: its own buffers."""
        leaves = [t for t in optree.tree_leaves(opt._owner.state) if isinstance(t, torch.Tensor)]
        live = live_tensors(opt._owner.state, opt._owner.fields, self.rt.owned_masters(), names)
        out, replayed = self.graphs(
            key, O.replay_key(stamp, [t.data_ptr() for t in live], leaves),
            lambda: self._compute(opt, names, grads), lambda out: result_tensors(*out),
            lambda: {t.data_ptr() for t in self.bufs.values()}, self.rt.device)
        self.stats["replayed"] += replayed
        return out

    def commit(self, grads: dict) -> tuple[dict, list]:
        """In ``step()``, the reduces waited: commit the valid speculations and, while on,
        compute every other group's update per group now (the same NS batches as early: a
        batched NS rounds with its batch); returns ``(grads left, names updated here)``."""
        opt, rt = self.ref(), self.rt
        valid = [s for s in self.specs.values()
                 if O.invalid_reason(s[1], self._stamp(opt, s[0], grads, s[4][0])) is None]
        self._wait()
        done = [n for s in valid for n in s[0]]
        self.stats.update(committed=self.stats["committed"] + len(valid),
                          early_matrices=self.stats["early_matrices"] + len(done),
                          discarded=self.stats["discarded"] + len(self.specs) - len(valid))
        self.specs.clear()
        results = [s[2:4] for s in valid]
        if self._active():
            for names in O.by_group(grads, rt.group_of, done):
                results.append(self._compute(opt, names, {n: grads[n] for n in names}))
                done += names
        cur = torch.cuda.current_stream(rt.device) if self.cuda else None
        for fields, params in results:
            commit_(opt._owner.state, opt._owner.fields, rt.owned_masters(), fields, params)
            for t in result_tensors(fields, params) if cur is not None else ():
                t.record_stream(cur)  # made on the side stream, read here: freed after this
        return {n: None if n in done else g for n, g in grads.items()}, done

    def discard(self) -> None:
        """Drop every speculation (``zero_grad``, cleared gradients, a new mode)."""
        self.stats["discarded"] += len(self.specs)
        self.specs.clear()
        self._wait()

    def _wait(self) -> None:
        for ev in self.events:
            torch.cuda.current_stream(self.rt.device).wait_event(ev)
        self.events.clear()

    def step_done(self) -> None:
        """End of ``step()``: ``"auto"`` times alternating iterations (CUDA events), then agrees
        once (one collective; one host sync) whether to keep the overlap, on most ranks' vote."""
        if self.mode != "auto":
            return
        self._ends.append(torch.cuda.Event(enable_timing=True))
        self._ends[-1].record(torch.cuda.current_stream(self.rt.device))
        its = range(O.AUTO_WARMUP + 1, O.AUTO_WARMUP + 2 * O.AUTO_EACH + 1)
        if len(self._ends) <= its[-1]:
            return
        self._ends[-1].synchronize()
        off, on = O.auto_split({k: self._ends[k - 1].elapsed_time(self._ends[k]) for k in its})
        votes = host_sum([int(O.auto_choice(off, on)), 1], what="ns_overlap auto",
                         via=self.rt.mesh_groups, device=self.rt.device)
        (self.mode, self.reason), self._ends = O.auto_verdict(off, on, votes), []
        logger.info("dmuon: ns_overlap %s", self.reason)
