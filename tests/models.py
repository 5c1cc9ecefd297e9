"""Tiny Llama-shaped transformers for the stateful-layer tests (fp64 by default).

Naming follows HF Llama without the ``model.`` prefix: ``embed_tokens``, ``layers.N.self_attn.
{q,k,v,o}_proj``, ``layers.N.mlp.{gate,up,down}_proj``, ``layers.N.{input,post_attention}_layernorm``,
``norm``, ``lm_head``. ``TinyLlama(mha_style=True)`` swaps attention for a ``MultiheadAttention``-style
module that reads ``out_proj.weight`` with ``F.linear`` instead of calling ``out_proj`` (the reason
dmuon hooks sit on layer boundaries, not on leaf modules).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _causal_attention(q, k, v):
    t = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(-1) @ v


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads  # heads = the projections' width / hd (fewer per rank under TP)

        def split(y):
            return y.view(b, t, -1, hd).transpose(1, 2)

        out = _causal_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MHAStyleAttention(nn.Module):
    """Packed in-projection plus an ``out_proj`` whose weight is read, never called."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.randn(3 * dim, dim) / math.sqrt(dim))
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = F.linear(x, self.in_proj_weight).chunk(3, dim=-1)

        def split(y):
            return y.reshape(b, t, h, d // h).transpose(1, 2)

        out = _causal_attention(split(q), split(k), split(v)).transpose(1, 2).reshape(b, t, d)
        return F.linear(out, self.out_proj.weight, self.out_proj.bias)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, mha_style: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = MHAStyleAttention(dim, heads) if mha_style else Attention(dim, heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """Llama-shaped causal LM; ``forward(ids)`` returns the mean next-token cross-entropy."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, hidden: int = 24,
                 n_layers: int = 2, mha_style: bool = False, tie: bool = False,
                 checkpointing: bool = False, root_proj: bool = False, tie_proj: bool = False,
                 reuse_first: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        # a matrix outside every layers.N block (moved by the model's own hooks, the root group)
        self.in_proj = nn.Linear(dim, dim, bias=False) if root_proj else None
        self.layers = nn.ModuleList(Block(dim, heads, hidden, mha_style) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight
        if tie_proj:  # a dedicated matrix shared by two blocks
            self.layers[-1].mlp.up_proj.weight = self.layers[0].mlp.up_proj.weight
        self.checkpointing = checkpointing
        self.reuse_first = reuse_first  # layers.0 runs twice per forward (ALBERT-style sharing)

    def forward(self, ids):
        x = self.embed_tokens(ids[:, :-1])
        if self.in_proj is not None:
            x = x + self.in_proj(x)
        for layer in [self.layers[0], *self.layers] if self.reuse_first else self.layers:
            if self.checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    layer, x, use_reentrant=self.checkpointing == "reentrant")
            else:
                x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def make_model(seed: int = 0, dtype: torch.dtype = torch.float64, **kwargs) -> TinyLlama:
    """A deterministic ``TinyLlama`` (same weights for the same seed on every process)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = TinyLlama(**kwargs).to(torch.float64)
    with torch.no_grad():  # non-trivial norms so their gradients matter
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    torch.random.set_rng_state(gen_state)
    return model.to(dtype)  # same values (rounded) whatever the dtype


def make_batches(steps: int, batch: int, seq: int = 9, vocab: int = 32, seed: int = 1) -> list[torch.Tensor]:
    """``steps`` global batches of token ids, shape (batch, seq)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def muon_predicate(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and "proj" in name


# ---------------------------------------------------------------------------------------------
# Mixture of experts with per-expert 2-D Linear experts (an expert that gets no token on a rank
# has no gradient there), and models with other forward outputs and module names.

def expert_routes(ids: torch.Tensor, n_experts: int, top_k: int) -> torch.Tensor:
    """Token-id routing, ``(..., top_k)``: expert ``id % E`` first, ``(7 id + 3) % E`` second. The
    router still weighs each choice (so it trains); the choice itself is fixed by the data, so
    tests control which expert gets which token on which rank."""
    choice = [ids % n_experts, (7 * ids + 3) % n_experts][:top_k]
    return torch.stack(choice, dim=-1)


class MoE(nn.Module):
    """``experts.E.{gate,up,down}_proj`` (dedicated) behind a ``router`` (AdamW)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, bias: bool = False):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(dim, hidden, bias) for _ in range(n_experts))

    def forward(self, x, ids):
        gates = self.router(x).softmax(-1)
        routes = expert_routes(ids, len(self.experts), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = (routes == e).any(-1)
            if not bool(sel.any()):  # no token here: this expert's weights get no gradient
                continue
            w = (gates[..., e] * (routes == e).sum(-1))[sel]
            out = out.index_put((sel,), out[sel] + w[:, None] * expert(x[sel]))
        return out


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, n_experts: int, top_k: int,
                 bias: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = Attention(dim, heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.moe = MoE(dim, hidden, n_experts, top_k, bias)

    def forward(self, x, ids):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.moe(self.post_attention_layernorm(x), ids)


class TinyMoE(nn.Module):
    """A dense first block, then MoE blocks; ``forward(ids)`` returns the mean next-token loss.
    ``expert_bias``: the experts' ``down_proj`` get biases (AdamW params that FSDP2 manages, with a
    gradient only on ranks that routed a token to the expert)."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, hidden: int = 12,
                 n_layers: int = 3, n_experts: int = 4, top_k: int = 1, expert_bias: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [Block(dim, heads, hidden)]
            + [MoEBlock(dim, heads, hidden, n_experts, top_k, expert_bias)
               for _ in range(n_layers - 1)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        inp = ids[:, :-1]
        x = self.embed_tokens(inp)
        for layer in self.layers:
            x = layer(x, inp) if isinstance(layer, MoEBlock) else layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class LossObject:
    """A plain object carrying the loss (no pytree node, no dataclass)."""

    def __init__(self, loss, logits):
        self.loss = loss
        self.logits = logits


class StackLM(nn.Module):
    """Blocks under ``stack.N`` (no ``layers.N`` / ``blocks.N``: dmuon's default boundary puts every
    matrix in the root group); ``forward(ids)`` returns the loss inside ``output`` form: ``"tensor"``,
    ``"tuple"``, ``"dict"``, ``"dataclass"``, ``"model_output"`` (HF ``ModelOutput``), ``"object"``."""

    def __init__(self, output: str = "tensor", vocab: int = 32, dim: int = 16, heads: int = 2,
                 hidden: int = 24, n_layers: int = 2):
        super().__init__()
        self.output = output
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.stack = nn.ModuleList(Block(dim, heads, hidden) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids[:, :-1])
        for block in self.stack:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        return wrap_loss(self.output, loss, logits)


def wrap_loss(output: str, loss, logits):
    """``loss`` (and ``logits``) in one of the output forms of :class:`StackLM`."""
    import dataclasses
    if output == "tensor":
        return loss
    if output == "tuple":
        return (loss, logits)
    if output == "dict":
        return {"loss": loss, "logits": logits}
    if output == "dataclass":
        cls = dataclasses.make_dataclass("LMOut", [("loss", object), ("logits", object)])
        return cls(loss, logits)
    if output == "model_output":
        from transformers.modeling_outputs import CausalLMOutput
        return CausalLMOutput(loss=loss, logits=logits)
    if output == "object":
        return LossObject(loss, logits)
    raise ValueError(output)


def loss_of(out):
    """The loss inside any :func:`wrap_loss` form (what a user's loop does: ``out.loss``, ...)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    if isinstance(out, dict):
        return out["loss"]
    return out.loss


def make_seeded(cls, seed: int = 0, **kwargs) -> nn.Module:
    """``cls(**kwargs)`` in fp64 with the same weights on every process (norms perturbed, as
    :func:`make_model`)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = cls(**kwargs).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    torch.random.set_rng_state(gen_state)
    return model
