"""Writes ``old_checkpoints.pt``: checkpoints of plain Muon and of NorMuon written by an older
dmuon (the commit it ran at is recorded), and the weights that commit reached when it resumed
from them, for ``tests/test_old_checkpoints.py``.

    cd <a checkout of the older commit> && \\
    PYTHONPATH=$PWD:$PWD/tests python <this repo>/tests/data/make_old_checkpoints.py OUT.pt

Two gloo ranks (one thread each), the tiny fp64 model of ``tests/models.py``, 2 steps, then each
checkpoint (dmuon's full optimizer dict, and torch's protocol as a full state dict through
``torch.distributed.checkpoint.state_dict``) and 2 more steps. Only public API calls that both
the older and the current dmuon accept are used.
"""
from __future__ import annotations

import subprocess
import sys

import torch

HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, ns_steps=5, ns_dtype=torch.float64,
          adamw_lr=3e-3, adamw_betas=(0.9, 0.99), adamw_eps=1e-8, adamw_weight_decay=0.02)
STEPS, BATCH = 4, 4


def build(rank: int, world: int, kind: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.functional import variants
    from models import make_model, muon_predicate

    model = make_model()
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, muon_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kw = {} if kind == "muon" else {"transform": variants.normuon()}
    return model, dmuon.Muon(model, **HP, **kw)


def train(model, opt, rank: int, world: int, batches) -> None:
    for ids in batches:
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()


def worker(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    import dmuon
    from models import make_batches
    batches = make_batches(STEPS, BATCH)
    out = {}
    for kind in ("muon", "normuon"):
        model, opt = build(rank, world, kind)
        train(model, opt, rank, world, batches[:2])
        sd = {"model": dmuon.get_model_state_dict(model, cpu_offload=True),
              "optim_full": dmuon.get_optimizer_state_dict(model, opt, cpu_offload=True),
              "optim_torch": get_optimizer_state_dict(
                  model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))}
        train(model, opt, rank, world, batches[2:])
        sd["final"] = dmuon.get_model_state_dict(model, cpu_offload=True)
        out[kind] = sd
    return out


def main() -> None:
    from dmuon.launch import run_local_ranks
    results, errors = run_local_ranks(worker, 2, (), {}, backend="gloo", timeout_s=120)
    if errors:
        raise SystemExit("\n".join(errors.values()))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    torch.save({"commit": commit.strip(), "torch": torch.__version__, "hp": HP,
                "steps": STEPS, "batch": BATCH, **results[0]}, sys.argv[1])


if __name__ == "__main__":
    main()
