"""QK-clip (MuonClip): cap each attention head's max logit by rescaling W_q / W_k (pure).

Kimi K2 (Moonshot AI, "Kimi K2: Open Agentic Intelligence", 2025) bounds attention logits after each
optimizer step. For head ``h`` with the step's max pre-softmax logit
``S_h = max_{b, i, j} q_{b,h,i} · k_{b,g(h),j} / sqrt(d)`` (over the batch; causal positions only),
``γ_h = min(1, τ / S_h)``. With a k head ``g`` shared by the query heads ``G(g)`` (grouped-query
attention), ``γ_g = min_{h ∈ G(g)} γ_h`` and::

    W_k[g] ← γ_g^(1−α) · W_k[g]          W_q[h] ← (γ_h / γ_g^(1−α)) · W_q[h]

so every head's logits scale by exactly ``γ_h`` (its max becomes ``min(S_h, τ)`` for a linear
q = x·W_qᵀ, k = x·W_kᵀ; RoPE rotates q and k per position and leaves the product's scale alone).
With one query head per k head (MHA) this is Kimi K2's ``W_q ← γ^α W_q``, ``W_k ← γ^(1−α) W_k``
(``α = 0.5``: ``sqrt(γ)`` each). Defaults: ``τ = 100``, ``α = 0.5`` (Kimi K2). Biases of q / k,
when present, scale with their rows.
"""
from __future__ import annotations

import math
from typing import Collection, Mapping, NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["QKClipConfig", "max_logits", "clip_factors", "scale_head_rows", "apply_qk_clip",
           "check_layers", "pack_max_logits", "unpack_max_logits", "weight_factors"]


class QKClipConfig(NamedTuple):
    """``tau``: the logit cap τ (> 0); ``alpha``: the share α ∈ [0, 1] of the rescale put on W_q."""

    tau: float = 100.0
    alpha: float = 0.5

    def validate(self) -> None:
        if not (isinstance(self.tau, (int, float)) and math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"QK-clip tau must be a finite float > 0, got {self.tau!r}")
        if not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise ValueError(f"QK-clip alpha must be in [0, 1], got {self.alpha!r}")


def max_logits(q: Tensor, k: Tensor, *, causal: bool = True,
               scale: Optional[float] = None) -> Tensor:
    """Per query head, the max attention logit ``max q·kᵀ·scale`` over batch and positions.

    Args:
      q: ``(B, H_q, T, d)``; k: ``(B, H_kv, S, d)`` with ``H_q`` a multiple of ``H_kv`` (query head
        ``h`` reads k head ``h // (H_q / H_kv)``).
      causal: only ``j <= i`` (with ``S == T``).
      scale: default ``1 / sqrt(d)``.

    Returns:
      ``(H_q,)`` in q's dtype (detached).
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of key heads {hkv}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    with torch.no_grad():
        kk = k.repeat_interleave(hq // hkv, dim=1)
        logits = (q @ kk.transpose(-1, -2)) * scale
        if causal:
            mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=q.device).triu(1)
            logits = logits.masked_fill(mask, float("-inf"))
        return logits.amax(dim=(0, 2, 3))


def clip_factors(max_logit: Tensor, num_kv_heads: int, config: QKClipConfig = QKClipConfig()
                 ) -> tuple[Tensor, Tensor]:
    """``(q_factors (H_q,), k_factors (H_kv,))`` of the module docstring's rescale.

    Raises:
      ValueError: invalid config, or ``H_q`` not a multiple of ``num_kv_heads``.
    """
    config.validate()
    hq = max_logit.numel()
    if num_kv_heads < 1 or hq % num_kv_heads:
        raise ValueError(f"{hq} query heads are not a multiple of {num_kv_heads} key heads")
    s = max_logit.detach().to(torch.float64).reshape(hq)
    gamma = torch.where(s > config.tau, config.tau / s, torch.ones_like(s))
    gamma_g = gamma.reshape(num_kv_heads, hq // num_kv_heads).amin(dim=1)
    k_f = gamma_g ** (1.0 - config.alpha)
    q_f = gamma / k_f.repeat_interleave(hq // num_kv_heads)
    return q_f, k_f


def scale_head_rows(w: Tensor, factors: Tensor) -> Tensor:
    """``w`` (dim 0 = heads x head_dim) with head ``h``'s rows times ``factors[h]`` (a new tensor)."""
    heads = factors.numel()
    rows = w.shape[0]
    if rows % heads:
        raise ValueError(f"weight of {rows} rows does not divide into {heads} heads")
    f = factors.to(dtype=w.dtype, device=w.device).repeat_interleave(rows // heads)
    return w * f.reshape((rows,) + (1,) * (w.ndim - 1))


def apply_qk_clip(w_q: Tensor, w_k: Tensor, q_factors: Tensor, k_factors: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """New ``(W_q, W_k)`` (or their biases: any tensor whose dim 0 is heads x head_dim) with head
    ``h``'s rows of W_q times ``q_factors[h]`` and k head ``g``'s rows of W_k times
    ``k_factors[g]``; inputs are not modified."""
    return scale_head_rows(w_q, q_factors), scale_head_rows(w_k, k_factors)


# ---------------------------------------------------------------------------------------------
# the layers of a model: their max logits packed for one MAX all-reduce over the ranks, the
# factors of their weights

#: ``{layer: (q weight name, k weight name, number of kv heads)}``
Layers = Mapping[str, tuple[str, str, int]]


def check_layers(max_logit: Mapping[str, Tensor], layers: Layers, weights: Collection[str]) -> None:
    """Raise ``ValueError`` if ``max_logit`` and ``layers`` name different layers, or a q / k
    weight is not in ``weights`` (the dedicated params: W_q and W_k must be routed to Muon)."""
    if set(max_logit) != set(layers):
        raise ValueError(f"qk_clip_: max_logit has layers {sorted(max_logit)} but layers has "
                         f"{sorted(layers)}; give both for the same layers")
    for lay, (qn, kn, _) in layers.items():
        for n in (qn, kn):
            if n not in weights:
                raise ValueError(f"qk_clip_: {n!r} (layer {lay!r}) is not a dedicated param; "
                                 "route W_q and W_k to Muon (dedicate them)")


def pack_max_logits(max_logit: Mapping[str, Tensor], device: torch.device) -> Tensor:
    """The layers' max logits (sorted by layer) as one fp64 vector on ``device``, with a
    non-finite flag at the end: under a (NaN-safe) MAX all-reduce one rank's NaN or Inf (even a
    -Inf that other ranks' maxima would hide) is seen on every rank."""
    flat = torch.cat([max_logit[k].detach().reshape(-1).to(torch.float64)
                      for k in sorted(max_logit)]).to(device)
    return torch.cat([flat, (~torch.isfinite(flat)).any().to(flat.dtype).reshape(1)])


def unpack_max_logits(flat: Tensor, max_logit: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``{layer: (H_q,) max logit}`` (CPU) of :func:`pack_max_logits`' vector after the
    all-reduce (``max_logit``: the layers and head counts it was packed from).

    Raises:
      ValueError: the non-finite flag is set (nothing should be rescaled)."""
    if flat[-1].item() > 0:
        raise ValueError(
            "qk_clip_: a max logit is NaN or Inf on some rank (this step's attention overflowed "
            "or its loss is non-finite); nothing was rescaled. Check the loss and inputs "
            "(Muon(check_finite=True) stops the step itself on non-finite gradients).")
    out, at = {}, 0
    for k in sorted(max_logit):
        h = max_logit[k].numel()
        out[k] = flat[at:at + h].cpu()
        at += h
    return out


def weight_factors(max_logit: Mapping[str, Tensor], layers: Layers,
                   config: QKClipConfig = QKClipConfig()) -> dict[str, Tensor]:
    """``{weight name: per-head factors}`` of the q / k weights to rescale (layers sorted, q then
    k; a layer whose heads all stay under ``config.tau`` is left out), from the global
    ``max_logit`` per layer (:func:`clip_factors`)."""
    out = {}
    for k in sorted(layers):
        qn, kn, nkv = layers[k]
        q_f, k_f = clip_factors(max_logit[k], nkv, config)
        if not (bool((q_f == 1).all()) and bool((k_f == 1).all())):
            out[qn], out[kn] = q_f, k_f
    return out
