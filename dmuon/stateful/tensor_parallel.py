"""Tensor parallelism (DTensor ``parallelize_module``) and dmuon: every path raises, on every rank.

dmuon does not support tensor parallelism yet: Newton–Schulz must see the *full* matrix, and a
TP-sharded matrix would have to be gathered over the TP group to its owner (or handed out in
slices by the owner's forward broadcast), which the owner plan, the schedules and the byte
accounting do not cover. Rather than train silently wrong, each way a user can combine them raises
a clear error on every rank, before any collective that only some ranks would reach:

* **TP first, then** ``dedicate_params`` (order A): a selected param that is a ``DTensor`` raises
  :class:`TensorParallelUnsupported` (agreed across ranks like every ``dedicate_params`` check);
* ``dedicate_params`` **on** ``mesh["dp"]`` of a ``(dp, tp)`` mesh (orders A and B, and 3-D
  ``(replicate, shard, tp)`` meshes): the mesh does not span the world, which the setup check
  refuses on every rank, naming tensor parallelism (:mod:`dmuon.functional.setup_check`);
* ``dedicate_params`` **first, then TP** (order B, on a mesh that spans the world): TP's
  ``distribute_tensor`` reads the dedicated param, and the placeholder (or, in a meta-device
  model's init window, :class:`~dmuon.stateful.meta_init.DedicatedUninit`) raises
  :class:`TensorParallelUnsupported` on every rank at that first read, before TP's scatter.

**Which route support should take, by bytes** (matrix of ``P`` bytes, TP degree ``T``, shard
group ``G``; not built yet). (1) *TP-local dedication*: each TP rank ``t`` dedicates its ``P/T``
shard inside its own dp group (forward broadcast and gradient reduce as today, ``P/T`` each), and
at the step the owner's TP peers gather the momentum-updated ``P/T`` slices to one rank (or
all-gather them: ``(T-1)/T P`` received per rank, NS then run ``T`` times), which scatters the
update back (``(T-1)/T P``). (2) *Owner holds the full matrix* and hands each of the ``G T - 1``
other ranks its ``P/T`` slice in the forward broadcast: the owner's link sends ``~G P`` per forward
and receives ``~G P`` of gradient slices, ``G`` times the ``~P`` of (1)'s ring / tree collectives,
and every slice is a separate point-to-point transfer. Route (1) moves less over the busiest link
and keeps dmuon's broadcast / reduce schedules per dp group; it is the one to build.
"""
from __future__ import annotations

import sys

from dmuon.stateful.errors import DedicatedParamError

__all__ = ["TensorParallelUnsupported", "TP_FIX", "from_dtensor_api", "tp_error"]

#: what to do instead (named by every TP error)
TP_FIX = ("dmuon does not support tensor parallelism yet (Newton–Schulz needs the full matrix, "
          "which TP shards): train with tp = 1 (dedicate_params on a mesh over every rank, "
          "FSDP2 / HSDP only), or keep TP and use another optimizer")

_DTENSOR_PKG = "torch.distributed.tensor"


class TensorParallelUnsupported(DedicatedParamError, NotImplementedError):
    """Tensor parallelism met a dedicated param (see the module docstring)."""


def from_dtensor_api(max_depth: int = 40) -> bool:
    """Whether the current call comes from DTensor's API (``distribute_tensor``,
    ``parallelize_module``'s styles): a frame of a ``torch.distributed.tensor`` module."""
    f = sys._getframe(1)
    for _ in range(max_depth):
        if f is None:
            return False
        if f.f_globals.get("__name__", "").startswith(_DTENSOR_PKG):
            return True
        f = f.f_back
    return False


def tp_error(name: str, owner: object) -> TensorParallelUnsupported:
    """The error for DTensor's API touching dedicated param ``name`` after ``dedicate_params``."""
    return TensorParallelUnsupported(
        f"dmuon: tensor parallelism (DTensor distribute_tensor / parallelize_module) was applied "
        f"to the dedicated param {name!r} (owner rank {owner}) after dedicate_params. {TP_FIX}.")
