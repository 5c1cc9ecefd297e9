"""DDP mode's rules (pure; :mod:`dmuon.stateful.modes.ddp` acts on them): how the dedicated
matrices follow the wrapping ``DistributedDataParallel``'s ``no_sync``, and what each data-parallel
mode refuses, with the fix."""
from __future__ import annotations

from typing import Sequence

__all__ = ["follow_ddp_sync", "COPY_REFUSED", "DDP_IN_FSDP_MODE", "FORWARD_OUTSIDE_DDP",
           "replicate_refused", "sharded_in_ddp_mode"]

#: ``copy.deepcopy`` / pickling of a dedicated model (either mode)
COPY_REFUSED = (
    "copy.deepcopy / pickling a model after dmuon.dedicate_params: its dedicated matrices live "
    "whole on their owner ranks (here: empty placeholders), so a copy would hold no weights. For "
    "an EMA / teacher copy, build a plain model of the same class and load "
    "dmuon.get_model_state_dict(model) into it (or deepcopy before dedicate_params and dedicate "
    "the copy too, then dmuon.set_model_state_dict(copy, dmuon.get_model_state_dict(model))); to "
    "save, use dmuon.get_model_state_dict / dmuon.save_sharded.")

#: ``DistributedDataParallel(model)`` of a model dedicated for FSDP2
DDP_IN_FSDP_MODE = (
    "DistributedDataParallel(model): this model's matrices were dedicated for FSDP2 "
    "(dmuon.dedicate_params(..., data_parallel=\"fsdp\"), the default), which expects fully_shard, "
    "not DDP. For DDP call dmuon.dedicate_params(model, mesh, predicate, data_parallel=\"ddp\") "
    "instead (mesh: the 1-D mesh of the DDP ranks), then DistributedDataParallel(model).")

#: a training forward of a DDP-mode model not through its ``DistributedDataParallel``
FORWARD_OUTSIDE_DDP = (
    "dmuon: a training forward (grad enabled) of a model dedicated with data_parallel=\"ddp\" ran "
    "outside DistributedDataParallel: its other params would never be all-reduced and the "
    "replicas would drift apart. Wrap it, model = DistributedDataParallel(model), and call that "
    "wrapper (evaluation under torch.no_grad() may call the inner module). DDP's python reducer "
    "(compiled autograd) is not supported.")


def replicate_refused(what: str) -> str:
    """torch's composable ``replicate()`` on a dedicated model (either mode)."""
    return (f"{what}: torch's composable replicate() was applied to a model with dedicated "
            "matrices; dmuon supports DistributedDataParallel for data parallelism. Use "
            "dmuon.dedicate_params(model, mesh, predicate, data_parallel=\"ddp\") and then "
            "model = DistributedDataParallel(model).")


def sharded_in_ddp_mode(what: str, sharded: Sequence[str]) -> str:
    """A DDP-mode model whose params ``fully_shard`` sharded (``sharded``: their names)."""
    return (f"{what}: the model was dedicated with data_parallel=\"ddp\" but fully_shard sharded "
            f"its params ({list(sharded[:3])}{' ...' if len(sharded) > 3 else ''}). For FSDP2 / "
            "HSDP call dmuon.dedicate_params(model, mesh, predicate) (data_parallel=\"fsdp\", the "
            "default) before fully_shard; for DDP wrap the model in DistributedDataParallel "
            "instead of fully_shard.")


def follow_ddp_sync(ddp_syncs: bool, sync: bool, paused_by_ddp: bool) -> tuple[bool, bool]:
    """The new ``(sync, paused_by_ddp)`` at a forward: DDP's ``no_sync`` (``ddp_syncs`` False)
    pauses dmuon's gradient sync (``sync``) if it is on, and DDP syncing again resumes it only if
    DDP paused it (a pause of ``dmuon.no_sync`` stays)."""
    if not ddp_syncs and sync:
        return False, True
    if ddp_syncs and paused_by_ddp:
        return True, False
    return sync, paused_by_ddp
