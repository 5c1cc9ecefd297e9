"""A small Llama-shaped decoder for the demo (names follow Hugging Face Llama: ``layers.N...``).

Per block (pre-norm residual)::

    h = x + o_proj(attn(q_proj(n1(x)), k_proj(n1(x)), v_proj(n1(x))))     causal, RoPE on q and k
    y = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))             SwiGLU

with RMSNorm ``n(x) = x / sqrt(mean(x^2) + eps) * w`` (Zhang & Sennrich 2019), rotary position
embeddings (Su et al. 2021, "RoFormer"), SwiGLU (Shazeer 2020), tied or untied LM head.
Parameter names: ``embed_tokens.weight``, ``layers.{i}.input_layernorm.weight``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.post_attention_layernorm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight`` (untied only).
Every matrix with ``"proj"`` in its name is a Muon target (:func:`is_muon_param`); embeddings, norms
and the head are not.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DemoConfig", "DemoLM", "Block", "is_muon_param"]


@dataclass(frozen=True)
class DemoConfig:
    """Shape of :class:`DemoLM`.

    Attributes:
      vocab: vocabulary size.
      hidden: model width (divisible by ``heads``; head dim must be even for RoPE).
      layers: number of blocks.
      heads: attention heads.
      intermediate: SwiGLU inner width (default ``0``: 8/3 * hidden rounded up to a multiple of 8).
      max_seq_len: longest sequence (RoPE table length).
      tie_embeddings: share the embedding matrix with the LM head.
      rope_theta: RoPE base.
    """

    vocab: int = 64
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 0
    max_seq_len: int = 128
    tie_embeddings: bool = False
    rope_theta: float = 10000.0

    @property
    def ffn(self) -> int:
        if self.intermediate:
            return self.intermediate
        return -(-(8 * self.hidden // 3) // 8) * 8

    def as_dict(self) -> dict:
        d = asdict(self)
        d["intermediate"] = self.ffn
        return d


def is_muon_param(name: str, p: Tensor) -> bool:
    """The demo's Muon predicate: every matrix with ``"proj"`` in its name (the attention and MLP
    projections); embeddings, norms and the head go to AdamW."""
    return p.ndim == 2 and "proj" in name


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE (q/k/v/o projections, no biases)."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        if cfg.hidden % cfg.heads or (cfg.hidden // cfg.heads) % 2:
            raise ValueError(f"hidden={cfg.hidden} must split into {cfg.heads} heads of even size")
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        h = cfg.hidden
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, L, H = x.shape
        q = self.q_proj(x).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, H))


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (first half, second half) of the head dim by position-dependent angles."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm decoder block (the FSDP2 / dmuon hook boundary)."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DemoLM(nn.Module):
    """Llama-shaped causal LM. ``forward(tokens) -> logits (B, L, vocab)``.

    Initialization (deterministic under ``torch.manual_seed``): embeddings N(0, 1), projections
    N(0, 0.02) with the residual-output projections (``o_proj``, ``down_proj``) scaled by
    ``1/sqrt(2 * layers)``, head N(0, 0.02), norms 1.
    """

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        hd = cfg.hidden // cfg.heads
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.arange(cfg.max_seq_len, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("rope_cos", ang.cos().float(), persistent=False)
        self.register_buffer("rope_sin", ang.sin().float(), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        nn.init.normal_(self.embed_tokens.weight, std=1.0 if self.lm_head is not None else std)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=std / (2 * self.cfg.layers) ** 0.5)
            elif "proj" in name or name.startswith("lm_head"):
                nn.init.normal_(p, std=std)
            elif "norm" in name:
                nn.init.ones_(p)

    def forward(self, tokens: Tensor) -> Tensor:
        L = tokens.shape[1]
        if L > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {L} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:L], self.rope_sin[:L]
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, w)
