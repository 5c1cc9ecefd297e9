"""The seeds' torchtitan recipe: ``dedicate_params`` before a ``parallelize_model`` that calls
``fully_shard`` itself (here a stand-in with torchtitan's structure; CPU / gloo), on torchtitan's
real path: the model is built on the meta device, then ``to_empty`` + ``init_weights`` after
parallelizing (no rank allocates a dedicated matrix outside its owner column).

    torchrun --nproc_per_node 2 examples/torchtitan_style.py --steps 20
    python examples/torchtitan_style.py --steps 20        # spawns 2 local ranks itself

torchtitan keeps decoder blocks in ``model.layers`` (a ``ModuleDict`` keyed "0", "1", ...) and its
``parallelize_*`` functions call ``fully_shard`` per block (with a ``MixedPrecisionPolicy`` and a
reshard policy) and on the root. ``import dmuon`` makes those calls skip the dedicated matrices
whatever module imported ``fully_shard``, so the only change to a torchtitan training script is the
``dedicate_params`` call before ``parallelize`` and ``dmuon.Muon`` as the optimizer. With the real
torchtitan (``torchtitan.models.llama3.parallelize_llama``, ``spmd_backend="partial_dtensor"``) the
call is ``dmuon.dedicate_params(model, parallel_dims.get_mesh("fsdp"), predicate)``; with HSDP
also pass ``replicate_mesh=parallel_dims.get_mesh("dp_replicate")``. torchtitan 0.3's default
backend (``spmd_types``) shards on the full SPMD mesh with ``dp_mesh_dims``; pass dmuon the same:
``mesh, dims = resolve_fsdp_mesh(parallel_dims)``, ``dedicate_params(model, mesh, predicate,
options=dmuon.DedicateOptions(dp_mesh_dims=dims))`` (docs/integrations/torchtitan-spmd.md). In HSDP's async mode call
``dmuon.wait_all_replicate_broadcasts(model)`` before torchtitan's DCP checkpoint save.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as _fully_shard  # imported before dmuon: still patched

import dmuon
from dmuon.launch import run


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 64
    seq_len: int = 32
    lr: float = 0.02
    adamw_lr: float = 3e-3


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.wq = nn.Linear(a.dim, a.dim, bias=False)
        self.wk = nn.Linear(a.dim, a.dim, bias=False)
        self.wv = nn.Linear(a.dim, a.dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, 4 * a.dim, bias=False)
        self.w2 = nn.Linear(4 * a.dim, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, 4 * a.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(a.dim), Attention(a)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(a.dim), FeedForward(a)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def init_weights(self) -> None:
        """torchtitan's shape of init: run after ``to_empty`` on every rank."""
        nn.init.normal_(self.tok_embeddings.weight)
        for name, p in self.named_parameters():
            if p.ndim == 2 and name != "tok_embeddings.weight":
                nn.init.trunc_normal_(p, mean=0.0, std=0.02, a=-0.04, b=0.04)
            elif p.ndim == 1:
                nn.init.ones_(p)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def build_model(config: ModelArgs) -> Transformer:
    with torch.device("meta"):  # torchtitan builds on meta; nothing is allocated here
        return Transformer(config)


def parallelize_model(model: Transformer, mesh, config: ModelArgs) -> Transformer:
    """torchtitan's ``apply_fsdp`` shape: fully_shard per block (no reshard for the last), then root."""
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    dp_mesh = mesh["dp"]
    n = len(model.layers)
    for i, block in enumerate(model.layers.values()):
        _fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
    _fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def dataloader(rank: int, config: ModelArgs, steps: int, per_rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        start = torch.randint(0, config.vocab_size, (per_rank, 1), generator=g)
        yield (start + torch.arange(config.seq_len + 1)) % config.vocab_size


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    config = ModelArgs()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = build_model(config)

    # apply dmuon before torchtitan-style wrapping
    dmuon.dedicate_params(model, mesh["dp"],
                          predicate=lambda n, p: p.ndim == 2 and "layers." in n)
    parallelize_model(model, mesh, config)      # calls fully_shard (TP: not supported by dmuon yet)
    model.to_empty(device="cpu")                # torchtitan: init_device; FSDP2 shards get storage
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()                    # writes each dedicated matrix on its owner only
    optimizer = dmuon.Muon(model, lr=config.lr, adamw_lr=config.adamw_lr)

    for step, batch in enumerate(dataloader(dist.get_rank(), config, a.steps, per_rank=4)):
        optimizer.zero_grad()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"step {step + 1:3d}  loss {loss.item():.4f}", flush=True)
    dmuon.wait_all_replicate_broadcasts(model)  # before a foreign (DCP) checkpointer


if __name__ == "__main__":
    run(main, sys.argv[1:], world_size=2, backend="gloo")
