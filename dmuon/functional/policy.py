"""The per-parameter policy: route (Muon / AdamW) and matrix view of every parameter (pure).

:class:`ParamPolicy` is one ordered tuple of :class:`Rule` s, each matching parameter names by an
``fnmatch`` glob. For each trainable parameter, the **first** rule whose pattern matches decides
what it sets; what it leaves ``None`` falls through to the defaults below:

* **route** — the rule's ``route`` (``"muon"`` / ``"adamw"``), else the ``predicate`` given to
  ``dedicate_params`` (the seeds' routing argument).
* **lr_mult / wd_mult** — the rule's multipliers of Muon's ``lr`` / ``weight_decay`` (else 1).
* **view** — the rule's ``view`` (:mod:`dmuon.functional.matrix_view`), else ``batch_dims(name,
  shape) = k > 0`` given to ``dedicate_params`` (``Batch(k)``), else :func:`default_view`.
* **param_dtype / reduce_dtype / master_dtype** (Muon params only) — see :class:`Rule`: the rule's
  value, else the hook group's ``MixedPrecisionPolicy`` (``dedicate_params(mp_policy=)``, else the
  policy of the innermost ``fully_shard`` module holding the param), else the param's own dtype
  (gathered copy), the gathered copy's
  dtype (reduce), the wider of the param's dtype and fp32 (master).

:func:`default_view` (module-aware, shown per param by ``dmuon plan`` and ``describe``):

* 2-D weight of a GPT-2-style ``Conv1D`` (stores ``(in, out)``) → ``Transposed(Batch(0))``;
* any other 2-D weight → ``Batch(0)`` (the matrix itself);
* 3-D param of an MoE experts module (a class named ``*Experts``, as Hugging Face's fused
  ``Qwen3MoeExperts`` / ``MixtralExperts`` / ``OlmoeExperts`` / ``DeepseekV3Experts``, or a
  module path containing ``experts``) → ``Batch(1)``: one matrix per expert;
* ≥4-D param of a convolution module → ``Batch(0)``: the kernel flattened to ``out x (in·k...)``;
* any other ≥3-D param routed to Muon → ``ValueError`` naming the rules to choose from.

The policy's :meth:`ParamPolicy.canonical` enters the owner plan's fingerprint (so every rank must
pass the same policy) and ``describe`` prints it.

Defaults for Hugging Face decoders (``default_muon_predicate`` + no rules): the decoder's matrices
→ Muon (experts per expert); embeddings, ``lm_head``, norms, biases and routers → AdamW; with the
model, embeddings and likely output heads by their modules too (:mod:`dmuon.functional.module_routes`).
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

import torch

from dmuon.functional.matrix_view import Batch, MatrixView, Split, Transposed, VIEW_RULES, as_view
from dmuon.functional.module_routes import route_with_modules

__all__ = ["Rule", "ParamPolicy", "Decision", "default_view", "module_kind", "MODULE_KINDS",
           "DTYPE_FIELDS", "RULE_DTYPES", "master_dtype_for", "resolve_group_dtypes",
           "resolve_model_dtypes", "as_policy", "routing_predicate", "decide_params",
           "dtype_overrides", "policy_fingerprint"]

#: What :func:`module_kind` reports about the module owning a param.
MODULE_KINDS = ("experts", "experts_interleaved", "experts_transposed", "conv", "conv1d", "other")

_ROUTES = ("muon", "adamw")
#: the per-param dtype fields of a :class:`Rule`
DTYPE_FIELDS = ("param_dtype", "reduce_dtype", "master_dtype")
#: the dtypes they accept (fp8 / complex / integer: no arithmetic or collectives to rely on)
RULE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _covers(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Every ``narrow`` value is a ``wide`` value: the same dtype, or more bits (fp16 and bf16
    do not cover each other: range vs precision)."""
    return wide == narrow or torch.finfo(wide).bits > torch.finfo(narrow).bits


@dataclass(frozen=True)
class Rule:
    """One per-name rule of a :class:`ParamPolicy`.

    Attributes:
      pattern: ``fnmatch`` glob on the full param name, e.g. ``"*.self_attn.q_proj.weight"``.
      route: ``"muon"``, ``"adamw"`` or ``None`` (the predicate decides).
      view: a :class:`~dmuon.functional.matrix_view.MatrixView` (or an int ``k``: ``Batch(k)``) or
        ``None`` (the defaults).
      lr_mult, wd_mult: multipliers of Muon's ``lr`` and ``weight_decay`` for the matched Muon
        params (``W ← W·(1 − lr·m_lr·wd·m_wd) − lr·m_lr·s·U``); ``None``: 1. Not supported on
        AdamW-routed params yet (``dedicate_params`` raises).
      param_dtype: dtype of the matched Muon params' gathered copies (what forward and backward
        compute with; the placeholders show it too), one of :data:`RULE_DTYPES` (fp16 / bf16 /
        fp32 / fp64, as the two fields below). ``None``: the hook group's
        ``MixedPrecisionPolicy.param_dtype`` (``dedicate_params(mp_policy=)``, else the
        innermost ``fully_shard`` module's holding it), else the param's own dtype. dmuon does not
        cast the module's
        inputs: a module whose weight dtype differs from its input's must cast itself (FSDP2's
        ``cast_forward_inputs`` acts at ``fully_shard`` boundaries, not per param).
      reduce_dtype: dtype the gradient is averaged in (the local gradient is cast to it).
        ``None``: the group policy's ``reduce_dtype``, else the param's gathered-copy dtype
        (``param_dtype`` as resolved above, the rule's when it sets one).
      master_dtype: dtype of the owner's master copy and its momentum (Muon's update,
        with the reduced gradient cast to it, runs in it). ``None``: the wider of the param's
        dtype and fp32. It must hold every value of ``param_dtype`` and of the param's own dtype
        (the same dtype or more bits; fp16 and bf16 do not cover each other): a narrower master
        would round every step silently (checked here and at ``dedicate_params``).
        ``model.state_dict()`` / ``get_model_state_dict`` return the param's own dtype;
        optimizer state dicts and checkpoints carry the master when it differs. The dtype fields
        apply to Muon-routed (dedicated) params only: a rule setting one that matches an AdamW
        param raises at ``dedicate_params`` (AdamW params are FSDP2's; use its
        ``MixedPrecisionPolicy``).
      optional: the rule may match no param of the model (``hf_rules``' generic rules); a rule
        that is not optional and matches nothing raises at ``dedicate_params``
        (:mod:`dmuon.functional.routing`).
    """

    pattern: str
    route: Optional[str] = None
    view: Optional[Any] = None
    lr_mult: Optional[float] = None
    wd_mult: Optional[float] = None
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    master_dtype: Optional[torch.dtype] = None
    optional: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"Rule.pattern must be a non-empty glob str, got {self.pattern!r}")
        for f in DTYPE_FIELDS:
            v = getattr(self, f)
            if v is not None and v not in RULE_DTYPES:
                raise ValueError(f"Rule({self.pattern!r}).{f} must be one of "
                                 f"{[str(d) for d in RULE_DTYPES]} or None, got {v!r}")
        if (self.master_dtype is not None and self.param_dtype is not None
                and not _covers(self.master_dtype, self.param_dtype)):
            raise ValueError(f"Rule({self.pattern!r}).master_dtype={self.master_dtype} is narrower "
                             f"than its param_dtype={self.param_dtype}: the master would round "
                             "every update; use a master at least as wide as the gathered copy")
        for f in ("lr_mult", "wd_mult"):
            v = getattr(self, f)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v >= 0):
                raise ValueError(f"Rule({self.pattern!r}).{f} must be a finite float >= 0 or None, "
                                 f"got {v!r}")
            if v is not None:
                object.__setattr__(self, f, float(v))
        if self.route is not None and self.route not in _ROUTES:
            raise ValueError(f"Rule({self.pattern!r}).route must be one of {_ROUTES} or None, "
                             f"got {self.route!r}")
        if self.view is not None:
            object.__setattr__(self, "view", as_view(self.view))
        if self.route == "adamw" and self.view is not None:
            raise ValueError(f"Rule({self.pattern!r}) routes to AdamW but sets a matrix view; views "
                             "apply to Muon params only")
        if self.route == "adamw" and self.dtypes_set():
            raise ValueError(f"Rule({self.pattern!r}) routes to AdamW but sets "
                             f"{', '.join(self.dtypes_set())}; per-param dtypes apply to Muon "
                             "params only (AdamW params follow fully_shard's MixedPrecisionPolicy)")

    def dtypes_set(self) -> tuple[str, ...]:
        """The names of the dtype fields this rule sets."""
        return tuple(f for f in DTYPE_FIELDS if getattr(self, f) is not None)

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)

    def canonical(self) -> list:
        out = [self.pattern, self.route, None if self.view is None else str(self.view),
               self.lr_mult, self.wd_mult]
        if self.dtypes_set():  # rules without dtypes keep their earlier fingerprints
            out += [None if getattr(self, f) is None else str(getattr(self, f))
                    for f in DTYPE_FIELDS]
        return out


@dataclass(frozen=True)
class Decision:
    """What the policy decided for one param: ``route``, ``view`` (``None`` for AdamW),
    ``source`` (which rule: ``"rule 0: <pattern>"``, ``"batch_dims"``, ``"default"``) and the
    matching rule's ``lr_mult`` / ``wd_mult`` (1 when unset) and ``param_dtype`` /
    ``reduce_dtype`` / ``master_dtype`` (``None`` when unset: the group's / default rule)."""

    route: str
    view: Optional[MatrixView]
    source: str
    lr_mult: float = 1.0
    wd_mult: float = 1.0
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    master_dtype: Optional[torch.dtype] = None


def master_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The master dtype of a param: the wider of its dtype and fp32 (fp64 stays fp64)."""
    if dtype.is_floating_point and torch.finfo(dtype).bits > 32:
        return dtype
    return torch.float32


def resolve_group_dtypes(
        group: str, orig_dtype: Mapping[str, torch.dtype], *,
        group_param_dtype: Optional[torch.dtype], group_reduce_dtype: Optional[torch.dtype],
        rule_param_dtype: Mapping[str, torch.dtype], rule_reduce_dtype: Mapping[str, torch.dtype],
) -> tuple[torch.dtype, torch.dtype, dict[str, torch.dtype], dict[str, torch.dtype]]:
    """The gathered-copy and reduce dtypes of one hook group's params (pure).

    Per param ``n`` of ``orig_dtype`` (the group's params and their own dtypes): gathered =
    ``rule_param_dtype[n]``, else ``group_param_dtype`` (the group's ``MixedPrecisionPolicy``),
    else ``orig_dtype[n]``; reduce = ``rule_reduce_dtype[n]``, else ``group_reduce_dtype``, else
    the param's gathered dtype.

    Returns:
      ``(group default gathered, group default reduce, {n: gathered}, {n: reduce})`` (the defaults:
      what a param without rules gets).

    Raises:
      ValueError: with no ``group_param_dtype``, the params without a rule ``param_dtype`` mix
        dtypes (the group has no one default).
    """
    free = [n for n in orig_dtype if n not in rule_param_dtype]
    orig = {orig_dtype[n] for n in (free or orig_dtype)}
    if group_param_dtype is None and len(orig) > 1:
        raise ValueError(
            f"hook group {group!r} mixes param dtypes {sorted(map(str, orig))} with no "
            "MixedPrecisionPolicy.param_dtype; give the params one dtype or pass "
            "mp_policy=MixedPrecisionPolicy(param_dtype=...) to dedicate_params (or set "
            "param_dtype per param with a policy Rule)")
    default_c = group_param_dtype or next(iter(orig))
    gathered = {n: rule_param_dtype.get(n, group_param_dtype or d) for n, d in orig_dtype.items()}
    reduce = {n: rule_reduce_dtype.get(n, group_reduce_dtype or gathered[n]) for n in orig_dtype}
    return default_c, group_reduce_dtype or default_c, gathered, reduce


def resolve_model_dtypes(
        groups: Mapping[str, Sequence[str]], holder: Mapping[str, Hashable],
        own: Mapping[str, Hashable],
        policy: Mapping[Hashable, tuple[Optional[torch.dtype], Optional[torch.dtype]]],
        orig_dtype: Mapping[str, torch.dtype], *, rule_param_dtype: Mapping[str, torch.dtype],
        rule_reduce_dtype: Mapping[str, torch.dtype],
) -> tuple[dict[str, tuple[torch.dtype, torch.dtype]], dict[str, torch.dtype],
           dict[str, torch.dtype]]:
    """Every hook group's and every param's gathered-copy and reduce dtypes (pure): each param
    follows the ``fully_shard`` module that holds it (``holder[name]``; its ``policy``:
    ``(param_dtype, reduce_dtype)``), through :func:`resolve_group_dtypes` once per group and
    holder.

    Args:
      groups: ``{hook-group key: its param names}``.  own: ``{key: the holder of the group's own
        module}``.  orig_dtype, rule_param_dtype, rule_reduce_dtype: as
        :func:`resolve_group_dtypes`'s.

    Returns:
      ``({key: (default gathered, default reduce)}, {name: gathered}, {name: reduce})``: a group's
      defaults are its own module's part's, else its first part's.
    """
    defaults: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    gathered: dict[str, torch.dtype] = {}
    reduce: dict[str, torch.dtype] = {}
    for key, names in groups.items():
        parts: dict[Hashable, list[str]] = {}
        for n in names:
            parts.setdefault(holder[n], []).append(n)
        for h, part in parts.items():
            c, r, cd, rd = resolve_group_dtypes(
                key or "<root>", {n: orig_dtype[n] for n in part}, group_param_dtype=policy[h][0],
                group_reduce_dtype=policy[h][1], rule_param_dtype=rule_param_dtype,
                rule_reduce_dtype=rule_reduce_dtype)
            if h == own[key] or key not in defaults:
                defaults[key] = (c, r)
            gathered.update(cd)
            reduce.update(rd)
    return defaults, gathered, reduce


def module_kind(module: Any) -> str:
    """``"experts"`` / ``"conv"`` / ``"conv1d"`` (GPT-2's ``(in, out)`` layout) / ``"other"`` for
    the module that owns a param (inspects its class only)."""
    import torch.nn as nn

    cls = type(module).__name__
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if cls == "Conv1D":  # transformers.pytorch_utils.Conv1D: weight (in, out), y = x @ W + b
        return "conv1d"
    if cls.endswith("Experts"):
        # transformers 5 marks its fused experts' layout (use_experts_implementation)
        if getattr(module, "is_concatenated", True) is False:
            return "experts_interleaved"  # [gate0, up0, gate1, up1, ...]
        if getattr(module, "is_transposed", False) is True:
            return "experts_transposed"   # (E, in, out)
        return "experts"
    return "other"


def default_view(name: str, shape: Sequence[int], kind: str) -> MatrixView:
    """The default matrix view of a Muon param (module docstring); ``kind`` from
    :func:`module_kind` of its owning module.

    Raises:
      ValueError: a ≥3-D param that is neither an expert stack nor a convolution kernel.
    """
    nd = len(tuple(shape))
    if nd == 2:
        return Transposed(Batch(0)) if kind == "conv1d" else Batch(0)
    if nd == 3 and (kind.startswith("experts") or
                    any("experts" in seg for seg in name.split(".")[:-1])):
        return Batch(1)
    if nd >= 4 and kind == "conv":
        return Batch(0)
    raise ValueError(
        f"param {name!r} of shape {tuple(shape)} is routed to Muon, but dmuon has no default matrix "
        "view for a >=3-D param outside an MoE experts module (3-D: one matrix per expert) or a "
        "convolution (>=4-D: flattened). Choose its view with a rule, e.g. "
        f"dmuon.functional.policy.ParamPolicy(rules=(Rule({name!r}, view=Batch(1)),)) passed as "
        f"dedicate_params(..., policy=...), or batch_dims=; the rules are {', '.join(VIEW_RULES)} "
        "(dmuon.functional.matrix_view). Or route it to AdamW in the predicate.")


def _check_fused_layout(name: str, shape: tuple, view: MatrixView, source: str, kind: str) -> None:
    """A ``Split`` view (also inside ``Transposed``) of an experts stack whose module stores its
    fused matrices interleaved or transposed would cut them into wrong parts: raise."""
    inner = view.inner if isinstance(view, Transposed) else view
    if not isinstance(inner, Split) or len(shape) < 3 or kind == "experts":
        return
    how = {"experts_interleaved": "interleaved ([gate0, up0, gate1, up1, ...]: transformers' "
                                  "is_concatenated=False)",
           "experts_transposed": "transposed ((E, in, out): transformers' is_transposed=True)"}
    if kind in how:
        raise ValueError(
            f"param {name!r} of shape {shape}: its matrix view {view} (from {source}) splits "
            f"each expert's fused matrix into contiguous parts, but its experts module stores "
            f"them {how[kind]}, so the parts would be wrong. Leave this param to its default "
            "view (one matrix per expert: drop split_fused / --split-fused, or give it a rule "
            "with view=Batch(1)).")


@dataclass(frozen=True)
class ParamPolicy:
    """Ordered per-name :class:`Rule` s (module docstring); the first matching rule decides.

    ``eligible``: optional ``(name, shape) -> bool``, the params the policy calls Muon matrices
    (e.g. ``lambda n, s: len(s) == 2 and ".layers." in n``): one that ends on AdamW raises at
    ``dedicate_params`` unless a rule routes it to AdamW explicitly
    (:mod:`dmuon.functional.routing`). Not part of the plan's fingerprint.
    """

    rules: tuple[Rule, ...] = field(default_factory=tuple)
    eligible: Optional[Callable[[str, tuple], bool]] = None

    def __post_init__(self) -> None:
        rules = tuple(self.rules)
        for k, r in enumerate(rules):
            if not isinstance(r, Rule):
                raise TypeError(f"ParamPolicy.rules[{k}] must be a dmuon.functional.policy.Rule, "
                                f"got {r!r}")
        object.__setattr__(self, "rules", rules)

    def rule_for(self, name: str) -> tuple[int, Optional[Rule]]:
        for k, r in enumerate(self.rules):
            if r.matches(name):
                return k, r
        return -1, None

    def route(self, name: str, predicate_says_muon: bool) -> str:
        """The route of ``name``: the first matching rule's, else the predicate's."""
        _, r = self.rule_for(name)
        if r is not None and r.route is not None:
            return r.route
        return "muon" if predicate_says_muon else "adamw"

    def decide(self, name: str, shape: Sequence[int], *, predicate_says_muon: bool,
               kind: str = "other",
               batch_dims: Optional[Callable[[str, tuple[int, ...]], int]] = None,
               dtype: Optional[torch.dtype] = None) -> Decision:
        """The :class:`Decision` for one param (precedence in the module docstring); ``dtype``:
        the param's own dtype (checks a rule's ``master_dtype`` against it).

        Raises:
          ValueError: the chosen view does not fit the shape, or no default view exists (the
            message names the param and the rules); a rule sets dtypes or multipliers on an
            AdamW param; a rule's ``master_dtype`` is narrower than the param's dtype.
        """
        shape = tuple(int(d) for d in shape)
        k, r = self.rule_for(name)
        route = self.route(name, predicate_says_muon)
        if route == "adamw":
            if r is not None and (r.lr_mult is not None or r.wd_mult is not None):
                raise ValueError(
                    f"param {name!r} goes to AdamW, but rule {k} ({r.pattern!r}) sets lr_mult / "
                    "wd_mult, which apply to Muon params only for now; narrow the rule's pattern "
                    "or use a torch param group for AdamW")
            if r is not None and r.dtypes_set():
                raise ValueError(
                    f"param {name!r} goes to AdamW, but rule {k} ({r.pattern!r}) sets "
                    f"{', '.join(r.dtypes_set())}, which apply to Muon (dedicated) params only; "
                    "narrow the rule's pattern, or give AdamW params their dtypes through "
                    "fully_shard's MixedPrecisionPolicy")
            return Decision("adamw", None, f"rule {k}: {r.pattern}" if r is not None and
                            r.route is not None else "predicate")
        if r is not None and r.view is not None:
            view, source = r.view, f"rule {k}: {r.pattern}"
        elif batch_dims is not None and int(batch_dims(name, shape)) > 0:
            view, source = Batch(int(batch_dims(name, shape))), "batch_dims"
        elif batch_dims is not None and len(shape) > 2:
            view, source = Batch(0), "batch_dims"  # an explicit 0 on a >=3-D param: flatten
        else:
            view, source = default_view(name, shape, kind), "default"
        _check_fused_layout(name, shape, view, source, kind)
        try:
            view.blocks(shape)
        except ValueError as e:
            raise ValueError(f"param {name!r} of shape {shape}: its matrix view {view} (from "
                             f"{source}) does not fit: {e}") from None
        lm = 1.0 if r is None or r.lr_mult is None else r.lr_mult
        wm = 1.0 if r is None or r.wd_mult is None else r.wd_mult
        if r is None:
            return Decision("muon", view, source, lm, wm)
        if (r.master_dtype is not None and dtype is not None and dtype.is_floating_point
                and not _covers(r.master_dtype, dtype)):
            raise ValueError(
                f"param {name!r} is {dtype}, but rule {k} ({r.pattern!r}) sets master_dtype="
                f"{r.master_dtype}, narrower: the master would lose the param's precision. Use a "
                "master_dtype at least as wide as the param, or narrow the rule's pattern")
        return Decision("muon", view, source, lm, wm, r.param_dtype, r.reduce_dtype,
                        r.master_dtype)

    def canonical(self) -> list:
        """Plain data for the plan fingerprint."""
        return [r.canonical() for r in self.rules]

    def describe(self) -> str:
        if not self.rules:
            return "policy: no rules (predicate routes; default views)"
        lines = ["policy rules (first match wins):"]
        for k, r in enumerate(self.rules):
            lines.append(f"  {k}: {r.pattern}  route={r.route or '-'}  view={r.view or '-'}"
                         + (f"  lr_mult={r.lr_mult}" if r.lr_mult is not None else "")
                         + (f"  wd_mult={r.wd_mult}" if r.wd_mult is not None else "")
                         + "".join(f"  {f}={str(getattr(r, f)).replace('torch.', '')}"
                                   for f in r.dtypes_set()))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the policy applied by ``dedicate_params``: its routing predicate, every chosen param's decision,
# the rules' dtypes and the plan fingerprint every rank compares

def as_policy(policy: Optional[ParamPolicy]) -> ParamPolicy:
    """``policy`` itself, or the empty policy for ``None`` (``TypeError`` for anything else)."""
    if policy is None:
        return ParamPolicy()
    if not isinstance(policy, ParamPolicy):
        raise TypeError(f"dedicate_params: policy must be a dmuon.functional.policy.ParamPolicy or "
                        f"None, got {type(policy).__name__}")
    return policy


def routing_predicate(policy: ParamPolicy, predicate: Any, model: Any = None) -> Any:
    """The predicate ``dedicate_params`` selects with: the user's (with the ``nn.Module``
    ``model``: :func:`~dmuon.functional.specs.default_muon_predicate` looks at the modules too,
    :mod:`dmuon.functional.module_routes`), overridden by the first matching rule that sets a
    route (the user's object itself when nothing changes it)."""
    if model is not None:
        predicate = route_with_modules(model, predicate)
    if not callable(predicate) or not any(r.route is not None for r in policy.rules):
        return predicate

    def routed(name: str, p: Any) -> bool:
        _, r = policy.rule_for(name)
        if r is not None and r.route is not None:
            return r.route == "muon"
        return bool(predicate(name, p))
    return routed


def decide_params(model: Any, chosen: Mapping[str, Any], policy: ParamPolicy,
                  batch_dims: Optional[Callable[[str, tuple[int, ...]], int]]) -> dict[str, Decision]:
    """The policy's :class:`Decision` (route ``"muon"``, view, source) for every chosen param of
    the ``nn.Module`` ``model`` (its AdamW params are checked: rules may not set multipliers)."""
    for n, p in model.named_parameters():
        if p.requires_grad and n not in chosen:
            policy.decide(n, tuple(p.shape), predicate_says_muon=False)
    out = {}
    for n, p in chosen.items():
        owner = model.get_submodule(n.rsplit(".", 1)[0]) if "." in n else model
        out[n] = policy.decide(n, tuple(p.shape), predicate_says_muon=True,
                               kind=module_kind(owner), batch_dims=batch_dims, dtype=p.dtype)
    return out


def dtype_overrides(decisions: Mapping[str, Decision], attr: str) -> dict[str, Any]:
    """``{name: dtype}`` of the params whose rule sets ``attr`` (``"param_dtype"``,
    ``"reduce_dtype"`` or ``"master_dtype"``); the others follow the group's / default rule."""
    return {n: getattr(d, attr) for n, d in decisions.items() if getattr(d, attr) is not None}


def policy_fingerprint(plan_fingerprint: str, policy: ParamPolicy) -> str:
    """The plan's fingerprint, extended by the policy's rules when it has any (unchanged
    otherwise, so plans without a policy keep their fingerprints)."""
    if not policy.rules:
        return plan_fingerprint
    blob = json.dumps([plan_fingerprint, policy.canonical()], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
