"""Decoder-only transformer shapes (Llama / Qwen2 family) as parameter specs, for planning offline.

A :class:`ModelPreset` holds a model's architecture numbers; :func:`preset_named_shapes` lists its
parameters with Hugging Face names and shapes; :func:`preset_specs` routes the per-layer projections
``q/k/v/o_proj`` and ``gate/up/down_proj`` weights to Muon and everything else (embeddings, ``lm_head``,
norms, biases) to AdamW. :func:`preset_from_hf_config` reads the same numbers from a ``config.json``.

Mixture-of-experts decoders (Mixtral, Qwen2-MoE / Qwen3-MoE) list one matrix per expert
(``mlp.experts.<e>.{gate,up,down}_proj.weight``, the per-expert matrix view of SPEC.md section 3), a
router ``mlp.gate.weight`` (AdamW) and, for Qwen2-MoE, a shared expert.

Numbers of the built-in presets are those of the published Hugging Face configs.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from dmuon.functional.specs import ParamSpec, specs_from_named_shapes

__all__ = ["ModelPreset", "PRESETS", "get_preset", "preset_named_shapes", "preset_specs",
           "preset_from_hf_config", "is_projection_weight"]


@dataclass(frozen=True)
class ModelPreset:
    """Architecture numbers of a Llama-style decoder.

    Attributes:
      name: identifier; hidden: model width; intermediate: MLP width; layers: decoder blocks;
      heads / kv_heads: attention and key-value heads; vocab: vocabulary size;
      head_dim: per-head width (default ``hidden // heads``); tie_embeddings: ``lm_head`` shares the
      embedding; qkv_bias: q/k/v projections have biases (Qwen2); o_bias / mlp_bias: other biases.
      experts: routed experts per layer (0: dense MLP of width ``intermediate``); experts_per_token:
      experts each token uses; moe_intermediate: expert MLP width (default ``intermediate``);
      shared_intermediate: width of a shared expert (Qwen2-MoE; 0: none).
    """

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: Optional[int] = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: Optional[int] = None
    shared_intermediate: int = 0

    def __post_init__(self) -> None:
        if self.experts and not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(f"ModelPreset {self.name!r}: experts_per_token must be in [1, experts]")
        if self.experts and self.moe_intermediate is None:
            object.__setattr__(self, "moe_intermediate", self.intermediate)
        for f in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelPreset {self.name!r}: {f} must be a positive int, got {v!r}")
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(f"ModelPreset {self.name!r}: hidden {self.hidden} is not divisible by "
                                 f"heads {self.heads}; give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)


PRESETS: dict[str, ModelPreset] = {p.name: p for p in (
    ModelPreset("llama-3.2-1b", hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
                vocab=128256, head_dim=64, tie_embeddings=True),
    ModelPreset("llama-3.2-3b", hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8,
                vocab=128256, head_dim=128, tie_embeddings=True),
    ModelPreset("llama-3.1-8b", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                vocab=128256, head_dim=128),
    ModelPreset("llama-3.1-70b", hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8,
                vocab=128256, head_dim=128),
    ModelPreset("qwen2.5-7b", hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4,
                vocab=152064, head_dim=128, qkv_bias=True),
    ModelPreset("qwen2.5-1.5b", hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2,
                vocab=151936, head_dim=128, tie_embeddings=True, qkv_bias=True),
    ModelPreset("llama-3.1-405b", hidden=16384, intermediate=53248, layers=126, heads=128,
                kv_heads=8, vocab=128256, head_dim=128),
    ModelPreset("mixtral-8x7b", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                vocab=32000, head_dim=128, experts=8, experts_per_token=2),
)}


def get_preset(name: str) -> ModelPreset:
    """The built-in preset ``name`` (case-insensitive); raises ``KeyError`` listing the choices."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} "
                       "or pass a Hugging Face config.json") from None


def preset_named_shapes(p: ModelPreset, dtype: str = "torch.bfloat16") -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of every parameter, with Hugging Face ``LlamaForCausalLM`` names."""
    h, i, d = p.hidden, p.intermediate, p.head_dim
    q, kv = p.heads * d, p.kv_heads * d
    out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (p.vocab, h), dtype)]
    for n in range(p.layers):
        pre = f"model.layers.{n}"
        att, mlp = f"{pre}.self_attn", f"{pre}.mlp"
        out += [(f"{att}.q_proj.weight", (q, h), dtype), (f"{att}.k_proj.weight", (kv, h), dtype),
                (f"{att}.v_proj.weight", (kv, h), dtype), (f"{att}.o_proj.weight", (h, q), dtype)]
        if p.qkv_bias:
            out += [(f"{att}.q_proj.bias", (q,), dtype), (f"{att}.k_proj.bias", (kv,), dtype),
                    (f"{att}.v_proj.bias", (kv,), dtype)]
        if p.o_bias:
            out.append((f"{att}.o_proj.bias", (h,), dtype))
        if p.experts:
            out += _moe_shapes(p, mlp, dtype)
        else:
            out += _mlp_shapes(mlp, h, i, dtype)
        if p.mlp_bias and not p.experts:
            out += [(f"{mlp}.gate_proj.bias", (i,), dtype), (f"{mlp}.up_proj.bias", (i,), dtype),
                    (f"{mlp}.down_proj.bias", (h,), dtype)]
        out += [(f"{pre}.input_layernorm.weight", (h,), dtype),
                (f"{pre}.post_attention_layernorm.weight", (h,), dtype)]
    out.append(("model.norm.weight", (h,), dtype))
    if not p.tie_embeddings:
        out.append(("lm_head.weight", (p.vocab, h), dtype))
    return out


def _mlp_shapes(prefix: str, h: int, i: int, dtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    return [(f"{prefix}.gate_proj.weight", (i, h), dtype), (f"{prefix}.up_proj.weight", (i, h), dtype),
            (f"{prefix}.down_proj.weight", (h, i), dtype)]


def _moe_shapes(p: ModelPreset, mlp: str, dtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    out = [(f"{mlp}.gate.weight", (p.experts, p.hidden), dtype)]
    for e in range(p.experts):
        out += _mlp_shapes(f"{mlp}.experts.{e}", p.hidden, p.moe_intermediate, dtype)
    if p.shared_intermediate:
        out += _mlp_shapes(f"{mlp}.shared_expert", p.hidden, p.shared_intermediate, dtype)
        out.append((f"{mlp}.shared_expert_gate.weight", (1, p.hidden), dtype))
    return out


def is_projection_weight(name: str, p: Any) -> bool:
    """Muon predicate of the presets: 2-D ``*_proj.weight`` (attention and MLP projections)."""
    return name.endswith("_proj.weight") and len(tuple(p.shape)) == 2


def preset_specs(p: Union[ModelPreset, str], dtype: str = "torch.bfloat16") -> tuple[ParamSpec, ...]:
    """Specs of a preset (or preset name): projections -> Muon, the rest -> AdamW."""
    preset = get_preset(p) if isinstance(p, str) else p
    return specs_from_named_shapes(preset_named_shapes(preset, dtype), is_projection_weight)


def preset_from_hf_config(config: Union[str, os.PathLike, Mapping[str, Any]],
                          name: Optional[str] = None) -> ModelPreset:
    """Read a Hugging Face ``config.json`` (its path, the model folder holding it, or the parsed
    dict) of a Llama-style decoder.

    Uses ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads`` (default: heads), ``vocab_size``, ``head_dim`` (default hidden/heads),
    ``tie_word_embeddings`` (default False), ``attention_bias`` / ``mlp_bias``; Qwen2 (``model_type``
    ``"qwen2"``) has q/k/v biases. A multimodal config's ``text_config`` is used when present.
    MoE: ``num_local_experts`` (Mixtral; experts of width ``intermediate_size``) or ``num_experts``
    with ``moe_intermediate_size`` and ``shared_expert_intermediate_size`` (Qwen2/3-MoE), and
    ``num_experts_per_tok``.

    Raises:
      ValueError: naming the missing key when the config is not a decoder config, or for MoE
        layouts this reader does not model (dense layers between sparse ones, DeepSeek's MLA).
    """
    if isinstance(config, (str, os.PathLike)):
        if os.path.isdir(config):  # a model folder, as `dmuon plan --config` takes
            config = os.path.join(config, "config.json")
        with open(config, encoding="utf-8") as f:
            cfg: Mapping[str, Any] = json.load(f)
        name = name or os.path.basename(os.path.dirname(os.path.abspath(config))) or "config"
    else:
        cfg = config
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get(
            "tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings", False))}
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"config lacks {missing}; expected a Llama/Qwen-style decoder config.json")
    model_type = str(cfg.get("model_type", ""))
    attention_bias = bool(cfg.get("attention_bias", False))
    if any(k in cfg for k in ("kv_lora_rank", "n_routed_experts", "first_k_dense_replace")):
        raise ValueError("config has DeepSeek-style MLA / routed experts, which this reader does not "
                         "model; describe the model with ModelPreset or specs directly")
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if experts and (int(cfg.get("decoder_sparse_step", 1) or 1) != 1 or cfg.get("mlp_only_layers")):
        raise ValueError("MoE config mixes dense and sparse layers (decoder_sparse_step / "
                         "mlp_only_layers), which this reader does not model")
    moe = dict(experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
               moe_intermediate=(int(cfg["moe_intermediate_size"]) if experts and
                                 cfg.get("moe_intermediate_size") else None),
               shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0)
               if experts else 0)
    return ModelPreset(
        name=name or model_type or "config",
        hidden=int(cfg["hidden_size"]), intermediate=int(cfg["intermediate_size"]),
        layers=int(cfg["num_hidden_layers"]), heads=int(cfg["num_attention_heads"]),
        kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        vocab=int(cfg["vocab_size"]), head_dim=(int(cfg["head_dim"]) if cfg.get("head_dim") else None),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or model_type.startswith("qwen2"),
        o_bias=attention_bias, mlp_bias=bool(cfg.get("mlp_bias", False)), **moe)
