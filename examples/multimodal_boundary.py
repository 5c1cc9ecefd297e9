"""``hook_boundary_predicate`` on a nested multimodal model (a vision tower and a language model in
one module, Qwen-VL / LLaVA style), runnable on CPU with gloo.

    torchrun --nproc_per_node 2 examples/multimodal_boundary.py --steps 20
    python examples/multimodal_boundary.py --steps 20      # spawns 2 local ranks itself

The hook boundary is the module whose forward hooks gather a dedicated matrix (and free it after,
Z3). By default it is the outermost ``layers.N`` / ``blocks.N`` ancestor of the param, and params
outside any such block go to the root group (gathered for the whole forward). That is wrong for
two parts of this model: the hierarchical (Swin-like) vision tower ``encoder.layers.S.blocks.B``
would be gathered a whole stage at a time, and the projector between the towers would stay gathered
for the whole step. The predicate names the modules that are boundaries instead, matching the
``fully_shard`` units::

    dmuon.dedicate_params(model, mesh, predicate=...,
        hook_boundary_predicate=lambda m: isinstance(m, (VisionBlock, Projector, DecoderLayer)))

then ``fully_shard`` each vision block and decoder layer, and the root, as usual.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.launch import run

VOCAB, SEQ, PATCHES, PATCH_DIM = 64, 16, 4, 12
D_VIS, D_LM = 32, 48


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv_proj = nn.Linear(d, 3 * d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, causal: bool):
        b, t, d = x.shape
        q, k, v = self.qkv_proj(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up_proj = nn.Linear(d, 2 * d, bias=False)
        self.down_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), SelfAttention(d)
        self.norm2, self.mlp = nn.LayerNorm(d), Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x), causal=False)
        return x + self.mlp(self.norm2(x))


class VisionStage(nn.Module):
    def __init__(self, d: int, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(d) for _ in range(depth))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


class VisionTower(nn.Module):
    """Hierarchical encoder: ``encoder.layers.S.blocks.B`` (stages of blocks, Swin style)."""

    def __init__(self, stages: int = 2):
        super().__init__()
        self.patch_embed = nn.Linear(PATCH_DIM, D_VIS)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionStage(D_VIS) for _ in range(stages))
        self.post_norm = nn.LayerNorm(D_VIS)

    def forward(self, patches):
        x = self.patch_embed(patches)
        for stage in self.encoder.layers:
            x = stage(x)
        return self.post_norm(x)


class Projector(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_1 = nn.Linear(D_VIS, D_LM, bias=False)
        self.linear_2 = nn.Linear(D_LM, D_LM, bias=False)

    def forward(self, x):
        return self.linear_2(F.gelu(self.linear_1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.input_layernorm, self.self_attn = nn.RMSNorm(d), SelfAttention(d)
        self.post_attention_layernorm, self.mlp = nn.RMSNorm(d), Mlp(d)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x), causal=True)
        return x + self.mlp(self.post_attention_layernorm(x))


class LanguageModel(nn.Module):
    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D_LM)
        self.layers = nn.ModuleList(DecoderLayer(D_LM) for _ in range(n_layers))
        self.norm = nn.RMSNorm(D_LM)


class VisionLanguageModel(nn.Module):
    """``vision_tower`` -> ``multi_modal_projector`` -> image tokens prefixed to the text tokens
    -> ``language_model`` -> ``lm_head``; returns the next-token loss on the text."""

    def __init__(self):
        super().__init__()
        self.vision_tower = VisionTower()
        self.multi_modal_projector = Projector()
        self.language_model = LanguageModel()
        self.lm_head = nn.Linear(D_LM, VOCAB, bias=False)

    def forward(self, patches, input_ids):
        img = self.multi_modal_projector(self.vision_tower(patches))
        h = torch.cat([img, self.language_model.embed_tokens(input_ids[:, :-1])], dim=1)
        for layer in self.language_model.layers:
            h = layer(h)
        logits = self.lm_head(self.language_model.norm(h))[:, img.shape[1]:]
        return F.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten())


def muon_predicate(name: str, p: torch.Tensor) -> bool:
    """Every projection matrix of both towers and the projector; embeddings and heads stay AdamW."""
    return p.ndim == 2 and any(k in name for k in ("_proj", "linear_"))


def boundary(module: nn.Module) -> bool:
    """Hook boundaries = the fully_shard units: vision blocks, the projector, decoder layers."""
    return isinstance(module, (VisionBlock, Projector, DecoderLayer))


def build(seed: int = 0, dtype: torch.dtype = torch.float32) -> VisionLanguageModel:
    torch.manual_seed(seed)
    return VisionLanguageModel().to(dtype)


def shard(model: VisionLanguageModel, mesh) -> None:
    """fully_shard every vision block and decoder layer, then the root."""
    for stage in model.vision_tower.encoder.layers:
        for blk in stage.blocks:
            fully_shard(blk, mesh=mesh)
    for layer in model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def batches(rank: int, steps: int, per_rank: int, dtype: torch.dtype = torch.float32):
    """Images whose patches encode a start token; the text counts up from it (learnable)."""
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (per_rank, 1), generator=g)
        ids = (start + torch.arange(SEQ)) % VOCAB
        patches = torch.randn(per_rank, PATCHES, PATCH_DIM, generator=g, dtype=dtype)
        patches[:, :, 0] = start.to(dtype) / VOCAB
        yield patches, ids


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build()
    dmuon.dedicate_params(model, mesh, predicate=muon_predicate, hook_boundary_predicate=boundary)
    shard(model, mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)
    if rank == 0:
        print("hook groups:", ", ".join(optimizer.dedicated_state.groups), flush=True)
    for step, (patches, ids) in enumerate(batches(rank, a.steps, per_rank=4)):
        optimizer.zero_grad()
        loss = model(patches, ids)
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step + 1:3d}  loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    run(main, sys.argv[1:], world_size=2, backend="gloo")
