"""``dedicate_params``' use of the per-param policy: routing predicate, matrix views, fingerprint.

The decisions are :class:`dmuon.functional.policy.ParamPolicy`'s (pure); this module only looks up
the module that owns each param (:func:`dmuon.functional.policy.module_kind`) and folds the policy's
rules into the fingerprint every rank compares.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Optional

import torch.nn as nn

from dmuon.functional.policy import Decision, ParamPolicy, module_kind

__all__ = ["as_policy", "routing_predicate", "decide_params", "dtype_overrides",
           "policy_fingerprint"]


def as_policy(policy: Optional[ParamPolicy]) -> ParamPolicy:
    """``policy`` itself, or the empty policy for ``None`` (``TypeError`` for anything else)."""
    if policy is None:
        return ParamPolicy()
    if not isinstance(policy, ParamPolicy):
        raise TypeError(f"dedicate_params: policy must be a dmuon.functional.policy.ParamPolicy or "
                        f"None, got {type(policy).__name__}")
    return policy


def routing_predicate(policy: ParamPolicy, predicate: Any) -> Any:
    """The predicate ``dedicate_params`` selects with: the user's, overridden by the first
    matching rule that sets a route (the user's object itself when no rule sets one)."""
    if not callable(predicate) or not any(r.route is not None for r in policy.rules):
        return predicate

    def routed(name: str, p: Any) -> bool:
        _, r = policy.rule_for(name)
        if r is not None and r.route is not None:
            return r.route == "muon"
        return bool(predicate(name, p))
    return routed


def decide_params(model: nn.Module, chosen: dict[str, nn.Parameter], policy: ParamPolicy,
                  batch_dims: Optional[Callable[[str, tuple[int, ...]], int]]) -> dict[str, Decision]:
    """The policy's :class:`Decision` (route ``"muon"``, view, source) for every chosen param."""
    for n, p in model.named_parameters():  # AdamW params: rules may not set multipliers
        if p.requires_grad and n not in chosen:
            policy.decide(n, tuple(p.shape), predicate_says_muon=False)
    out = {}
    for n, p in chosen.items():
        owner = model.get_submodule(n.rsplit(".", 1)[0]) if "." in n else model
        out[n] = policy.decide(n, tuple(p.shape), predicate_says_muon=True,
                               kind=module_kind(owner), batch_dims=batch_dims, dtype=p.dtype)
    return out


def dtype_overrides(decisions: dict[str, Decision], field: str) -> dict[str, Any]:
    """``{name: dtype}`` of the params whose rule sets ``field`` (``"param_dtype"``,
    ``"reduce_dtype"`` or ``"master_dtype"``); the others follow the group's / default rule."""
    return {n: getattr(d, field) for n, d in decisions.items() if getattr(d, field) is not None}


def policy_fingerprint(plan_fingerprint: str, policy: ParamPolicy) -> str:
    """The plan's fingerprint, extended by the policy's rules when it has any (unchanged
    otherwise, so plans without a policy keep their fingerprints)."""
    if not policy.rules:
        return plan_fingerprint
    blob = json.dumps([plan_fingerprint, policy.canonical()], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
