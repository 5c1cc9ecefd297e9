"""dmuon's topology-free optimizer state dict (the seeds' ``{"fsdp2": ..., "dedicated": ...}``
format) and torch's optimizer protocol (pure, free of ``torch.distributed`` and of any module):

* :func:`functional_states_from_full` / :func:`full_from_functional_states` convert between that
  format and the functional states :class:`~dmuon.functional.muon.MuonState` /
  :class:`~dmuon.functional.adamw.AdamWState`, so a checkpoint written by N ranks resumes in one
  process with :mod:`dmuon.functional` alone, and the other way round.
* :func:`to_torch_protocol` / :func:`from_torch_protocol` convert between torch's optimizer
  protocol (``{"state": {index: entry}, "param_groups": [...]}``) and that format's sections and
  counters, so ``Muon.state_dict()`` / ``load_state_dict`` and dmuon's full format share one load
  path; :func:`optimizer_state_problems` checks that format's sections against an optimizer
  (:func:`field_problems`: a dedicated entry's fields), and :func:`loadable_hparams` picks a
  saved group's hyper-parameters for it.

The optimizer format (every tensor full, keyed by fully-qualified parameter name)::

    {"fsdp2":     {name: {"exp_avg": T, "exp_avg_sq": T}},   # AdamW moments (non-Muon params)
     "dedicated": {name: {"momentum_buffer": T,               # Muon momentum of each matrix
                          "master": T}},                      # only if the master is wider than
                                                              # the param (e.g. fp32 for bf16)
     "adamw_step": int, "muon_step": int, "num_steps": int,   # counters (AdamW bias correction)
     "adamw_skipped": {name: int},      # optional: the steps an AdamW param had no gradient at
                                        # (its torch.optim.AdamW count is adamw_step minus it)
     "param_groups": [{"name": "muon", ...}, {"name": "adamw", ...}]}   # hyper-parameters
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Mapping, Optional, Sequence

import torch

from dmuon.functional.adamw import AdamWState
from dmuon.functional.muon import MuonState
from dmuon.functional.specs import dtype_from_str
from dmuon.functional.state_dict_check import Shape, live_views, value_problems, view_problems

__all__ = ["MOMENTS", "COUNTERS", "SKIPPED", "functional_states_from_full",
           "full_from_functional_states",
           "hparams", "full_entries", "full_dict_problems", "full_dict_structure",
           "to_torch_protocol", "from_torch_protocol", "field_problems",
           "optimizer_state_problems", "loadable_hparams", "state_dict_with_hooks",
           "load_with_hooks"]

#: AdamW's moments in a state entry
MOMENTS = ("exp_avg", "exp_avg_sq")
#: the full format's counters (checked by :mod:`dmuon.functional.load_scalars`)
COUNTERS = ("adamw_step", "muon_step", "num_steps")
#: the full format's per-param AdamW skip counts (``dmuon.functional.adamw.update_per_param``)
SKIPPED = "adamw_skipped"


def functional_states_from_full(osd: Mapping[str, Any]) -> tuple[MuonState, AdamWState]:
    """Functional optimizer states from a full dmuon optimizer state dict (any topology).

    Args:
      osd: the dict of ``dmuon.get_optimizer_state_dict`` (or of ``dcp_to_torch_save`` on a
        ``dmuon.save_sharded`` checkpoint, its ``"optim"`` entry).

    Returns:
      ``(MuonState(step, momentum={name: buffer}), AdamWState(step, mu={name: exp_avg},
      nu={name: exp_avg_sq}))`` holding the dict's own tensors (no copies). Empty sections (a
      checkpoint taken before the first step) give empty dicts; ``dmuon.functional.muon.init`` /
      ``adamw.init`` give zero states for those.

    Raises:
      ValueError: the dict lacks the ``"fsdp2"`` / ``"dedicated"`` sections.
    """
    for key in ("fsdp2", "dedicated"):
        if not isinstance(osd.get(key), Mapping):
            raise ValueError(f"not a dmuon optimizer state dict: no {key!r} section (expected the "
                             "output of dmuon.get_optimizer_state_dict)")
    mom = {n: s["momentum_buffer"] for n, s in osd["dedicated"].items()}
    mu = {n: s["exp_avg"] for n, s in osd["fsdp2"].items()}
    nu = {n: s["exp_avg_sq"] for n, s in osd["fsdp2"].items()}
    return (MuonState(step=int(osd.get("muon_step", 0)), momentum=mom),
            AdamWState(step=int(osd.get("adamw_step", 0)), mu=mu, nu=nu))


def full_from_functional_states(muon_state: MuonState, adamw_state: AdamWState,
                                param_groups: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The inverse of :func:`functional_states_from_full`: a dict ``dmuon.set_optimizer_state_dict``
    loads at any topology (momentum / moments must be flat ``{name: full tensor}`` dicts).

    Args:
      muon_state: Muon state of the dedicated matrices.
      adamw_state: AdamW state of every other trainable param.
      param_groups: optional hyper-parameter dicts (``{"name": "muon" | "adamw", ...}``).

    Returns:
      the full optimizer state dict (references the states' tensors; no copies).
    """
    return {"fsdp2": {n: {"exp_avg": adamw_state.mu[n], "exp_avg_sq": adamw_state.nu[n]}
                      for n in adamw_state.mu},
            "dedicated": {n: {"momentum_buffer": b} for n, b in muon_state.momentum.items()},
            "adamw_step": int(adamw_state.step), "muon_step": int(muon_state.step),
            "num_steps": max(int(adamw_state.step), int(muon_state.step)),
            "param_groups": [dict(g) for g in param_groups]}


def hparams(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters: the group without its ``params`` / ``param_names``."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def full_entries(sd: Mapping[str, Any]) -> dict[str, Any]:
    """The load entries of a full dmuon optimizer state dict (its sections copied, its counters as
    given: :mod:`dmuon.functional.load_scalars` checks and reads them; a missing ``adamw_step`` /
    ``muon_step`` 0, a missing ``num_steps`` the larger of the two)."""
    steps = {k: sd.get(k, 0) for k in COUNTERS[:2]}
    if "num_steps" in sd:
        steps["num_steps"] = sd["num_steps"]
    return {"dedicated": dict(sd["dedicated"]), "fsdp2": dict(sd["fsdp2"]), **steps,
            SKIPPED: sd.get(SKIPPED) or {},
            "param_groups": sd.get("param_groups"), "variant_scalars": sd.get("variant_scalars")}


def full_dict_problems(sd: Any) -> list[str]:
    """Why ``sd`` is not dmuon's full optimizer dict (:func:`dmuon.get_optimizer_state_dict`'s:
    ``"fsdp2"`` and ``"dedicated"`` mappings), ``[]`` when it is."""
    if isinstance(sd, Mapping) and isinstance(sd.get("fsdp2"), Mapping) and \
            isinstance(sd.get("dedicated"), Mapping):
        return []
    return [f"expected dmuon.get_optimizer_state_dict's dict, got {type(sd).__name__}"]


def full_dict_structure(sd: Mapping[str, Any]) -> dict[str, Any]:
    """What a ``rank0_only`` load sends from rank 0 to every rank (with the verdict): the
    :func:`full_entries` of a full dict (:func:`full_dict_problems` ``[]``), the sections by
    their names (sorted; a dedicated matrix's entry by its keys) instead of their tensors."""
    return {**full_entries(sd), "fsdp2": sorted(sd["fsdp2"]),
            "dedicated": {n: sorted(s) for n, s in sd["dedicated"].items()}}


def to_torch_protocol(groups: Sequence[tuple[Mapping[str, Any], Sequence[str]]],
                      entries: Mapping[str, Mapping[str, Any]],
                      **first_group: Any) -> dict[str, Any]:
    """torch's optimizer protocol of named param ``groups`` (``(hyper-parameters, names)``) and
    their state ``entries`` (``{name: entry}``): params indexed in group order, each group with
    its ``params`` (indices) and ``param_names``, dtypes as strings (torch's tools take no
    dtypes); ``first_group``'s items (counters) end the first group."""
    state: dict[int, Mapping[str, Any]] = {}
    out = []
    index = 0
    for hp, names in groups:
        ids = list(range(index, index + len(names)))
        index += len(names)
        state.update(zip(ids, (entries[n] for n in names)))
        out.append({**{k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in hp.items()},
                    "params": ids, "param_names": list(names)})
    out[0].update(first_group)
    return {"state": state, "param_groups": out}


def from_torch_protocol(sd: Any, names: Sequence[str],
                        dedicated: Collection[str]) -> Optional[dict[str, Any]]:
    """The load entries (as :func:`full_entries`') of a dict in torch's optimizer protocol, or
    ``None`` when ``sd`` is not one. Params are matched by the groups' ``param_names`` where they
    carry them, else by position in ``names`` (the loading optimizer's params in group order);
    ``dedicated``: the names of the dedicated matrices (the others are AdamW's)."""
    groups, st = (sd.get("param_groups"), sd.get("state")) if isinstance(sd, Mapping) \
        else (None, None)
    if groups is None or st is None:
        return None
    by_index: dict[Any, str] = {}
    flat = 0
    for g in groups:
        given = g.get("param_names")
        for j, i in enumerate(g.get("params", ())):
            if given is not None:
                by_index[i] = given[j]
            elif flat < len(names):
                by_index[i] = names[flat]
            flat += 1
    sections: dict[str, dict[str, Any]] = {"dedicated": {}, "fsdp2": {}}
    seen: dict[str, list[Any]] = {"muon_step": [], "adamw_step": []}
    adamw: dict[str, Any] = {}
    for i, s in st.items():
        n = by_index.get(i, i if isinstance(i, str) else None)
        if n is None or not isinstance(s, Mapping):
            continue
        section, step = ("dedicated", "muon_step") if n in dedicated else ("fsdp2", "adamw_step")
        sections[section][n] = {k: v for k, v in s.items() if k != "step"}
        seen[step].append(s.get("step", 0))
        if step == "adamw_step":
            adamw[n] = s.get("step", 0)
    steps = {k: _one_step(v) for k, v in seen.items()}
    # torch.optim.AdamW's counts are per param: the largest is the group's, the rest skipped
    counts = {n: _integral(v) for n, v in adamw.items()}
    if isinstance(steps["adamw_step"], tuple) and None not in counts.values():
        top = max(counts.values())
        steps["adamw_step"] = top
        steps[SKIPPED] = {n: top - c for n, c in counts.items() if c != top}
    if groups and "num_steps" in groups[0]:
        steps["num_steps"] = groups[0]["num_steps"]
    return {**sections, **steps, "param_groups": [hparams(g) for g in groups],
            "group_sizes": [len(g.get("params", ())) for g in groups],
            "variant_scalars": groups[0].get("variant_scalars") if groups else None}


def _integral(v: Any) -> Optional[int]:
    """``v`` (a number or 1-element tensor) as an int when it is an integral value >= 0."""
    v = v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v >= 0 \
        and float(v).is_integer()
    return int(v) if ok else None


def _one_step(values: Sequence[Any]) -> Any:
    """The one ``step`` of a section's state entries (0 for none), or the tuple of their
    distinct values when they disagree (``load_scalars.load_problems`` names it)."""
    distinct: list[Any] = []
    for v in values:
        key = v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v
        if not any(key == d or (isinstance(key, float) and isinstance(d, float) and key != key
                                and d != d) for d in distinct):
            distinct.append(key)
    return 0 if not distinct else distinct[0] if len(distinct) == 1 else tuple(distinct)


def field_problems(name: str, entry: Any, fields: Sequence[str]) -> list[str]:
    """The chain's ``fields`` missing from the dedicated entry of matrix ``name``, and state keys
    the optimizer does not have: each a problem, never silently dropped."""
    if not isinstance(entry, Mapping):
        return [f"dedicated[{name!r}]: not a dict"]
    want = tuple(fields)
    out = [f"dedicated[{name!r}]: no {k!r} (saved by another transform= than this optimizer's?)"
           for k in want if k not in entry]
    out += [f"dedicated[{name!r}][{k!r}]: not a state of this optimizer (saved with another "
            "transform=? pass the same one)" for k in entry if k not in want + ("master", "step")]
    return out


def optimizer_state_problems(dedicated: Mapping[str, Any], fsdp2: Mapping[str, Any], *,
                             matrices: Mapping[str, Mapping[str, tuple[Shape, torch.dtype]]],
                             fields: Sequence[str],
                             adamw: Mapping[str, tuple[Shape, Shape, torch.dtype]],
                             finite: bool = True,
                             layout: Callable[[Any], Optional[str]] = lambda v: None,
                             notes: Optional[list] = None,
                             live: Optional[AdamWState] = None,
                             more: Sequence[str] = ()) -> list[str]:
    """Problems of an optimizer state's sections (the full format's) for one optimizer: unknown
    names, a dedicated entry's missing or foreign fields (:func:`field_problems`), each value
    (:func:`value_problems`), names missing from a non-empty section (an empty one: the state
    before the first step).

    Args:
      matrices: ``{name: {key: (full shape, dtype)}}`` of each dedicated matrix's state keys.
      fields: the chain's field keys (every dedicated entry holds them all).
      adamw: ``{name: (full shape, this rank's shape, dtype)}`` of AdamW's params: a moment is
        checked against the full shape unless it is a plain tensor of another (this rank's piece).
      layout: ``layout(value)``: a dedicated value's layout problem (a DTensor's), or ``None``.
      finite, notes: as for :func:`value_problems`.
      live: the optimizer's AdamW state: moments that are its own tensors (``opt.state_dict()``
        hands views of them) lead a refusal with what they mean (:func:`view_problems`).
      more: the caller's other problems of the same load (counters, hyper-parameters), last.
    """
    problems: list[str] = []
    for n, s in dedicated.items():
        if n not in matrices:
            problems.append(f"dedicated[{n!r}]: no such dedicated matrix")
            continue
        problems += field_problems(n, s, fields)
        for k, v in (s.items() if isinstance(s, Mapping) else ()):
            if k in matrices[n]:
                shape, dtype = matrices[n][k]
                problems += value_problems(f"dedicated[{n!r}][{k!r}]", v, shape, dtype,
                                           finite=finite, layout=layout(v), notes=notes)
    for n, s in fsdp2.items():
        if n not in adamw:
            problems.append(f"fsdp2[{n!r}]: no such AdamW param")
            continue
        full, local, dtype = adamw[n]
        for k in MOMENTS:
            v = s.get(k) if isinstance(s, Mapping) else None
            if v is None:
                problems.append(f"fsdp2[{n!r}]: no {k!r}")
                continue
            piece = isinstance(v, torch.Tensor) and not hasattr(v, "to_local") and \
                tuple(v.shape) != tuple(full)
            problems += value_problems(f"fsdp2[{n!r}][{k!r}]", v, local if piece else full,
                                       dtype, finite=finite, notes=notes)
    for section, given, want, kind in (("dedicated", dedicated, matrices, "matrices"),
                                       ("fsdp2", fsdp2, adamw, "params")):
        if given and set(given) != set(want):
            gone = sorted(set(want) - set(given))
            problems.append(f"{section}: {len(gone)} {kind} missing, e.g. {gone[:3]}")
    problems += more
    views = [] if live is None else live_views(
        {f"fsdp2[{n!r}][{k!r}]": s.get(k) for n, s in fsdp2.items() if isinstance(s, Mapping)
         for k in MOMENTS}, [*live.mu.values(), *live.nu.values()])
    return view_problems(problems, views)


#: keys of a saved param group a load never installs: structure, counters, and the storage dtypes
#: (each optimizer keeps its own; the state converts on load)
_NOT_LOADED = ("params", "param_names", "name", "num_steps", "variant_scalars", "momentum_dtype",
               "offload_state", "adamw_state_dtype")


def loadable_hparams(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The hyper-parameters of a saved param group that a load installs (:data:`_NOT_LOADED`
    left out), dtypes saved as strings (``"torch.float64"``) decoded."""
    def decoded(key: str, v: Any) -> Any:
        if key.endswith("dtype") and isinstance(v, str) and v.startswith("torch."):
            try:
                return dtype_from_str(v)
            except ValueError:
                return v
        return v

    return {k: decoded(k, v) for k, v in saved.items() if k not in _NOT_LOADED}


def state_dict_with_hooks(optimizer: Any, build: Callable[[], dict]) -> dict:
    """``build()``'s state dict, with ``optimizer``'s ``register_state_dict_pre_hook`` /
    ``_post_hook`` hooks run around it as ``torch.optim.Optimizer.state_dict`` runs them (a post
    hook's returned dict replaces the dict)."""
    for hook in getattr(optimizer, "_optimizer_state_dict_pre_hooks", {}).values():
        hook(optimizer)
    state_dict = build()
    for hook in getattr(optimizer, "_optimizer_state_dict_post_hooks", {}).values():
        out = hook(optimizer, state_dict)
        state_dict = state_dict if out is None else out
    return state_dict


def load_with_hooks(optimizer: Any, state_dict: dict, load: Callable[[dict], None]) -> None:
    """``load(state_dict)`` with ``optimizer``'s ``register_load_state_dict_pre_hook`` /
    ``_post_hook`` hooks run around it as ``torch.optim.Optimizer.load_state_dict`` runs them (a
    pre hook sees a shallow copy; its returned dict replaces the dict)."""
    pre = getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", {})
    if pre:
        state_dict = dict(state_dict)
    for hook in pre.values():
        out = hook(optimizer, state_dict)
        state_dict = state_dict if out is None else out
    load(state_dict)
    for hook in getattr(optimizer, "_optimizer_load_state_dict_post_hooks", {}).values():
        hook(optimizer)
