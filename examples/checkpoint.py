"""Checkpointing with dmuon (the seeds' full example): save every k steps, resume if present.

    python examples/checkpoint.py                      # spawns 2 local gloo ranks
    python examples/checkpoint.py 1 --steps 40         # resume the same checkpoint on 1 rank
    python examples/checkpoint.py 2 --sharded          # torch.distributed.checkpoint, no gather
    torchrun --nproc_per_node 4 examples/checkpoint.py --steps 60

Two formats, both independent of the topology (resume at another (shard, replicate) shape):

* full (default): ``dmuon.get_model_state_dict`` / ``get_optimizer_state_dict`` on every rank,
  rank 0 ``torch.save``-s one file, every rank loads it (``rank0_only=True`` keeps the dicts on
  rank 0 only). The model dict is a plain single-device ``state_dict``.
* ``--sharded``: ``save_sharded`` / ``load_sharded`` (DCP): each rank writes only its shards and
  owned matrices; nobody gathers the model.
"""
from __future__ import annotations

import argparse
import glob
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.launch import run
from dmuon.checkpoint.sharded import load_sharded, save_sharded

VOCAB, DIM, SEQ = 64, 32, 16


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up_proj = nn.Linear(dim, 4 * dim, bias=False)
        self.down_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down_proj(F.gelu(self.up_proj(self.norm(x))))


class MyModel(nn.Module):
    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(n_layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def setup_model(mesh):
    """Build and wrap the model (the same init on every rank)."""
    torch.manual_seed(0)
    model = MyModel()
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    return model, optimizer


def save_checkpoint(model, optimizer, step, path):
    model_sd = dmuon.get_model_state_dict(model)              # collective: every rank calls
    optim_sd = dmuon.get_optimizer_state_dict(model, optimizer)
    if dist.get_rank() == 0:
        tmp = path + ".tmp"
        torch.save({"model": model_sd, "optim": optim_sd, "step": step}, tmp)
        os.replace(tmp, path)                                  # never leave a torn file
    dist.barrier()


def load_checkpoint(model, optimizer, path):
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    dmuon.set_model_state_dict(model, ckpt["model"])
    dmuon.set_optimizer_state_dict(model, optimizer, ckpt["optim"])
    return ckpt.get("step", 0)


def batch(step: int, rank: int, world: int, global_batch: int = 8):
    """Step-indexed synthetic data (sequences counting up), split over the ranks: a resumed run
    sees the same data whatever the world size."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (global_batch, 1), generator=g)
    return ((start + torch.arange(SEQ)) % VOCAB).chunk(world)[rank]


def main(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, optimizer = setup_model(mesh)
    os.makedirs(args.dir, exist_ok=True)
    full_path = os.path.join(args.dir, "checkpoint.pt")
    dcp_dir = os.path.join(args.dir, "sharded")

    start_step = 0                                             # resume if a checkpoint exists
    # (or a complete one a crash left between the two renames of its publish: load_sharded
    # finishes that publish). A refused checkpoint raises CheckpointError on every rank: stop
    # there, as starting over would save over the good checkpoints kept beside it.
    if args.sharded and (os.path.exists(dcp_dir) or glob.glob(
            os.path.join(glob.escape(dcp_dir) + ".partial-*", "dmuon-complete.json"))):
        start_step = load_sharded(dcp_dir, model, optimizer).extra["step"]
    elif not args.sharded and os.path.exists(full_path):
        start_step = load_checkpoint(model, optimizer, full_path)
    if rank == 0 and start_step:
        print(f"resumed from step {start_step} on {world} rank(s)", flush=True)

    for step in range(start_step, args.steps):
        optimizer.zero_grad()
        loss = model(batch(step, rank, world))
        loss.backward()
        optimizer.step()
        if (step + 1) % args.save_every == 0:
            if args.sharded:
                # atomic: a save killed midway leaves the previous checkpoint; keep two
                save_sharded(dcp_dir, model, optimizer, extra={"step": step + 1}, keep_last=2)
            else:
                save_checkpoint(model, optimizer, step + 1, full_path)
            if rank == 0:
                print(f"step {step + 1:3d}  loss {loss.item():.4f}  (saved)", flush=True)


def _parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("world", nargs="?", type=int, default=2, help="ranks to spawn (no torchrun)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--sharded", action="store_true", help="torch.distributed.checkpoint format")
    p.add_argument("--dir", default="checkpoints")
    return p.parse_args()


if __name__ == "__main__":
    cli = _parse()
    run(main, cli, world_size=cli.world, backend="gloo")
