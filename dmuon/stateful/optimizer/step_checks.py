"""The checks ``dmuon.Muon.step`` runs before anything changes, each raising on every rank: FSDP2
gradients on some ranks only, non-finite gradients, a gradient on a param frozen at construction."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from dmuon.kernels.streams import side_stream
from dmuon.stateful.runtime.agree import rank_flags
from dmuon.stateful.runtime.state import DedicatedState, local_tensor

__all__ = ["check_same_fsdp_grads", "check_finite", "check_outside_grads", "host_all_reduce"]


def host_all_reduce(values: Sequence[int], group: Any, device: torch.device) -> list[int]:
    """Sum of the host ``values`` over ``group``, read back on the host.

    On CUDA the all-reduce runs on a side stream fed from pinned memory: the values depend on
    nothing the compute stream does, so the host waits for the collective alone, not for the
    backward still queued on the compute stream (a plain device tensor + ``tolist()`` would drain
    it, and the next kernels would start from an empty queue)."""
    if device.type != "cuda":
        t = torch.tensor(list(values), dtype=torch.int32, device=device)
        dist.all_reduce(t, group=group)
        return t.tolist()
    src = torch.tensor(list(values), dtype=torch.int32).pin_memory()
    out = torch.empty_like(src).pin_memory()
    side = _side_stream(device)
    with torch.cuda.stream(side):
        t = src.to(device, non_blocking=True)
        dist.all_reduce(t, group=group)
        out.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    return out.tolist()


def _side_stream(device: torch.device) -> Any:
    return side_stream(torch.device(device), "step_checks")


def check_same_fsdp_grads(adamw_named: Sequence[tuple[str, Any]], rt: DedicatedState) -> None:
    """Torch without FSDP2's ``set_reduce_scatter_unused_params``: raise on every rank if an
    FSDP2 param has a gradient on some ranks only (one all-reduce of a has-grad count)."""
    flags = [p.grad is not None for _, p in adamw_named]
    counts = rt.mesh_groups.control_collective(
        "FSDP2 gradient-usage all-reduce", lambda g: host_all_reduce(flags, g, rt.device))
    world = dist.get_world_size()
    bad = [n for (n, _), c in zip(adamw_named, counts) if 0 < c < world]
    if bad:
        raise RuntimeError(
            f"dmuon.Muon.step: FSDP2 params {bad[:6]}{' ...' if len(bad) > 6 else ''} have a "
            "gradient on some ranks only (e.g. parts of MoE experts that got no token on some "
            "ranks), so FSDP2's reduce-scatter mixed different params' gradients across ranks. "
            f"Nothing was updated. torch {torch.__version__}'s FSDP2 has no "
            "set_reduce_scatter_unused_params (torch 2.13's has it, and dmuon.Muon turns it "
            "on); upgrade torch, make every rank use every FSDP2 param each step, or move "
            "those params to dmuon (dedicate them), which handles it.")

def check_outside_grads(outside: Sequence[tuple[str, Any]]) -> None:
    """Raise if a param in none of the optimizer's groups (``requires_grad=False`` when
    ``dmuon.Muon`` was built, so neither dedicated nor AdamW's) has a gradient: it was unfrozen
    since, and no optimizer would apply its gradient. No collective: every rank computes the same
    verdict, since FSDP2 gives each rank a gradient of a param any rank used (a param unfrozen on
    some ranks only already breaks FSDP2's reduce-scatter)."""
    bad = [n for n, p in outside if p.grad is not None]
    if bad:
        raise RuntimeError(
            f"dmuon.Muon.step: params {bad[:6]}{' ...' if len(bad) > 6 else ''} were frozen "
            "(requires_grad=False) when dmuon.Muon(model) was built, so they are in none of its "
            "param groups (dmuon.dedicate_params skips frozen matrices too), yet they have a "
            "gradient now: they were unfrozen and would silently never be updated. Nothing was "
            "updated. To train them later, keep them trainable through dedicate_params and "
            "dmuon.Muon and freeze them afterwards with requires_grad_(False) (a param with no "
            "gradient is skipped, as torch skips it); to keep them frozen, set requires_grad_(False) "
            "again and drop their gradients (model.zero_grad()).")


def check_finite(adamw_named: Sequence[tuple[str, Any]], rt: DedicatedState,
                 grads: dict[str, Optional[torch.Tensor]]) -> bool:
    """Raise on every rank, before anything changes, if any gradient is non-finite, naming the
    ranks whose own backward produced it (the dedicated matrices' local gradients, checked as
    they were sent) and the ranks holding non-finite reduced values (FSDP2's shards, which
    FSDP2 reduced already, and the owners' averages: a finite input can overflow there)."""
    named = [(n, g) for n, g in grads.items() if g is not None]
    named += [(n, local_tensor(p.grad)) for n, p in adamw_named if p.grad is not None]
    named = [(n, g) for n, g in named if g.numel() > 0]
    mine = torch.zeros(2, dtype=torch.float32, device=rt.device)
    if rt.ledger.nonfinite is not None:
        mine[0] = rt.ledger.nonfinite.float()
    if named:
        norms = torch._foreach_norm([g for _, g in named])
        mine[1] = (~torch.isfinite(torch.stack(norms).float())).any().float()
    flags = rank_flags(mine, what="check_finite all-reduce", via=rt.mesh_groups)
    synced = flags.is_cuda  # bool() below waits for the device
    if bool(flags.any()):
        world = flags.shape[1]
        computed = [r for r in range(world) if flags[0, r] > 0]
        reduced = [r for r in range(world) if flags[1, r] > 0]
        local = [n for n, g in named if not torch.isfinite(g).all()]
        raise FloatingPointError(
            "dmuon.Muon.step: non-finite (NaN/Inf) gradients"
            + (f"; computed by the backward of ranks {computed} (dedicated matrices' local "
               "gradients)" if computed else "")
            + (f"; in the reduced gradients held by ranks {reduced} (FSDP2 shards or owners' "
               "averages)" if reduced else "")
            + (f" (here: {local[:8]})" if local else "")
            + ". Nothing was updated; call optimizer.zero_grad() to skip this batch, lower the "
            "learning rate or check the loss and inputs (or pass check_finite=False).")
    return synced
