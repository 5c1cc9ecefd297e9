"""Training flop counts of a decoder preset (the compute side of the step projection).

Per token of a sequence of length ``T`` (matmul flops, 2 per multiply-add; element-wise work and
the embedding lookup are not counted), for each layer::

    attention projections  2 (h q + 2 h kv + q h)          q = heads * head_dim, kv = kv_heads * head_dim
    attention scores       2 * 2 * T * q / 2               Q K^T and A V, causal: half the pairs
    MLP                    2 * 3 h I                        dense
                           2 * (k * 3 h I_e + 3 h I_s + h E) MoE: k experts of width I_e, shared
                                                            expert I_s, router E x h

plus the output head ``2 h V``. The backward costs twice the forward (two products per forward
product: input and weight gradients); no activation recomputation.

References: D. Narayanan et al., "Efficient large-scale language model training on GPU clusters
using Megatron-LM" (SC 2021), appendix (flops per iteration); J. Kaplan et al., "Scaling laws for
neural language models" (2020), section 2.1.
"""
from __future__ import annotations

from dmuon.tools.presets import ModelPreset

__all__ = ["layer_forward_flops", "head_forward_flops", "forward_flops", "active_params"]


def _check(seq: int, tokens: int) -> None:
    if seq < 1 or tokens < 0:
        raise ValueError(f"seq must be >= 1 and tokens >= 0, got seq={seq}, tokens={tokens}")


def layer_forward_flops(p: ModelPreset, seq: int, tokens: int) -> int:
    """Forward flops of one decoder layer over ``tokens`` tokens in sequences of ``seq``."""
    _check(seq, tokens)
    h, d = p.hidden, p.head_dim
    q, kv = p.heads * d, p.kv_heads * d
    proj = 2 * (h * q + 2 * h * kv + q * h)
    attn = 2 * seq * q                      # 2 * 2 * seq * q / 2 (causal)
    if p.experts:
        mlp = 2 * (p.experts_per_token * 3 * h * p.moe_intermediate + 3 * h * p.shared_intermediate
                   + h * p.experts)
    else:
        mlp = 2 * 3 * h * p.intermediate
    return tokens * (proj + attn + mlp)


def head_forward_flops(p: ModelPreset, tokens: int) -> int:
    """Forward flops of the output head (``lm_head``, tied or not) over ``tokens`` tokens."""
    _check(1, tokens)
    return tokens * 2 * p.hidden * p.vocab


def forward_flops(p: ModelPreset, seq: int, tokens: int) -> int:
    """Forward flops of the whole model (all layers and the head); the backward is twice this."""
    return p.layers * layer_forward_flops(p, seq, tokens) + head_forward_flops(p, tokens)


def active_params(p: ModelPreset) -> int:
    """Matmul parameters one token uses (projections, active experts, router, head)."""
    return forward_flops(p, 1, 1) // 2 - p.layers * p.heads * p.head_dim
