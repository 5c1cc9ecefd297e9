"""What ``dmuon plan`` shows of the matrix views: specs of a Hugging Face config or model folder
(through a meta-device model, with ``dedicate_params``' default policy) and a per-view summary."""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from dmuon.functional.matrix_view import Batch
from dmuon.functional.specs import ParamSpec

__all__ = ["hf_config_specs", "views_summary"]


def views_summary(specs: Sequence[ParamSpec]) -> dict[str, dict[str, int]]:
    """``{rule: {"params": count, "matrices": NS matrices}}`` over the Muon specs; the rule is
    ``"matrix"`` for plain 2-D weights, ``"flatten"`` for >=3-D ``Batch(0)``, else ``str(view)``'s
    rule with its arguments (``"batch(1)"``, ``"heads(32,rows)"``, ...)."""
    out: dict[str, dict[str, int]] = {}
    for s in specs:
        if s.route != "muon":
            continue
        v = s.matrix_view
        key = str(v)
        if v == Batch(0):
            key = "matrix" if len(s.shape) == 2 else "flatten"
        e = out.setdefault(key, {"params": 0, "matrices": 0})
        e["params"] += 1
        e["matrices"] += v.matrices(s.shape)
    return dict(sorted(out.items()))


def hf_config_specs(config: str, *, dtype: str, per_head: bool = False, split_fused: bool = False
                    ) -> Optional[tuple[tuple[ParamSpec, ...], Any, str]]:
    """``(specs, policy, title)`` of the causal LM ``config`` describes (a ``config.json`` or a
    model folder), built on the meta device; ``None`` when ``transformers`` is not installed or
    the config names no ``model_type`` (the Llama-style reader of :mod:`presets` plans those).
    Routes: :func:`~dmuon.functional.specs.default_muon_predicate`; views: the default policy
    plus :func:`~dmuon.functional.hf_policy.hf_rules` when ``per_head`` / ``split_fused``."""
    import json

    path = os.path.join(config, "config.json") if os.path.isdir(config) else config
    with open(path, encoding="utf-8") as f:
        if not json.load(f).get("model_type"):
            return None  # a bare Llama-style config: the preset reader plans it
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from dmuon.functional.hf_policy import hf_rules
    from dmuon.tools.model_specs import meta_model_from_hf, specs_from_model
    from dmuon.functional.policy import ParamPolicy

    model = meta_model_from_hf(config)
    policy = None
    if per_head or split_fused:
        policy = ParamPolicy(rules=hf_rules(model.config, per_head=per_head,
                                            split_fused=split_fused))
    specs, _ = specs_from_model(model, policy=policy, dtype=dtype)
    name = os.path.basename(os.path.dirname(os.path.abspath(config))) if not os.path.isdir(config) \
        else os.path.basename(os.path.abspath(config))
    c = model.config
    n_muon = sum(1 for s in specs if s.route == "muon")
    title = (f"model {name or c.model_type} ({c.model_type}, {type(model).__name__} on meta): "
             f"{len(specs)} params, {n_muon} to Muon, "
             f"{sum(s.numel for s in specs) / 1e9:.2f}B elements, dtype {dtype}")
    return tuple(specs), policy, title
