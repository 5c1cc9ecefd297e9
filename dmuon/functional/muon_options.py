"""The options of ``dmuon.Muon(...)``: torch's names, the deprecated spellings, and the check of
every option before it changes anything (pure: no process group, nothing stateful).

One spelling per option, torch's where ``torch.optim.Muon`` has the option: ``dmuon.Muon(...)``
and ``param_groups[0]`` name Muon's hyper-parameters as torch does (:data:`GROUP_KEYS`);
:func:`hparams_of_group` reads them into the functional core's
:class:`~dmuon.functional.muon.MuonHParams` (whose fields keep the functional API's names).

=============================  ===============================  ===============================
``dmuon.Muon`` / torch         ``MuonHParams``                  same math?
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

Deprecated (one release; a ``DeprecationWarning`` names the new spelling): ``ns_eps`` and
``lr_scale`` (:data:`OLD_NAMES`), ``momentum_dtype`` (now a stage option:
``transform=variants.muon(momentum_dtype=...)``) and the execution knobs ``replicate_async``,
``adamw_impl``, ``ns_engine``, ``elementwise``, ``persistent_grad_buffers`` (now setters,
``optimizer.set_<knob>(...)``, as FSDP2's ``set_*``).
"""
from __future__ import annotations

from typing import Any, Mapping

from dmuon.functional import adamw as fadamw
from dmuon.functional.lr_scale import ADJUST_LR_FN, LR_SCALE_RULES
from dmuon.functional.muon import MuonHParams, validate_hparams

__all__ = ["GROUP_KEYS", "OLD_NAMES", "KNOBS", "ADJUST_LR_FN", "ELEMENTWISE", "hparams_of_group",
           "group_of_saved", "group_for_saving", "check_flag", "check_options", "check_knob",
           "momentum_dtype_of"]

#: ``param_groups[0]``'s Muon hyper-parameters (torch.optim.Muon's names where it has them)
GROUP_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "ns_steps", "ns_coefficients", "eps",
              "ns_dtype", "adjust_lr_fn")
#: the deprecated spellings of two of them
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
    """The :class:`MuonHParams` of ``param_groups[0]`` (torch's names; an old name there, e.g.
    a loop that writes ``group["lr_scale"]``, raises: it would silently change nothing)."""
    stale = [k for k in OLD_NAMES if k in group]
    if stale:
        raise ValueError(
            f"dmuon.Muon: param_groups[0] has {stale} (dmuon's former names), which nothing reads: "
            "its options are spelled as torch.optim.Muon's now: "
            + ", ".join(f"{k} -> {OLD_NAMES[k]}" for k in stale) + ". Set those instead (and "
            "delete the old keys); lr_scale values map as " + repr(_FROM_LR_SCALE) + ".")
    kw = {k: group[k] for k in GROUP_KEYS}
    kw["ns_eps"], kw["lr_scale"] = kw.pop("eps"), _lr_scale(kw.pop("adjust_lr_fn"))
    return MuonHParams(**kw)


def group_for_saving(group: Mapping[str, Any]) -> dict[str, Any]:
    """``param_groups[0]`` as checkpoints store it: under the functional core's names
    (``ns_eps``, ``lr_scale``: the format every dmuon has written, so torch's state-dict tools
    and DCP, which load into the current optimizer's ``state_dict()`` keys, read older and newer
    checkpoints alike); :func:`group_of_saved` is its inverse."""
    out = dict(group)
    if "eps" in out and "adjust_lr_fn" in out:
        out["ns_eps"] = out.pop("eps")
        out["lr_scale"] = _lr_scale(out.pop("adjust_lr_fn"))
    return out


def group_of_saved(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A saved ``param_groups[0]`` (the functional core's names, :func:`group_for_saving`) under
    torch's names."""
    out = dict(saved)
    if "ns_eps" in out:
        out.setdefault("eps", out.pop("ns_eps"))
    if "lr_scale" in out:
        rule = out.pop("lr_scale")
        out.setdefault("adjust_lr_fn", _FROM_LR_SCALE.get(rule, rule))
    return out


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


def check_options(positional: tuple, given: Mapping[str, Any],
                  deprecated: Mapping[str, Any]) -> tuple[dict, dict, dict, Any, list[str]]:
    """Check every option of ``dmuon.Muon(model, lr, *positional, **options)`` (``given``: its
    arguments by name; ``deprecated``: the former spellings passed).

    Returns:
      ``(muon_group, adamw_hp, knobs, momentum_dtype, notes)``: ``param_groups[0]``'s
      hyper-parameters (:data:`GROUP_KEYS`), AdamW's, the execution knobs (:data:`KNOBS`, from
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
    group = {k: given[k] for k in GROUP_KEYS}
    for old, new in OLD_NAMES.items():
        if old not in deprecated:
            continue
        value = deprecated[old] if old == "ns_eps" else _FROM_LR_SCALE.get(deprecated[old],
                                                                             deprecated[old])
        if old == "lr_scale" and deprecated[old] not in LR_SCALE_RULES:
            raise ValueError(f"Muon lr_scale must be one of {LR_SCALE_RULES}, got "
                             f"{deprecated[old]!r} (lr_scale is deprecated: pass adjust_lr_fn)")
        default = MUON_DEFAULTS[new]
        if group[new] != default and group[new] != value:
            raise ValueError(
                f"dmuon.Muon: {new}={group[new]!r} and {old}={deprecated[old]!r} (its deprecated "
                f"spelling) set the same option to different values; pass {new} only.")
        group[new] = value
        notes.append(f"dmuon.Muon({old}=...) is deprecated: pass {new}="
                     f"{value!r} (torch.optim.Muon's name)")
    for k in ("lr", "momentum", "weight_decay"):  # param_groups hold values (schedulers set them)
        v = group[k]
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
    betas = given["adamw_betas"]
    adamw_hp = dict(lr=given["adamw_lr"], eps=given["adamw_eps"],
                    weight_decay=given["adamw_weight_decay"],
                    betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas)
    fadamw.validate_hparams(fadamw.AdamWHParams(**adamw_hp))
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


#: the constructor's defaults of :data:`GROUP_KEYS` (torch's names)
MUON_DEFAULTS: Mapping[str, Any] = {
    **{k: v for k, v in MuonHParams._field_defaults.items() if k in GROUP_KEYS},
    "eps": MuonHParams._field_defaults["ns_eps"], "adjust_lr_fn": "match_rms_adamw"}
