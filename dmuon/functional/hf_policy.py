"""Per-head and split-fused-matrix rules for Hugging Face decoders, from their config (pure).

:func:`hf_rules` reads a ``transformers`` config (or any object / dict with the same attribute
names) and returns :class:`~dmuon.functional.policy.Rule` s for a
:class:`~dmuon.functional.policy.ParamPolicy`:

* ``per_head=True``: ``q_proj`` rows as ``num_attention_heads`` heads, ``k_proj`` / ``v_proj`` rows
  as ``num_key_value_heads`` heads (grouped-query attention: one matrix per k/v head), ``o_proj``
  columns as ``num_attention_heads`` heads (Kimi-style per-head Muon).
* ``split_fused=True``: Phi-3's ``qkv_proj`` rows as ``q | k | v`` (``H_q·d``, ``H_kv·d``,
  ``H_kv·d``), a 2-D ``gate_up_proj`` rows as ``gate | up`` (two halves), transformers 5's fused
  MoE ``experts.gate_up_proj`` ``(E, 2I, H)`` as ``gate | up`` per expert (``2E`` matrices; ``I``
  = ``moe_intermediate_size``, else ``intermediate_size``; an experts module storing them
  interleaved or transposed, as gpt-oss, raises), and GPT-2's ``c_attn``
  (``Conv1D``, stored ``(in, out)``) as ``Transposed(Split((H, H, H)))`` (GLM-style "Muon Split").

Example::

    policy = ParamPolicy(rules=hf_rules(model.config, per_head=True, split_fused=True))
    dmuon.dedicate_params(model, mesh, default_muon_predicate, policy=policy)
"""
from __future__ import annotations

from typing import Any

from dmuon.functional.matrix_view import Heads, Split, Transposed
from dmuon.functional.policy import Rule

__all__ = ["hf_rules"]


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def hf_rules(config: Any, *, per_head: bool = False, split_fused: bool = True) -> tuple[Rule, ...]:
    """Rules for the attention / MLP matrices of a decoder with ``config`` (module docstring).

    Args:
      config: a ``transformers.PretrainedConfig`` (or a dict of its fields).
      per_head: per-head views of q / k / v (rows) and o (columns).
      split_fused: split fused ``qkv_proj`` / ``gate_up_proj`` / GPT-2 ``c_attn`` into parts.

    Returns:
      the rules, most specific first (a ``ParamPolicy`` takes the first match); ``optional``
      (a model without fused projections has nothing for the split rules to match).

    Raises:
      ValueError: the config lacks the head counts or the sizes do not divide.
    """
    hidden = _get(config, "hidden_size", "n_embd", "d_model")
    nh = _get(config, "num_attention_heads", "n_head")
    if hidden is None or nh is None:
        raise ValueError("hf_rules: the config needs hidden_size (n_embd) and num_attention_heads "
                         "(n_head)")
    nkv = _get(config, "num_key_value_heads", default=nh)
    d = _get(config, "head_dim", default=None) or hidden // nh
    rules: list[Rule] = []
    if split_fused:
        rules.append(Rule("*.qkv_proj.weight", view=Split((nh * d, nkv * d, nkv * d)),
                          optional=True))
        inter = _get(config, "intermediate_size")
        if inter is not None:
            rules.append(Rule("*.mlp.gate_up_proj.weight", view=Split((inter, inter)),
                              optional=True))
        # transformers 5's fused MoE experts: (E, 2I, H) rows gate | up per expert (a layout a
        # row split would cut wrongly, e.g. gpt-oss's interleaved (E, H, 2I), raises at decide)
        moe = _get(config, "moe_intermediate_size", "intermediate_size")
        if moe is not None:
            rules.append(Rule("*.experts.gate_up_proj", view=Split((moe, moe)), optional=True))
        rules.append(Rule("*.attn.c_attn.weight", view=Transposed(Split((hidden,) * 3)),
                          optional=True))
    if per_head:
        rules += [Rule("*.self_attn.q_proj.weight", view=Heads(nh, "rows"), optional=True),
                  Rule("*.self_attn.k_proj.weight", view=Heads(nkv, "rows"), optional=True),
                  Rule("*.self_attn.v_proj.weight", view=Heads(nkv, "rows"), optional=True),
                  Rule("*.self_attn.o_proj.weight", view=Heads(nh, "cols"), optional=True)]
    return tuple(rules)
