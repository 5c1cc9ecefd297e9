"""One hook group of dedicated params (:class:`DedicatedParamGroup`): its buckets, the weights
version it holds gathered, and its in-flight collectives (its gradients' state in a backward:
:class:`dmuon.functional.backward_log.BackwardLog`). It runs
the schedules the pure phases (:mod:`dmuon.functional.phases`) return; it never decides ordering or
timing (the root state calls it).

Design notes: docs/design/runtime.md, "dmuon.stateful.runtime.param_group".
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from dmuon.functional import phases as P
from dmuon.functional.buckets import BucketKey, to_torch_dtype
from dmuon.functional.phases import ReducedGrad
from dmuon.functional.program import GroupPhases, StepProgram
from dmuon.functional.step_checks import LaunchLog
from dmuon.stateful.runtime.executor import Executor, Pending
from dmuon.stateful.runtime.storage import DedicatedStorage, GradBufferPool, alloc_storage, free_storage

__all__ = ["InflightReduce", "DedicatedParamGroup"]


class InflightReduce(NamedTuple):
    """A launched reduce not waited yet: the executor's handle, the bucket tensors it reads and
    writes, and ``{owned name: this rank (the owner) had a local gradient}``."""

    pending: Pending
    buffers: Mapping[BucketKey, torch.Tensor]
    owned_here: dict[str, bool]


def _label(group: "DedicatedParamGroup", op: str) -> record_function:
    return record_function(f"dmuon::{op} ({group.key or '<root>'})")


class DedicatedParamGroup:
    """The dedicated params of one hook-boundary module.

    Args:
      key: the hook-group key (module path; ``""``: the model itself).
      module: the boundary module.  names: its dedicated param names (sorted).
      storage: the model's :class:`~dmuon.stateful.runtime.storage.DedicatedStorage`.
      executor: runs the schedules.
      launches: the model's :class:`LaunchLog` (this group's launches are noted there).
    """

    def __init__(self, *, key: str, module: nn.Module, names: tuple[str, ...],
                 storage: DedicatedStorage, executor: Executor, launches: LaunchLog):
        self.key = key
        self.launches = launches
        self.module = module
        self.names = names
        self.storage = storage
        self.executor = executor
        self.compute_dtype: Optional[torch.dtype] = None
        self.reduce_dtype: Optional[torch.dtype] = None
        #: the weights version gathered (or gathering: :attr:`inflight_unshard`; -1: placeholders)
        #: and the one the sharded style's copy of this rank holds (-1: none yet)
        self.gathered_version = self.copy_version = -1
        #: Z3, kept gathered after a forward that gave it no hookable output tensor on this rank:
        #: the other ranks may have freed it, so its next gather (or the backward's end) still runs
        #: the collective, and every rank re-gathers it in one order
        self.kept_unhooked = False
        #: since the last backward's end (or step): a forward used this group / a re-gather of it
        #: was launched (a Z3 group a forward gathered is re-gathered once in the first backward
        #: after it: where this rank's backward never reached it, at that backward's end,
        #: :meth:`DedicatedState.on_backward_end`)
        self.forward_gathered = self.regathered = False
        #: the launches not waited yet: at most one gather and one publish, any number of reduces
        self.inflight_unshard: Optional[Pending] = None
        self.inflight_reduces: list[InflightReduce] = []
        self.inflight_publish: Optional[Pending] = None
        # built by ``setup`` at the first forward (the dtypes come from FSDP2's policy)
        self.unshard_buffers: dict[BucketKey, torch.Tensor] = {}
        self._gathered_storage: list[torch.Tensor] = []
        self._reduce_buckets: tuple = ()
        #: the step program and this group's phases of it (``setup``, at the first forward)
        self.program: Optional[StepProgram] = None
        self.phases: Optional[GroupPhases] = None

    # ------------------------------------------------------------------ setup
    def setup(self, program: StepProgram) -> None:
        """Take this group's phases from the step program and build its gathered buckets
        (storage freed), once."""
        self.program, self.phases = program, program.groups[self.key]
        self._reduce_buckets = tuple((b, to_torch_dtype(b.key.dtype))  # (bucket, torch dtype)
                                     for b in program.reduce_layout.buckets_of(self.key))
        if self.phases.zero_copy:  # DDP mode, compute dtype = master dtype: the masters themselves
            return
        self.unshard_buffers = P.gather_buffers(program, self.key, self.storage.device)
        self._gathered_storage = P.gathered_storage(self.unshard_buffers)
        for buf in self._gathered_storage:
            free_storage(buf)

    # ------------------------------------------------------------------ unshard / reshard
    def launch_unshard(self, version: int, regather: bool = False) -> None:
        """Start gathering (no-op if gathered for ``version`` or a gather is in flight; ``regather``:
        in a backward). Waits the group's pending HSDP publish first."""
        self.forward_gathered |= not regather  # (launched or already gathered)
        if self.inflight_unshard is not None or (self.gathered_version == version
                                                 and not self.kept_unhooked):
            return
        self.kept_unhooked = False
        if self.phases.zero_copy:  # nothing to move: the new masters once any publish landed
            self.wait_publish()
            self.gathered_version = version
            return
        with _label(self, "unshard"):
            self.wait_publish()
            for buf in self._gathered_storage:
                alloc_storage(buf)
            sched = P.gather(self.program, self.key, self.storage.coord, self.storage.masters,
                             self.unshard_buffers, regather=regather,
                             refresh=self.copy_version != version)
            self.copy_version = version
            self.inflight_unshard = self.executor.launch(sched, self.unshard_buffers)
            self.launches.note("unshard", f"{'regather' if regather else 'gather'}:{self.key}")
            self.regathered |= regather
            self.gathered_version = version

    def _wait_unshard(self) -> None:
        inflight, self.inflight_unshard = self.inflight_unshard, None
        if inflight is not None:
            inflight.wait()

    def unshard(self, version: int, regather: bool = False) -> None:
        """Make the params valid full tensors in the compute dtype for ``version`` (waits)."""
        self.launch_unshard(version, regather)
        with _label(self, "wait_unshard"):
            self._wait_unshard()
            views = self.storage.masters if self.phases.zero_copy else \
                P.gathered(self.program, self.key, self.unshard_buffers)
            for name in self.names:
                self.storage.point(name, views[name])

    def reshard(self) -> None:
        """Free the gathered copy (never under an in-flight gather); params become placeholders."""
        with _label(self, "reshard"):
            self._wait_unshard()
            for n in self.names:
                self.storage.point(n)
            for buf in self._gathered_storage:
                free_storage(buf)
            self.gathered_version = -1
            self.kept_unhooked = False

    @property
    def zero_copy(self) -> bool:
        """DDP mode with the masters' dtypes: the params are the masters themselves while
        "gathered" (:attr:`dmuon.functional.program.GroupPhases.zero_copy`)."""
        return self.phases is not None and self.phases.zero_copy

    @property
    def reshard_after_forward(self) -> bool:
        """Z3 (freed after forward, re-gathered in backward) or Z2: the step program's decision
        (read from the first forward on)."""
        return self.phases.reshard_after_forward

    @property
    def holds_gathered(self) -> bool:
        """Gathered or gathering (something to free at the end of a backward)."""
        return self.gathered_version != -1

    # ------------------------------------------------------------------ gradients
    def launch_reduce(self, local_grads: dict[str, torch.Tensor], pool: GradBufferPool) -> None:
        """Average this group's local grads to their owners, asynchronously (consumes them from
        ``local_grads``). A param without a local grad sends zeros and presence 0."""
        with _label(self, "reduce"):
            buffers = {b.key: pool.acquire(b.key, b.numel, dt)  # one dtype per bucket
                       for b, dt in self._reduce_buckets}
            sched, owned_here = P.reduce(
                self.program, self.key, self.storage.coord,
                {n: local_grads.pop(n) for n in self.names if n in local_grads}, buffers)
            self.inflight_reduces.append(
                InflightReduce(self.executor.launch(sched, buffers), buffers, owned_here))
            self.launches.note("reduce", self.key)

    def wait_reduces(self) -> list[ReducedGrad]:
        """Wait for this group's in-flight reduces; one :class:`ReducedGrad` per entry this rank
        owns, per reduce in launch order."""
        out: list[ReducedGrad] = []
        inflight, self.inflight_reduces = self.inflight_reduces, []
        for rec in inflight:
            with _label(self, "wait_reduce"):
                rec.pending.wait()
            out += P.reduced(self.program, self.key, self.storage.coord, rec.buffers,
                             rec.owned_here)
        return out

    def reset_backward(self) -> None:
        """Forget this backward's gather bookkeeping (end of backward)."""
        self.forward_gathered = self.regathered = False

    # ------------------------------------------------------------------ HSDP publish
    def launch_publish(self, master_buffers: Mapping[BucketKey, torch.Tensor]) -> None:
        """Broadcast the group's new masters from their owners to the other ranks of each owner's
        shard column (no-op when the schedule is empty: R == 1)."""
        if self.phases is None or len(self.phases.publish) == 0:
            return
        sched = P.publish(self.program, self.storage.coord, master_buffers, key=self.key)
        self.inflight_publish = self.executor.launch(sched, master_buffers)
        self.launches.note("publish", self.key)

    def wait_publish(self) -> None:
        """Wait for the group's pending publish, if any (local: no new collective)."""
        inflight, self.inflight_publish = self.inflight_publish, None
        if inflight is not None:
            with _label(self, "wait_publish"):
                inflight.wait()

    def __repr__(self) -> str:
        return (f"DedicatedParamGroup({self.key or '<root>'!r}, {len(self.names)} params, "
                f"gathered version {self.gathered_version})")
