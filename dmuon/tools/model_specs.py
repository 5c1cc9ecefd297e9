"""Specs of a real module tree with the routes and matrix views ``dedicate_params`` would choose.

:func:`specs_from_model` applies a predicate and a :class:`~dmuon.functional.policy.ParamPolicy`
(with its module-aware default views) to ``model.named_parameters()``; it needs no values, so a
model built on the meta device serves. :func:`meta_model_from_hf` builds any ``transformers``
causal LM (fused MoE experts, DeepSeek-V3's MLA with shared + routed experts and dense first
layers, GPT-2's ``Conv1D``, ...) on the meta device from a ``config.json`` or a model folder; this
is what ``python -m dmuon plan --config`` plans when ``transformers`` is installed.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Union

from dmuon.functional.module_routes import route_with_modules
from dmuon.functional.policy import Decision, ParamPolicy, module_kind
from dmuon.functional.specs import ParamSpec, default_muon_predicate, layer_key_from_name

__all__ = ["specs_from_model", "meta_model_from_hf"]


def specs_from_model(model: Any, predicate: Optional[Callable[[str, Any], bool]] = None, *,
                     policy: Optional[ParamPolicy] = None,
                     batch_dims: Optional[Callable[[str, tuple[int, ...]], int]] = None,
                     dtype: Optional[str] = None) -> tuple[tuple[ParamSpec, ...], dict[str, Decision]]:
    """``(specs, decisions)`` for the trainable params of ``model`` (``dedicate_params``' rules:
    the policy's first matching rule, then ``predicate`` (default
    :func:`~dmuon.functional.specs.default_muon_predicate`) for the route; then the rule's view,
    ``batch_dims``, :func:`~dmuon.functional.policy.default_view`).

    Args:
      model: an ``nn.Module`` (meta tensors are fine).
      predicate, policy, batch_dims: as ``dedicate_params``'.
      dtype: the dtype to plan with (``str``, e.g. ``"torch.bfloat16"``); default each param's own.

    Raises:
      ValueError: a Muon param without a fitting view (the message names it and the rules).
    """
    pred = route_with_modules(model, default_muon_predicate if predicate is None else predicate)
    pol = ParamPolicy() if policy is None else policy
    specs, decisions = [], {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        owner = model.get_submodule(n.rsplit(".", 1)[0]) if "." in n else model
        d = pol.decide(n, tuple(p.shape), predicate_says_muon=bool(pred(n, p)),
                       kind=module_kind(owner), batch_dims=batch_dims)
        decisions[n] = d
        specs.append(ParamSpec(name=n, shape=tuple(p.shape), dtype=dtype or str(p.dtype),
                               layer_key=layer_key_from_name(n), route=d.route, view=d.view))
    return tuple(specs), decisions


def meta_model_from_hf(config: Union[str, os.PathLike, Mapping[str, Any]]) -> Any:
    """A ``transformers`` ``AutoModelForCausalLM`` with ``config`` (a ``config.json`` path, a model
    folder holding one, or a parsed dict), on the meta device (no memory, no weights read).

    Raises:
      ImportError: ``transformers`` is not installed.
      ValueError: the config names no causal-LM architecture ``transformers`` knows.
    """
    import json

    import torch
    import transformers

    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            cfg_dict = json.load(f)
    else:
        cfg_dict = dict(config)
    model_type = cfg_dict.get("model_type")
    if not model_type:
        raise ValueError("the config has no model_type; expected a Hugging Face config.json")
    cfg = transformers.AutoConfig.for_model(**cfg_dict)
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError as e:
            raise ValueError(f"transformers cannot build a causal LM of model_type "
                             f"{model_type!r}: {e}") from None
