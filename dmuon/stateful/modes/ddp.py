"""DDP mode: dedicated matrices on a data-parallel (replicated) model.

Spelling (one option of :func:`dmuon.dedicate_params`)::

    import dmuon
    mesh = init_device_mesh("cpu", (world,))                  # the ranks DDP spans
    dmuon.dedicate_params(model, mesh, predicate, data_parallel="ddp")
    model = DistributedDataParallel(model)                    # skips the dedicated matrices
    optimizer = dmuon.Muon(model, ...)

Why an option and not detection: what ``dedicate_params`` builds (where the masters live, which
ranks reduce to whom) is fixed before ``DistributedDataParallel`` / ``fully_shard`` ever sees the
model, so the mode must be known then; and a mismatch must raise, not silently pick a mode.

**What runs.** The mesh is read as ``R = world`` replicas of one shard (``G = 1``): the owner plan
spreads the matrices over all ranks; every rank holds every matrix whole (its master, in the
param's dtype when that is fp32/fp64: the param *is* its master, no second copy, DDP's memory
model). Backward averages each dedicated gradient to its owner (the existing reduce schedule,
stage 2 over the replicate axis, with presence flags); only the owner runs momentum +
Newton–Schulz + update (the functional update); ``step()`` then broadcasts the new value from the
owner to every rank (the HSDP publish, async by default), which each hook group's next forward
waits. Bytes per rank per step: the same as DDP's all-reduce of these matrices (see README);
Newton–Schulz work per rank: ``1/world`` of it.

Between a backward and the next forward the dedicated params show dmuon's placeholders, as in
FSDP mode (torch tools that would silently miss their gradients raise; read values with
``dmuon.get_model_state_dict``); during forward and backward they are the full matrices.

**DDP integration.** ``dedicate_params`` adds the dedicated names to the model's
``_ddp_params_and_buffers_to_ignore`` (the attribute
``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` sets), so DDP neither
broadcasts nor all-reduces them. DDP's own ``no_sync()`` is honoured: a forward run while the
wrapping DDP has ``require_backward_grad_sync=False`` makes its backward accumulate locally, as
``dmuon.no_sync`` does. Mismatches raise with the fix: FSDP-mode dedication then
``DistributedDataParallel(model)`` (at DDP's construction), DDP-mode dedication then ``fully_shard``
(at ``dmuon.Muon`` and at the first forward); torch's composable (DDP-based) ``replicate`` raises
(use ``DistributedDataParallel``); a training forward (grad enabled) outside the DDP wrapper
raises (the other params would never be all-reduced); evaluation under ``torch.no_grad()`` may
call the inner module.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

from dmuon.compat.torch_api import DDP_IGNORE_ATTR, composable_replicate_applied
from dmuon.functional.dedicate_options import DATA_PARALLEL_MODES
from dmuon.stateful.runtime.state import unwrap_model

logger = logging.getLogger(__name__)

#: the attribute DDP reads the names to skip from

__all__ = ["DATA_PARALLEL_MODES", "check_mode", "ddp_grid", "install_ddp_mode",
           "guard_fsdp_mode", "check_backend"]


def check_mode(data_parallel: Any) -> str:
    """Validate ``dedicate_params(data_parallel=...)``.

    Raises:
      ValueError: not one of :data:`DATA_PARALLEL_MODES`."""
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(f"dedicate_params: data_parallel must be one of {DATA_PARALLEL_MODES} "
                         f"(\"fsdp\": the model is then fully_shard-ed, FSDP2 / HSDP; \"ddp\": it is "
                         f"then wrapped in DistributedDataParallel), got {data_parallel!r}")
    return data_parallel


def ddp_grid(grid: tuple) -> tuple:
    """The ``grid[r][s]`` of DDP mode: the 1-D mesh's ranks as ``R = world`` replicas of one
    shard (``G = 1``).

    Raises:
      ValueError: ``grid`` is not one row (a 2-D or HSDP mesh was given)."""
    if len(grid) != 1:
        raise ValueError(
            "dedicate_params(data_parallel=\"ddp\") takes the 1-D mesh of the ranks DDP spans "
            "(init_device_mesh(device, (world,))) and no replicate_mesh; got a 2-D / HSDP layout "
            f"of {len(grid)} x {len(grid[0])}. For HSDP use data_parallel=\"fsdp\" (the default).")
    return tuple((int(x),) for x in grid[0])


class _NotForDDP(list):
    """``model._ddp_params_and_buffers_to_ignore`` of an FSDP-mode model: DDP's constructor
    iterates it, which raises with the fix (FSDP-mode dedication then DDP). ``copy.deepcopy`` /
    pickling the model reaches it first too (before any placeholder): that raises with the fix for
    copies."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(
            "copy.deepcopy / pickling a model after dmuon.dedicate_params: its dedicated matrices "
            "live whole on their owner ranks (here: empty placeholders), so a copy would hold no "
            "weights. For an EMA / teacher copy, build a plain model of the same class and load "
            "dmuon.get_model_state_dict(model) into it (or deepcopy before dedicate_params and "
            "dedicate the copy too, then dmuon.set_model_state_dict(copy, "
            "dmuon.get_model_state_dict(model))); to save, use dmuon.get_model_state_dict / "
            "dmuon.save_sharded.")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError(
            "DistributedDataParallel(model): this model's matrices were dedicated for FSDP2 "
            "(dmuon.dedicate_params(..., data_parallel=\"fsdp\"), the default), which expects "
            "fully_shard, not DDP. For DDP call dmuon.dedicate_params(model, mesh, predicate, "
            "data_parallel=\"ddp\") instead (mesh: the 1-D mesh of the DDP ranks), then "
            "DistributedDataParallel(model).")


def guard_fsdp_mode(model: nn.Module) -> None:
    """FSDP mode: make a later ``DistributedDataParallel(model)`` raise (see :class:`_NotForDDP`).
    A model that already names params for DDP to ignore keeps its list (not guarded)."""
    if not hasattr(model, DDP_IGNORE_ATTR):
        object.__setattr__(model, DDP_IGNORE_ATTR, _NotForDDP())


def check_backend(model: nn.Module, st: Any, what: str) -> None:
    """Raise if the data parallelism applied to ``model`` does not fit the mode it was dedicated
    for (the same verdict on every rank: it depends only on the model's structure).

    Raises:
      RuntimeError: DDP mode and a ``fully_shard`` that shards params; composable ``replicate``.
    """
    if composable_replicate_applied(model):
        raise RuntimeError(
            f"{what}: torch's composable replicate() was applied to a model with dedicated "
            "matrices; dmuon supports DistributedDataParallel for data parallelism. Use "
            "dmuon.dedicate_params(model, mesh, predicate, data_parallel=\"ddp\") and then "
            "model = DistributedDataParallel(model).")
    if getattr(st, "data_parallel", "fsdp") != "ddp":
        return
    sharded = []
    for n, p in model.named_parameters():
        placements = getattr(p, "placements", None)
        if placements is not None and any(pl.is_shard() for pl in placements):
            sharded.append(n)
    if sharded:
        raise RuntimeError(
            f"{what}: the model was dedicated with data_parallel=\"ddp\" but fully_shard sharded "
            f"its params ({sharded[:3]}{' ...' if len(sharded) > 3 else ''}). For FSDP2 / HSDP "
            "call dmuon.dedicate_params(model, mesh, predicate) (data_parallel=\"fsdp\", the "
            "default) before fully_shard; for DDP wrap the model in DistributedDataParallel "
            "instead of fully_shard.")


def _active_ddp(model: nn.Module) -> Optional[Any]:
    """The ``DistributedDataParallel`` whose forward is running ``model``, if any."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None or unwrap_model(ddp) is not model:
        return None
    return ddp


def install_ddp_mode(model: nn.Module, st: Any) -> None:
    """The model side of DDP mode (its state was built in it: ``G = 1``, no reshard after
    forward, zero-copy groups where the compute dtypes are the masters', the step program's
    :attr:`~dmuon.functional.program.GroupPhases.zero_copy`): DDP's ignore list, and a root
    pre-forward hook that follows the wrapping DDP's ``no_sync``."""
    names = list(st.params)
    prev = getattr(model, DDP_IGNORE_ATTR, None)
    prev = [] if prev is None or isinstance(prev, _NotForDDP) else list(prev)
    object.__setattr__(model, DDP_IGNORE_ATTR, prev + [n for n in names if n not in prev])
    paused = {"by_ddp": False}

    def follow_ddp_no_sync(module: nn.Module, args: Any) -> None:
        from dmuon.compat.torch_api import in_backward
        if in_backward():
            return
        st.lazy_init()
        if paused.get("checked") is None:
            check_backend(model, st, "dmuon (first forward)")
            paused["checked"] = True
        ddp = _active_ddp(model)
        if ddp is None and torch.is_grad_enabled() and st.R > 1:
            raise RuntimeError(
                "dmuon: a training forward (grad enabled) of a model dedicated with "
                "data_parallel=\"ddp\" ran outside DistributedDataParallel: its other params "
                "would never be all-reduced and the replicas would drift apart. Wrap it, model = "
                "DistributedDataParallel(model), and call that wrapper (evaluation under "
                "torch.no_grad() may call the inner module). DDP's python reducer (compiled "
                "autograd) is not supported.")
        want = True if ddp is None else bool(ddp.require_backward_grad_sync)
        if not want and st.require_grad_sync:
            st.require_grad_sync = False
            paused["by_ddp"] = True
        elif want and paused["by_ddp"]:
            st.require_grad_sync = True
            paused["by_ddp"] = False

    st.ddp_hook = model.register_forward_pre_hook(
        torch.compiler.disable(follow_ddp_no_sync, recursive=True))
