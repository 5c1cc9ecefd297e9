"""The options of ``dmuon.Muon(...)``: torch's names, the deprecated spellings, and the check of
every option before it changes anything (pure: no process group, nothing stateful).

``dmuon.Muon(...)`` spells Muon's hyper-parameters as ``torch.optim.Muon`` does where torch has
the option (``eps``, ``adjust_lr_fn``); ``param_groups[0]`` holds them under the functional core's
names (:class:`~dmuon.functional.muon.MuonHParams`' fields, :data:`GROUP_KEYS`): the format every
dmuon has saved, which torch's state-dict tools and DCP need to equal the in-memory keys (they
load into the current optimizer's keys, and their flattened format reads ``param_groups``
directly), so older checkpoints load. A group key spelled as the constructor's raises at the next
step (it would silently change nothing): :func:`hparams_of_group`.

=============================  ===============================  ===============================
``dmuon.Muon`` / torch         ``param_groups`` / MuonHParams   same math?
=============================  ===============================  ===============================
``eps``                        ``ns_eps``                       ε of NS's Frobenius normalization:
                                                                torch ``X / max(‖X‖, ε)``, dmuon
                                                                ``X / (‖X‖ + ε)`` (equal to
                                                                ``ε/‖X‖`` relative)
``adjust_lr_fn="original"``    ``lr_scale="jordan"``            ``sqrt(max(1, m/n))``: yes
``adjust_lr_fn=None``          ``lr_scale="jordan"``            torch's default is "original"
``"match_rms_adamw"``          ``lr_scale="moonlight"``         ``0.2·sqrt(max(m, n))``: yes
                                                                (dmuon's default)
``"spectral_unclamped"``       ``lr_scale="spectral"``          ``sqrt(m/n)`` (torch 2.15): yes
``"none"`` (dmuon only)        ``lr_scale="none"``              ``1``
``ns_coefficients=(a, b, c)``  the same value                   one triple every iteration: yes
=============================  ===============================  ===============================

(``m = shape[0]``, ``n = shape[1]`` for the 2-D params torch takes; dmuon's views extend both.)

Deprecated as constructor options (one release; a ``DeprecationWarning`` names the new spelling):
``ns_eps`` and ``lr_scale`` (:data:`OLD_NAMES`), ``momentum_dtype`` (now a stage option:
``transform=variants.muon(momentum_dtype=...)``) and the execution knobs ``replicate_async``,
``adamw_impl``, ``ns_engine``, ``elementwise``, ``persistent_grad_buffers`` (now setters,
``optimizer.set_<knob>(...)``, as FSDP2's ``set_*``).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from dmuon.functional import adamw as fadamw
from dmuon.functional.lr_scale import ADJUST_LR_FN, LR_SCALE_RULES
from dmuon.functional.muon import MuonHParams, validate_hparams
from dmuon.newton_schulz.batched import BatchedNS

__all__ = ["GROUP_KEYS", "OLD_NAMES", "KNOBS", "ADJUST_LR_FN", "ELEMENTWISE", "NOT_GIVEN",
           "hparams_of_group", "resolve_torch_names", "check_flag", "check_options",
           "check_muon_group", "check_adamw_group", "check_knob", "ns_of",
           "momentum_dtype_of", "GROUPS_FIXED", "unmanaged_by_fsdp", "unread_group_keys",
           "FIXED_KEYS", "replaced_params"]

#: ``param_groups[0]``'s Muon hyper-parameters: ``MuonHParams``' fields
GROUP_KEYS = MuonHParams._fields
#: the constructor's former spellings -> torch's (the constructor's one spelling)
OLD_NAMES: Mapping[str, str] = {"ns_eps": "eps", "lr_scale": "adjust_lr_fn"}
#: ``adjust_lr_fn``'s values -> ``MuonHParams.lr_scale`` (torch's, and dmuon's ``"none"``: s = 1)
_ADJUST = {**ADJUST_LR_FN, "none": "none"}
#: ``lr_scale`` -> the ``adjust_lr_fn`` spelling of the same rule
_FROM_LR_SCALE = {"moonlight": "match_rms_adamw", "jordan": "original",
                  "spectral": "spectral_unclamped", "none": "none"}
#: the execution knobs (setters now) and their defaults
KNOBS: Mapping[str, Any] = {"replicate_async": True, "adamw_impl": "auto", "ns_engine": "auto",
                            "elementwise": "auto", "persistent_grad_buffers": False}

#: ``dmuon.Muon``'s ``elementwise=`` choices
ELEMENTWISE = ("auto", "fused", "foreach")


def _lr_scale(value: Any, where: str = "adjust_lr_fn") -> str:
    """``MuonHParams.lr_scale`` of an ``adjust_lr_fn`` value (``ValueError`` naming the choices)."""
    try:
        return _ADJUST[value]
    except (KeyError, TypeError):
        hint = (f" ({value!r} is the deprecated lr_scale's name for adjust_lr_fn="
                f"{_FROM_LR_SCALE[value]!r})") if value in _FROM_LR_SCALE else ""
        raise ValueError(
            f"dmuon.Muon: {where}={value!r} is not one of "
            + ", ".join(f"{k!r} (s = {v})" for k, v in _ADJUST.items()) + hint) from None


def hparams_of_group(group: Mapping[str, Any]) -> MuonHParams:
    """The :class:`MuonHParams` of ``param_groups[0]`` (a key spelled as the constructor's, e.g.
    a loop that writes ``group["eps"]``, raises: nothing reads it, it would silently change
    nothing)."""
    wrong = [k for k in OLD_NAMES.values() if k in group]
    if wrong:
        inverse = {v: k for k, v in OLD_NAMES.items()}
        raise ValueError(
            f"dmuon.Muon: param_groups[0] has {wrong}, which nothing reads: the group holds Muon's "
            "hyper-parameters under the functional core's names (the checkpoint format): "
            + ", ".join(f"{k} -> {inverse[k]}" for k in wrong) + " (adjust_lr_fn values map to "
            f"lr_scale as {dict(_ADJUST)}). Set those instead and delete the key.")
    return MuonHParams(**{k: group[k] for k in GROUP_KEYS})


class _NotGiven:
    """A torch-named option the caller did not pass (or passed at its default)."""

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()


def resolve_torch_names(hparams: Mapping[str, Any], **torch_names: Any) -> dict[str, Any]:
    """``hparams`` (``MuonHParams``' names) with torch's names folded in (``eps``,
    ``adjust_lr_fn``; :data:`NOT_GIVEN`: not passed): the group ``param_groups[0]`` holds.

    Raises:
      TypeError: a name that is not torch's spelling of a Muon option.
      ValueError: an ``adjust_lr_fn`` value torch does not define (nor dmuon's ``"none"``); or
        both spellings of one option given with different values (the functional core's counts
        as given when it is not its default).
    """
    out = dict(hparams)
    inverse = {v: k for k, v in OLD_NAMES.items()}
    for name, value in torch_names.items():
        if name not in inverse:
            raise TypeError(f"dmuon.Muon: unknown option {name!r}; torch.optim.Muon names dmuon "
                            f"accepts: {sorted(inverse)}")
        if value is NOT_GIVEN:
            continue
        ours = inverse[name]
        mapped = value if name == "eps" else _lr_scale(value)
        if out[ours] != MuonHParams._field_defaults[ours] and out[ours] != mapped:
            raise ValueError(
                f"dmuon.Muon: {name}={value!r} (torch.optim.Muon's name) and {ours}={out[ours]!r} "
                f"set the same option to different values; pass one of them ({name} is {ours} "
                f"here{'' if mapped == value else f', {value!r} meaning {mapped!r}'}).")
        out[ours] = mapped
    return out


def check_muon_group(group: Mapping[str, Any]) -> MuonHParams:
    """The :class:`MuonHParams` of a Muon param group (``param_groups[0]``'s keys), checked as
    ``dmuon.Muon(...)`` checks its options: the one check of the constructor and of every load
    (:func:`dmuon.functional.load_scalars.load_problems`).

    Raises:
      TypeError: ``lr``, ``momentum`` or ``weight_decay`` not a float (param groups hold values).
      ValueError: a value out of range (:func:`~dmuon.functional.muon.validate_hparams`: finite
        ``lr >= 0``, ``momentum`` in ``[0, 1)``, ``1 <= ns_steps <= MAX_NS_STEPS``, ...), or a key
        spelled as the constructor's (:func:`hparams_of_group`).
    """
    for k in ("lr", "momentum", "weight_decay"):  # param_groups hold values (schedulers set them)
        v = group.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(
                f"dmuon.Muon: {k} must be a float, got {type(v).__name__}; param_groups hold "
                "values, which torch.optim.lr_scheduler (or your loop) updates between steps. "
                "0-d tensors and functions of the step are for the functional API "
                "(dmuon.functional.muon.MuonHParams, the transforms' stages).")
    hp = hparams_of_group(group)
    try:
        validate_hparams(hp)
    except ValueError as e:
        raise ValueError(str(e).replace("Muon ns_eps", "Muon eps (ns_eps)").replace(
            "Muon lr_scale", "Muon adjust_lr_fn (lr_scale)")) from None
    return hp


def check_adamw_group(group: Mapping[str, Any]) -> Any:
    """The :class:`~dmuon.functional.adamw.AdamWHParams` of an AdamW param group (``lr``,
    ``betas``, ``eps``, ``weight_decay``), checked by :func:`dmuon.functional.adamw.validate_hparams`
    (the constructor's check of ``adamw_*``, and every load's)."""
    betas = group.get("betas")
    hp = fadamw.AdamWHParams(lr=group.get("lr"), eps=group.get("eps"),
                             weight_decay=group.get("weight_decay"),
                             betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas)
    try:
        fadamw.validate_hparams(hp)
    except TypeError as e:  # a comparison with a non-number (a TypeError, as check_muon_group's)
        raise TypeError(f"AdamW hyper-parameters {hp}: {e}") from None
    return hp


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``; else ``TypeError`` (``bool("no")`` would silently be True)."""
    if not isinstance(value, bool):
        raise TypeError(f"dmuon.Muon: {name} must be True or False, got {value!r}")
    return value


def check_knob(name: str, value: Any) -> Any:
    """Validate one execution knob (``ns_engine`` is the optimizer's to check); returns it."""
    if name == "adamw_impl" and value not in ("auto",) + fadamw.IMPLS:
        raise ValueError(f"adamw_impl must be 'auto' or one of {fadamw.IMPLS}, got {value!r}")
    if name == "elementwise" and value not in ELEMENTWISE:
        raise ValueError(f"elementwise must be one of {ELEMENTWISE}, got {value!r}")
    if name in ("replicate_async", "persistent_grad_buffers"):
        check_flag(name, value)
    return value


def ns_of(choice: Any, device_type: str, engine: type) -> Any:
    """The NS the owners run for ``Muon.set_ns_engine(choice)`` on ``device_type`` (``engine``:
    the engine class, :class:`dmuon.kernels.ns_engine.NSEngine`): an engine given is itself; the
    ``engine`` class for ``"engine"`` and, on CUDA, ``"auto"``; else the functional core's
    :class:`~dmuon.newton_schulz.batched.BatchedNS`. ``ValueError`` for anything else."""
    if isinstance(choice, engine):
        return choice
    if choice not in ("auto", "engine", "functional"):
        raise ValueError("ns_engine must be 'auto', 'engine', 'functional' or a "
                         f"dmuon.kernels.ns_engine.NSEngine, got {choice!r}")
    return BatchedNS if choice == "functional" or (choice == "auto" and device_type != "cuda") \
        else engine


def check_options(positional: tuple, given: Mapping[str, Any],
                  deprecated: Mapping[str, Any]) -> tuple[dict, dict, dict, Any, list[str]]:
    """Check every option of ``dmuon.Muon(model, lr, *positional, **options)`` (``given``: its
    arguments by name; ``deprecated``: the former spellings passed).

    Returns:
      ``(muon_group, adamw_hp, knobs, momentum_dtype, notes)``: ``param_groups[0]``'s
      hyper-parameters (:data:`GROUP_KEYS`, the functional core's names), AdamW's, the execution knobs (:data:`KNOBS`, from
      the deprecated arguments or their defaults), the deprecated ``momentum_dtype`` (``None``:
      not given), and one deprecation message per former spelling used.

    Raises:
      TypeError, ValueError: naming the option and what it accepts (an unknown option; both
        spellings of one option with different values).
    """
    if positional:
        raise TypeError(
            f"dmuon.Muon(model, lr, ...) takes lr as its only positional option; pass the other "
            f"{len(positional)} by name (e.g. dmuon.Muon(model, 0.02, weight_decay=0.1)). "
            "torch.optim.Muon's positional order (lr, weight_decay, momentum, nesterov, ...) is not "
            "followed: dmuon's AdamW options sit beside Muon's, so a value by position could "
            "silently set another option.")
    unknown = sorted(set(deprecated) - set(OLD_NAMES) - set(KNOBS) - {"momentum_dtype"})
    if unknown:
        raise TypeError(f"dmuon.Muon: unknown option(s) {unknown}")
    notes = []
    for old, new in OLD_NAMES.items():
        if old in deprecated:
            notes.append(f"dmuon.Muon({old}=...) is deprecated: pass {new}=... "
                         "(torch.optim.Muon's name)")
    if "lr_scale" in deprecated and deprecated["lr_scale"] not in LR_SCALE_RULES:
        raise ValueError(f"Muon lr_scale must be one of {LR_SCALE_RULES}, got "
                         f"{deprecated['lr_scale']!r} (lr_scale is deprecated: pass adjust_lr_fn)")
    defaults = MuonHParams._field_defaults
    group = resolve_torch_names(
        {k: deprecated.get(k, defaults[k]) if k in OLD_NAMES else given[k] for k in GROUP_KEYS},
        **{n: NOT_GIVEN if given[n] == MUON_DEFAULTS[n] else given[n] for n in OLD_NAMES.values()})
    check_muon_group(group)
    betas = given["adamw_betas"]
    adamw_hp = dict(lr=given["adamw_lr"], eps=given["adamw_eps"],
                    weight_decay=given["adamw_weight_decay"],
                    betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas)
    check_adamw_group(adamw_hp)
    check_finite = given["check_finite"]
    if not (check_finite == "auto" or isinstance(check_finite, bool)):
        raise ValueError(f"check_finite must be 'auto', True or False, got {check_finite!r}")
    knobs = dict(KNOBS)
    for k in KNOBS:
        if k in deprecated:
            knobs[k] = check_knob(k, deprecated[k])
            notes.append(f"dmuon.Muon({k}=...) is deprecated: call optimizer.set_{k}(...) after "
                         "building it")
    if "momentum_dtype" in deprecated:
        notes.append("dmuon.Muon(momentum_dtype=...) is deprecated: the momentum dtype is the "
                     "momentum stage's option, transform=dmuon.functional.variants.muon("
                     "momentum_dtype=...) (or normuon(momentum_dtype=...), ...)")
    return group, adamw_hp, knobs, deprecated.get("momentum_dtype"), notes


def momentum_dtype_of(transform: Any, old: Any, hparams: MuonHParams) -> tuple[Any, Any]:
    """``(transform, momentum dtype)``: the chain's momentum stage's ``momentum_dtype`` (the one
    spelling), or the deprecated ``dmuon.Muon(momentum_dtype=...)`` (default transform: folded
    into ``variants.muon(momentum_dtype=...)``; another: the storage of its momentum field)."""
    from dmuon.functional import transforms as T
    from dmuon.functional import variants
    if transform is None:
        return (None, None) if old is None else (variants.muon(momentum_dtype=old), old)
    chain = transform if isinstance(transform, T.Transform) else \
        (transform(hparams) if callable(transform) else None)
    mine = getattr(chain, "momentum_dtype", None)
    if old is not None and mine is not None and str(mine) != str(old):
        raise ValueError(f"dmuon.Muon: momentum_dtype={old} (deprecated) and the transform's "
                         f"momentum stage's momentum_dtype={mine} differ; pass the stage's only")
    return transform, (mine if old is None else old)


#: the constructor's defaults of its torch-named options
MUON_DEFAULTS: Mapping[str, Any] = {"eps": MuonHParams._field_defaults["ns_eps"],
                                    "adjust_lr_fn": "match_rms_adamw"}


#: ``dmuon.Muon.add_param_group``'s refusal: the optimizer's two param groups are fixed
GROUPS_FIXED = (
    "dmuon.Muon.add_param_group: dmuon.Muon has a fixed pair of param groups (Muon for the "
    "dedicated matrices, AdamW for the other params trainable when it was built); an added group "
    "would never be stepped. For progressive unfreezing, build dmuon.Muon with every param "
    "trainable (after dedicate_params and fully_shard) and freeze with requires_grad_(False) "
    "afterwards: a param with no gradient is skipped, as torch skips it, and trains again once "
    "unfrozen (set a per-group lr through param_groups[i]['lr']); train params outside the model "
    "with a torch optimizer of their own.")


def _listed(names: Sequence[str], most: int = 8) -> str:
    """The first ``most`` of ``names``, quoted, and how many more."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(repr(n) for n in names[:most]) + more


def unmanaged_by_fsdp(names: Sequence[str]) -> str:
    """``dmuon.Muon(model)``'s refusal of trainable params that are neither dedicated nor an FSDP2
    group's sharded params (``names``: :func:`dmuon.compat.fsdp_info.unmanaged_params`)."""
    return (f"dmuon.Muon(model): {len(names)} trainable params that are not dedicated are params "
            f"no FSDP2 group manages: {_listed(names)}. Their gradients would never be averaged across "
            "ranks (each rank's AdamW would step its own copy), or fully_shard would replace them "
            "later and the optimizer would step the old tensors. Build dmuon.Muon(model) after "
            "dedicate_params and every fully_shard call (the blocks', then the root's), and "
            "replace modules (a new head) before fully_shard; a param kept out of FSDP2 on "
            "purpose (fully_shard(ignored_params=...)) is not supported: freeze it "
            "(requires_grad_(False)) or let FSDP2 or the predicate take it.")


#: the param-group keys fixed when ``dmuon.Muon`` is built (shown in the groups; no load changes
#: them): a change is refused at the next step (:func:`unread_group_keys`)
FIXED_KEYS = ("momentum_dtype", "offload_state", "adamw_state_dtype")
#: torch optimizers' options that neither of dmuon's groups implements: only their defaults
_UNSUPPORTED = {"amsgrad": False, "maximize": False}


def unread_group_keys(groups: Sequence[Mapping[str, Any]],
                      fixed: Sequence[Mapping[str, Any]]) -> Optional[str]:
    """The error when a param group holds a value nothing reads (``fixed``: each group's
    :data:`FIXED_KEYS` as built; a changed one, or ``amsgrad`` / ``maximize`` set on either
    group), else ``None``."""
    bad = [(i, k, g[k]) for i, (g, f) in enumerate(zip(groups, fixed)) for k in f
           if k in g and g[k] != f[k]]
    bad += [(i, k, g[k]) for i, g in enumerate(groups) for k, d in _UNSUPPORTED.items()
            if g.get(k, d) != d]
    if not bad:
        return None
    return ("dmuon.Muon.step: " + ", ".join(f"param_groups[{i}][{k!r}] = {v!r}" for i, k, v in bad)
            + ", which nothing reads: momentum_dtype, offload_state and adamw_state_dtype are "
            "fixed when dmuon.Muon is built (pass them to the constructor, or "
            "variants.muon(momentum_dtype=...)), and neither of dmuon's groups implements "
            "torch.optim.AdamW's amsgrad or maximize. Set the key back (or delete it). Nothing "
            "was updated; this batch's gradients were dropped.")


def replaced_params(names: Sequence[str]) -> str:
    """``dmuon.Muon.step``'s refusal at the first step of params of its AdamW group that are no
    longer the model's (a ``fully_shard`` or a module replacement after ``dmuon.Muon(model)``)."""
    return (f"dmuon.Muon.step: {len(names)} params of the AdamW group are no longer the model's "
            f"params: {_listed(names)} (fully_shard, or a module replaced, after dmuon.Muon(model) was "
            "built), so the step would update tensors the model no longer uses. Build "
            "dmuon.Muon(model) after dedicate_params and every fully_shard call, and replace "
            "modules before it. Nothing was updated.")
