"""The scalars of an optimizer load, checked before anything changes (pure): its step counters,
the saved storage dtypes and each saved param group's hyper-parameters, by the constructor's own
checks (:mod:`dmuon.functional.muon_options`). Every load path calls :func:`load_problems`
(``Muon.load_state_dict`` in both formats, ``set_optimizer_state_dict``, torch's DCP route through
``load_state_dict``, ``dmuon.load_sharded``) and installs :func:`counters`. The values (tensors) are
:mod:`dmuon.functional.optimizer_format`'s.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Optional, Sequence

import torch

from dmuon.functional.optimizer_format import (COUNTERS as _COUNTERS, SKIPPED, hparams,
                                               loadable_hparams)

__all__ = ["counters", "skipped_counts", "load_problems"]


def _count(v: Any) -> Optional[int]:
    """``v`` as a step count (an int, an integral float or 0-d tensor, ``>= 0``; numpy's scalars
    too), else ``None``."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.is_complex() or v.dtype == torch.bool:
            return None
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real):  # numpy's bool_ is not Real
        return None
    v = int(v) if isinstance(v, numbers.Integral) else float(v)
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        return None
    return int(v) if v >= 0 else None


def counters(entries: Mapping[str, Any]) -> dict[str, int]:
    """The counters of load ``entries`` as ints (:func:`load_problems` passed): a missing one 0,
    a missing ``num_steps`` the larger of the other two."""
    out = {k: _count(entries.get(k, 0)) or 0 for k in _COUNTERS[:2]}
    out["num_steps"] = _count(entries["num_steps"]) or 0 if "num_steps" in entries else \
        max(out.values())
    return out


def skipped_counts(entries: Mapping[str, Any], names: Sequence[str]) -> dict[str, int]:
    """The per-param AdamW skip counts of load ``entries`` (:func:`load_problems` passed) for the
    loading optimizer's AdamW params ``names`` (nonzero ones; none saved: all 0)."""
    skipped = entries.get(SKIPPED) or {}
    return {n: int(_count(skipped[n])) for n in names if n in skipped and _count(skipped[n])}


#: a saved param group's storage dtypes and their checks (known names; AdamW's never 8-bit)
_STORAGE_DTYPES = ("momentum_dtype", "adamw_state_dtype")


def load_problems(entries: Mapping[str, Any], groups: Sequence[Mapping[str, Any]], *,
                  scalars: Optional[int] = None) -> list[str]:
    """Problems of an optimizer load's counters, storage dtypes and hyper-parameters, found before
    anything changes (every load path: ``Muon.load_state_dict`` in both formats,
    ``set_optimizer_state_dict``, torch's DCP route, ``load_sharded``).

    Args:
      entries: the load entries (:func:`full_entries` / :func:`from_torch_protocol`): counters
        ``adamw_step``, ``muon_step``, ``num_steps`` (ints >= 0, neither step above
        ``num_steps``; a tuple: the state entries' ``step`` values, which disagree), the saved
        ``param_groups`` and ``variant_scalars``.
      groups: the loading optimizer's param groups (``{"name": ..., hyper-parameters}``): each
        saved group of the same name, merged over it as a load installs it
        (:func:`loadable_hparams`), is checked as the constructor checks its options
        (:func:`~dmuon.functional.muon_options.check_muon_group` /
        :func:`~dmuon.functional.muon_options.check_adamw_group`).
      scalars: how many counts the optimizer's chain state holds (``variant_scalars`` must give
        that many finite numbers); ``None``: not checked.
    """
    from dmuon.functional.muon_options import check_adamw_group, check_muon_group
    from dmuon.functional.adamw_storage import check_adamw_state_dtype
    from dmuon.functional.state_dtype import check_state_dtype

    problems = []
    for k in _COUNTERS:
        v = entries.get(k, 0)
        if isinstance(v, tuple):
            problems.append(f"{k}: the state entries' 'step' values disagree: {list(v)[:4]} "
                            "(one optimizer's entries share one count)")
        elif _count(v) is None:
            problems.append(f"{k}: {v!r} is not a step count (an int >= 0)")
    if not problems:
        c = counters(entries)
        problems += [f"{k} = {c[k]} exceeds num_steps = {c['num_steps']} (a step count above "
                     "the optimizer's steps)" for k in _COUNTERS[:2] if c[k] > c["num_steps"]]
        skipped = entries.get(SKIPPED) or {}
        bad = [n for n, v in skipped.items() if not isinstance(n, str) or _count(v) is None
               or _count(v) > c["adamw_step"]] if isinstance(skipped, Mapping) else [skipped]
        if bad:
            problems.append(f"{SKIPPED}: {bad[:4]} not a param name with a count in [0, "
                            f"adamw_step = {c['adamw_step']}] (the steps it had no gradient at)")
    saved = entries.get("param_groups")
    saved = [] if saved is None else saved  # (absent: an older full dict keeps its groups)
    if not isinstance(saved, Sequence) or not all(isinstance(g, Mapping) for g in saved):
        return problems + [f"param_groups: expected a list of dicts, got {type(saved).__name__}"]
    sizes = entries.get("group_sizes")  # torch's protocol: its groups as torch checks them
    if entries.get("param_groups") is not None and (len(saved) != len(groups) or sizes is not None
                                                    and sizes != _sizes(groups)):
        shown = "?" if sizes is None else sizes
        problems.append(f"param_groups: {len(saved)} groups of {shown} params; this "
                        f"optimizer has {len(groups)} ({[g.get('name') for g in groups]}) of "
                        f"{_sizes(groups)} (a dict of another optimizer or model?)")
    by_name = {g.get("name"): g for g in saved}
    for g in groups:
        theirs = by_name.get(g.get("name"))
        if theirs is None:
            continue
        where = f"param_groups[{g.get('name')!r}]"
        for k in _STORAGE_DTYPES:
            if k in theirs:
                try:
                    if k == "adamw_state_dtype":
                        check_adamw_state_dtype(theirs[k])
                    else:
                        check_state_dtype(theirs[k], k)
                except ValueError as e:
                    problems.append(f"{where}: {e}")
        merged = {**hparams(g), **loadable_hparams(theirs)}
        check = {"muon": check_muon_group, "adamw": check_adamw_group}.get(g.get("name"))
        try:
            if check is not None:
                check(merged)
        except (TypeError, ValueError) as e:
            problems.append(f"{where}: {e}")
    vs = entries.get("variant_scalars")
    if scalars is not None and vs is not None:
        ok = isinstance(vs, Sequence) and len(vs) == scalars and all(
            not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
            for x in vs)
        if not ok:
            problems.append(f"variant_scalars: {vs!r} is not {scalars} finite numbers (the "
                            f"counts of this optimizer's transform state: {scalars}; a checkpoint "
                            "of a dmuon.Muon built with another transform= chain?)")
    return problems


def _sizes(groups: Sequence[Mapping[str, Any]]) -> list[int]:
    return [len(g.get("params", ())) for g in groups]
