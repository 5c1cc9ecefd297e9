"""``torch.optim.Muon``'s spellings of dmuon's Muon options, and the check of every option of
``dmuon.Muon(...)`` before it changes anything (pure: no process group, nothing stateful).

One spelling per option inside dmuon: where ``torch.optim.Muon`` names an option that means what
dmuon's means, :func:`resolve_torch_names` folds torch's name into dmuon's when ``dmuon.Muon(...)``
is built, and only dmuon's name reaches ``param_groups``, state dicts and the step.

=============================  ===============================  ===============================
torch.optim.Muon               dmuon                            same math?
=============================  ===============================  ===============================
``eps``                        ``ns_eps``                       ε of NS's Frobenius normalization:
                                                                torch ``X / max(‖X‖, ε)``, dmuon
                                                                ``X / (‖X‖ + ε)`` (equal to
                                                                ``ε/‖X‖`` relative)
``adjust_lr_fn="original"``    ``lr_scale="jordan"``            ``sqrt(max(1, m/n))``: yes
``adjust_lr_fn=None``          ``lr_scale="jordan"``            torch's default is "original"
``"match_rms_adamw"``          ``lr_scale="moonlight"``         ``0.2·sqrt(max(m, n))``: yes
``"spectral_unclamped"``       ``lr_scale="spectral"``          ``sqrt(m/n)`` (torch 2.15): yes
``ns_coefficients=(a, b, c)``  the same value                   one triple every iteration: yes
=============================  ===============================  ===============================

(``m = shape[0]``, ``n = shape[1]`` for the 2-D params torch takes; dmuon's views extend both.)
"""
from __future__ import annotations

from typing import Any, Mapping

from dmuon.functional import adamw as fadamw
from dmuon.functional.lr_scale import ADJUST_LR_FN, LR_SCALE_RULES
from dmuon.functional.muon import MuonHParams, validate_hparams

__all__ = ["NOT_GIVEN", "TORCH_ALIASES", "ADJUST_LR_FN", "ELEMENTWISE", "resolve_torch_names",
           "check_flag", "check_options"]


class _NotGiven:
    """The default of a torch-named alias: the caller did not pass it."""

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()

#: torch.optim.Muon's option name -> dmuon's
TORCH_ALIASES: Mapping[str, str] = {"eps": "ns_eps", "adjust_lr_fn": "lr_scale"}


#: ``dmuon.Muon``'s ``elementwise=`` choices
ELEMENTWISE = ("auto", "fused", "foreach")

#: dmuon's defaults (a value of an aliased option equal to its default counts as not given)
_DEFAULTS = MuonHParams._field_defaults


def _translate(torch_name: str, value: Any) -> Any:
    if torch_name != "adjust_lr_fn":
        return value
    if isinstance(value, str) and value in LR_SCALE_RULES:
        raise ValueError(
            f"dmuon.Muon: adjust_lr_fn={value!r} is dmuon's lr_scale value under torch's name; pass "
            f"lr_scale={value!r}, or one of torch.optim.Muon's adjust_lr_fn values "
            f"{sorted(k for k in ADJUST_LR_FN if k)} (or None, its default 'original')")
    try:
        return ADJUST_LR_FN[value]
    except (KeyError, TypeError):
        raise ValueError(
            f"dmuon.Muon: adjust_lr_fn={value!r} is not one of torch.optim.Muon's values: "
            + ", ".join(f"{k!r} (= lr_scale={v!r})" for k, v in ADJUST_LR_FN.items())
            + f". dmuon's own name is lr_scale, one of {LR_SCALE_RULES}.") from None


def resolve_torch_names(hparams: Mapping[str, Any], **torch_names: Any) -> dict[str, Any]:
    """``hparams`` (dmuon's names) with torch's aliases folded in: the one spelling dmuon keeps.

    Args:
      hparams: Muon hyper-parameters under dmuon's names (``MuonHParams``'s fields).
      **torch_names: ``eps`` / ``adjust_lr_fn`` as ``torch.optim.Muon`` takes them; the value
        :data:`NOT_GIVEN` means not passed.

    Returns:
      A new dict of dmuon's names only.

    Raises:
      TypeError: a name that is not one of :data:`TORCH_ALIASES`.
      ValueError: an ``adjust_lr_fn`` value torch does not define; or both spellings of one option
        given with different values (dmuon's counts as given when it is not its default).
    """
    out = dict(hparams)
    for name, value in torch_names.items():
        if name not in TORCH_ALIASES:
            raise TypeError(f"dmuon.Muon: unknown option {name!r}; torch.optim.Muon names dmuon "
                            f"accepts: {dict(TORCH_ALIASES)}")
        if value is NOT_GIVEN:
            continue
        ours = TORCH_ALIASES[name]
        mapped = _translate(name, value)
        if out[ours] != _DEFAULTS[ours] and out[ours] != mapped:
            raise ValueError(
                f"dmuon.Muon: {name}={value!r} (torch.optim.Muon's name) and {ours}={out[ours]!r} "
                f"set the same option to different values; pass one of them ({name} is {ours} "
                f"here{'' if mapped == value else f', {value!r} meaning {mapped!r}'}).")
        out[ours] = mapped
    return out


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``; else ``TypeError`` (``bool("no")`` would silently be True)."""
    if not isinstance(value, bool):
        raise TypeError(f"dmuon.Muon: {name} must be True or False, got {value!r}")
    return value


def check_options(positional: tuple, given: Mapping[str, Any]) -> tuple[dict, dict]:
    """Check every option of ``dmuon.Muon(model, lr, *positional, **options)`` (``given``: its
    arguments by name; ``ns_engine`` is the optimizer's to check) and fold torch's names into
    dmuon's.

    Returns:
      ``(muon_hp, adamw_hp)``: the two param groups' hyper-parameters under dmuon's names.

    Raises:
      TypeError, ValueError: naming the option and what it accepts.
    """
    if positional:
        raise TypeError(
            f"dmuon.Muon(model, lr, ...) takes lr as its only positional option; pass the other "
            f"{len(positional)} by name (e.g. dmuon.Muon(model, 0.02, weight_decay=0.1)). "
            "torch.optim.Muon's positional order (lr, weight_decay, momentum, nesterov, ...) is not "
            "followed: dmuon's AdamW options sit beside Muon's, so a value by position could "
            "silently set another option.")
    muon_hp = resolve_torch_names({k: given[k] for k in MuonHParams._fields},
                                  eps=given["eps"], adjust_lr_fn=given["adjust_lr_fn"])
    for k in ("lr", "momentum", "weight_decay"):  # param_groups hold values (schedulers set them)
        v = muon_hp[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(
                f"dmuon.Muon: {k} must be a float, got {type(v).__name__}; param_groups hold "
                "values, which torch.optim.lr_scheduler (or your loop) updates between steps. "
                "0-d tensors and functions of the step are for the functional API "
                "(dmuon.functional.muon.MuonHParams, the transforms' stages).")
    try:
        validate_hparams(MuonHParams(**muon_hp))
    except ValueError as e:
        aliases = [f"{t} is torch.optim.Muon's name for {o}" for t, o in TORCH_ALIASES.items()
                   if given[t] is not NOT_GIVEN and o in str(e)]
        if not aliases:
            raise
        raise ValueError(f"dmuon.Muon: {e} ({'; '.join(aliases)})") from None
    betas = given["adamw_betas"]
    adamw_hp = dict(lr=given["adamw_lr"], eps=given["adamw_eps"],
                    weight_decay=given["adamw_weight_decay"],
                    betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas)
    fadamw.validate_hparams(fadamw.AdamWHParams(**adamw_hp))
    check_finite = given["check_finite"]
    if not (check_finite == "auto" or isinstance(check_finite, bool)):
        raise ValueError(f"check_finite must be 'auto', True or False, got {check_finite!r}")
    if given["adamw_impl"] not in ("auto",) + fadamw.IMPLS:
        raise ValueError(f"adamw_impl must be 'auto' or one of {fadamw.IMPLS}, got "
                         f"{given['adamw_impl']!r}")
    if given["elementwise"] not in ELEMENTWISE:
        raise ValueError(f"elementwise must be one of {ELEMENTWISE}, got {given['elementwise']!r}")
    for flag in ("replicate_async", "persistent_grad_buffers"):
        check_flag(flag, given[flag])
    return muon_hp, adamw_hp
