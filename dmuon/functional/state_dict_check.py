"""Pure checks and conversions for full (single-device style) checkpoints.

Two concerns, both free of ``torch.distributed`` and of any module:

* :func:`check_state_dict` compares what a state dict offers (``{key: shape}``) with what a model
  expects, with *tied* parameters (several names, one tensor) satisfied by any one of their names —
  HuggingFace ``save_pretrained`` drops the tied ``lm_head.weight``. It returns every missing,
  unexpected and wrong-shape entry at once, plus, for each expected key, the key to read it from.
* :func:`functional_states_from_full` / :func:`full_from_functional_states` convert between dmuon's
  topology-free optimizer state dict (the seeds' ``{"fsdp2": ..., "dedicated": ...}`` format) and the
  functional states :class:`~dmuon.functional.muon.MuonState` /
  :class:`~dmuon.functional.adamw.AdamWState`, so a checkpoint written by N ranks resumes in one
  process with :mod:`dmuon.functional` alone, and the other way round.
* :func:`model_state_problems` checks a full model state dict against the model's expected
  entries (its keys with :func:`check_state_dict`, then each value); :func:`value_problems`
  checks one value (a tensor of the expected shape, a float for a float,
  finite) and notes a precision change, which :func:`dtype_changes` words for the log;
  :func:`row_chunks` is the rows of each rank in dmuon's ``Shard(0)`` entries.
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
     "param_groups": [{"name": "muon", ...}, {"name": "adamw", ...}]}   # hyper-parameters
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Iterable, Mapping, NamedTuple, Optional, Sequence

import torch

from dmuon.functional.adamw import AdamWState
from dmuon.functional.muon import MuonState
from dmuon.functional.specs import dtype_from_str

__all__ = [
    "StateDictCheck",
    "check_state_dict",
    "model_state_problems",
    "functional_states_from_full",
    "full_from_functional_states",
    "value_problems",
    "missing_problems",
    "rewritten_entries",
    "dtype_changes",
    "row_chunks",
    "hparams",
    "full_entries",
    "full_dict_problems",
    "full_dict_structure",
    "to_torch_protocol",
    "from_torch_protocol",
    "field_problems",
    "optimizer_state_problems",
    "loadable_hparams",
    "all_finite",
    "live_views",
    "written_problems",
    "view_problems",
    "what_changed",
    "load_refusal",
]

#: AdamW's moments in a state entry
MOMENTS = ("exp_avg", "exp_avg_sq")
#: the full format's counters (checked by :mod:`dmuon.functional.load_scalars`)
COUNTERS = ("adamw_step", "muon_step", "num_steps")

Shape = tuple[int, ...]


class StateDictCheck(NamedTuple):
    """Outcome of :func:`check_state_dict`.

    Attributes:
      missing: expected keys (one per tied group: its first name) absent from the dict.
      unexpected: keys of the dict the model does not have.
      wrong: ``"key: shape (a, b), expected (c, d)"`` (or ``"key: not a tensor (...)"``) messages.
      source: ``expected key -> key of the dict to read it from`` for every expected key that can
        be filled (a tied name absent from the dict reads from a present alias).
    """

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    wrong: tuple[str, ...]
    source: Mapping[str, str]

    def problems(self, strict: bool = True) -> list[str]:
        """Human-readable problems: wrong entries always; missing / unexpected when ``strict``."""
        out = []
        if strict and self.missing:
            out.append(f"missing keys {list(self.missing)}")
        if strict and self.unexpected:
            out.append(f"unexpected keys {list(self.unexpected)}")
        if self.wrong:
            out.append("wrong entries: " + "; ".join(self.wrong))
        return out


def check_state_dict(given: Mapping[str, Optional[Shape]], expected: Mapping[str, Shape],
                     tied: Iterable[Sequence[str]] = ()) -> StateDictCheck:
    """Compare a state dict's keys and shapes with the model's.

    Args:
      given: ``{key: shape}`` of the dict to load; ``None`` (or a type name string) for an entry
        that is not a tensor.
      expected: ``{key: shape}`` of the model (single-device ``model.state_dict()`` spelling).
      tied: groups of expected keys that name one tensor (e.g. ``("model.embed_tokens.weight",
        "lm_head.weight")``); a group is satisfied by any one member, every present member must
        have the right shape.

    Returns:
      a :class:`StateDictCheck`; the caller decides which problems are fatal (``strict``).
    """
    alias: dict[str, tuple[str, ...]] = {}
    for group in tied:
        group = tuple(k for k in group if k in expected)
        for k in group:
            alias[k] = group
    wrong = []
    for k, shape in given.items():
        if k not in expected:
            continue
        if shape is None or isinstance(shape, str):
            wrong.append(f"{k}: not a tensor ({shape or 'unknown type'})")
        elif tuple(shape) != tuple(expected[k]):
            wrong.append(f"{k}: shape {tuple(shape)}, expected {tuple(expected[k])}")
    bad = {w.split(":", 1)[0] for w in wrong}
    missing, source = [], {}
    for k in expected:
        group = alias.get(k, (k,))
        present = [a for a in group if a in given and a not in bad]
        if present:
            source[k] = k if k in present else present[0]
        elif k == group[0] and not any(a in given for a in group):
            missing.append(k)
    unexpected = tuple(k for k in given if k not in expected)
    return StateDictCheck(tuple(missing), unexpected, tuple(wrong), source)


def model_state_problems(sd: Any, expected: Mapping[str, tuple[Shape, torch.dtype]],
                         tied: Iterable[Sequence[str]] = (), *, strict: bool = True,
                         finite: bool = True, notes: Optional[list] = None,
                         ) -> tuple[Optional[StateDictCheck], list[str]]:
    """The :class:`StateDictCheck` of a full model state dict ``sd`` (``None`` if it is not a
    mapping) and its problems: not a mapping; wrong entries, and missing / unexpected keys
    (``strict``); once those pass, each value's (:func:`value_problems`, read from its source; a
    DTensor is not a full value: :data:`SHARDED`).

    Args:
      expected: ``{key: (full shape, dtype)}`` of the model (single-device spelling).
      tied, strict: as for :func:`check_state_dict` and :meth:`StateDictCheck.problems`.
      finite, notes: as for :func:`value_problems`.
    """
    if not isinstance(sd, Mapping):
        return None, [f"expected a mapping {{name: tensor}}, got {type(sd).__name__}"]
    check = check_state_dict({k: tuple(v.shape) if isinstance(v, torch.Tensor) else
                              type(v).__name__ for k, v in sd.items()},
                             {k: s for k, (s, _) in expected.items()}, tied)
    problems = check.problems(strict)
    if not problems:  # values: dtype kinds, finiteness (before anything changes)
        for k, src in check.source.items():
            shape, dtype = expected[k]
            problems += value_problems(f"{src!r}", sd[src], shape, dtype, finite=finite,
                                       layout=SHARDED if hasattr(sd[src], "to_local") else None,
                                       notes=notes)
    return check, problems


#: a full model state dict's DTensor value (a sharded model's own ``state_dict()``)
SHARDED = ("a DTensor, not a full tensor (a sharded model's own state_dict()); pass full tensors "
           "(dmuon.get_model_state_dict(model)), or load that dict with model.load_state_dict(sd)")


def value_problems(key: str, value: Any, shape: Shape, dtype: torch.dtype, *,
                   finite: bool = True, layout: Optional[str] = None,
                   notes: Optional[list] = None) -> list[str]:
    """Problems of one state-dict value for a tensor of ``shape`` / ``dtype``: not a tensor, a
    wrong shape, a non-floating value for a floating tensor, ``layout`` (the caller's verdict on
    a DTensor's placements, when they do not fit), non-finite values (``finite``; a DTensor's
    local piece). A floating value of another precision loads (cast): ``notes`` collects
    ``(key, value dtype, dtype)`` for it (:func:`dtype_changes`)."""
    if not isinstance(value, torch.Tensor):
        return [f"{key}: a {type(value).__name__}, not a tensor"]
    if tuple(value.shape) != tuple(shape):
        return [f"{key}: shape {tuple(value.shape)}, expected {tuple(shape)}"]
    if dtype.is_floating_point and not (value.dtype.is_floating_point or value.is_complex()):
        return [f"{key}: dtype {value.dtype} cannot load into a {dtype} param (an integer or bool "
                "tensor is not a weight)"]
    if layout is not None:
        return [f"{key}: {layout}"]
    local = value.to_local() if hasattr(value, "to_local") else value
    problems = []
    if finite and not all_finite(local):
        problems.append(f"{key}: non-finite values (NaN/Inf)")
    if notes is not None and dtype.is_floating_point and local.dtype.is_floating_point and \
            local.dtype != dtype:
        notes.append((key, local.dtype, dtype))
    return problems


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: a floating tensor of any width (8-bit floats
    upcast: ``isfinite`` is not defined for them everywhere) and a complex one (both parts);
    integer and bool tensors are. The one finiteness check of every load."""
    if not (t.dtype.is_floating_point or t.is_complex()) or not t.numel():
        return True
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        t = t.float()
    return bool(torch.isfinite(t).all())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def live_views(values: Mapping[str, Any], live: Iterable[torch.Tensor]) -> list[str]:
    """The keys of ``values`` that are the ``live`` tensors themselves (or views of their storage;
    a DTensor by its local piece), whatever they hold: ``model.state_dict()`` (FSDP2's params) and
    ``opt.state_dict()`` (AdamW's moments) hand them out, and torch's ``dcp.load`` fills them in
    place before any load sees them."""
    ptrs = {_local(t).untyped_storage().data_ptr() for t in live if _local(t).numel()}
    return [k for k, v in values.items() if isinstance(v, torch.Tensor) and _local(v).numel()
            and _local(v).untyped_storage().data_ptr() in ptrs]


#: the problem line of a load whose values were written into the live state before it ran
ALREADY_WRITTEN = ("torch.distributed.checkpoint.load (dcp.load) already wrote these values into "
                   "the live tensors before this call: model.state_dict() and opt.state_dict() "
                   "hold FSDP2's params and AdamW's moments as views of the live state, which "
                   "dcp.load fills in place")

#: the line of a refused load given live views (:func:`live_views`) that hold finite values
LIVE_VIEWS = ("these values are the live tensors themselves (model.state_dict() and "
              "opt.state_dict() hold FSDP2's params and AdamW's moments as views of the live "
              "state)")


def written_problems(keys: Sequence[str]) -> list[str]:
    """``[]``, or the one :data:`ALREADY_WRITTEN` line naming ``keys`` (:func:`view_problems`)."""
    return [f"{ALREADY_WRITTEN} ({len(keys)}, e.g. {list(keys)[:3]})"] if keys else []


def missing_problems(keys: Sequence[str]) -> list[str]:
    """The problems of a strict ``model.load_state_dict(sd)`` whose dict lacks the param entries
    ``keys`` (torch loads every other entry, then raises, and only where the dict lacks them)."""
    return [f"{k}: missing from the dict (load_state_dict(strict=True) loads every param; pass "
            "the full dict, or strict=False to load the others)" for k in keys]


def rewritten_entries(count: int, key: str, by: str) -> str:
    """The error of dmuon's own state-dict functions when ``count`` dedicated entries (e.g.
    ``key``) are rewritten by the state-dict hooks of ``by`` (a module, as ``'name' (Class)``)."""
    return (f"dmuon's own state-dict functions (dmuon.get_model_state_dict / "
            f"set_model_state_dict, dmuon's sharded checkpoints) read dedicated params by name, but "
            f"{count} dedicated entries (e.g. {key!r}) are rewritten by the state-dict hooks of "
            f"{by} (e.g. a fused matrix saved as its parts). Use torch's model.state_dict() / "
            "model.load_state_dict(sd) (and everything built on them: torch.distributed.checkpoint, "
            "torchtitan's CheckpointManager), which include the dedicated matrices exactly in the "
            "layout those hooks write; or leave these params out of dedicate_params' predicate.")


def assign_problems(assign: bool, optimizer_built: bool, keys: Sequence[str]) -> list[str]:
    """``[]``, or the line refusing ``model.load_state_dict(sd, assign=True)`` of the FSDP2 params
    ``keys`` once a ``dmuon.Muon`` holds them: torch would put new param objects in the model,
    which that optimizer does not hold (they would silently stop training, the matrices not)."""
    if not (assign and optimizer_built and keys):
        return []
    return [f"assign=True would replace {len(keys)} FSDP2 param(s) (e.g. {list(keys)[:2]}) by "
            "new objects that the dmuon.Muon built on this model does not hold, so they would "
            "silently stop training; load with assign=False (the default: the values are "
            "copied), or build dmuon.Muon after this load"]


def view_problems(problems: list[str], views: Sequence[str]) -> list[str]:
    """``problems`` led, when they refuse a load given ``views`` (:func:`live_views`' keys), by
    what those views mean: :data:`ALREADY_WRITTEN` for the ones ``problems`` call non-finite,
    else one :data:`LIVE_VIEWS` line (:func:`what_changed` words the error from either)."""
    if not problems or not views:
        return problems
    written = [k for k in views if f"{k}: non-finite values (NaN/Inf)" in problems]
    lead = written_problems(written) or [f"{LIVE_VIEWS} ({len(views)}, e.g. {list(views)[:3]})"]
    return lead + problems


def what_changed(detail: str) -> str:
    """The sentence of a refused load's error that says what changed, from the agreed ``detail``:
    nothing, or (:data:`ALREADY_WRITTEN` in it) the live values ``dcp.load`` wrote, or
    (:data:`LIVE_VIEWS`) what ``dcp.load`` wrote if it filled those views."""
    if ALREADY_WRITTEN in detail:
        return ("This call changed nothing else, but those live params / moments hold what "
                "dcp.load wrote (non-finite values included): do not step; load a good checkpoint "
                "the same way (dcp.load, then load_state_dict) before training on. "
                "dmuon.save_sharded / load_sharded checkpoints are checked before anything is "
                "written.")
    if LIVE_VIEWS in detail:
        return ("Nothing was changed by this call on any rank; but if torch's dcp.load filled "
                "those live views, it already wrote the checkpoint's values into the live params "
                "/ moments: then do not step; load a good checkpoint the same way (dcp.load, then "
                "load_state_dict) before training on. dmuon.save_sharded / load_sharded "
                "checkpoints are checked before anything is written.")
    return "Nothing was changed on any rank."


#: what to do about a dict that does not fit (the end of a refused load's error), by route: what
#: every load wants (torch's ``load_state_dict`` routes take no options), then what dmuon's model
#: load (``strict``, ``check_finite``) and optimizer load (``check_finite``) can relax
_FIT = ("Load a dict saved from the same architecture (names and full shapes as in the "
        "single-device model.state_dict(), floating values, finite)")
LOAD_FIXES = {"torch": _FIT + ".",
              "model": _FIT + "; check_finite=False loads non-finite values, strict=False allows "
                              "missing / unexpected keys.",
              "optimizer": _FIT + "; dmuon.set_optimizer_state_dict(..., check_finite=False) "
                                  "loads non-finite values."}


def load_refusal(what: str, detail: str, route: str = "model") -> str:
    """The error of a refused load from the agreed ``detail``: what did not fit, what changed
    (:func:`what_changed`) and the fix for the ``route`` (a key of :data:`LOAD_FIXES`)."""
    return (f"{what}: the state dict does not match the model ({detail}). "
            f"{what_changed(detail)} {LOAD_FIXES[route]}")


def dtype_changes(what: str, notes: Sequence[tuple[str, torch.dtype, torch.dtype]]
                  ) -> list[tuple[bool, str]]:
    """The log lines of a load's precision changes (``notes`` of :func:`value_problems`), one per
    kind, as ``(warning, line)``: values narrower than their param (or of another 16-bit format)
    load at their own precision, a warning (the README's promise: allowed, and said); wider
    values are rounded, info."""
    def bits(d: torch.dtype) -> int:
        return torch.finfo(d).bits

    out = []
    for warn, words in ((True, "hold a narrower float than their param and load at their own "
                               "precision (the param's extra bits are zero)"),
                        (False, "are rounded to their param's narrower dtype")):
        entries = [n for n in notes if (bits(n[1]) <= bits(n[2])) == warn]
        if entries:
            kinds = ", ".join(sorted({f"{a} into {b}" for _, a, b in entries}))
            out.append((warn, f"dmuon: {what}: {len(entries)} value(s) {words}: {kinds} "
                              f"(e.g. {entries[0][0]})"))
    return out


def row_chunks(rows: int, parts: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each part's rows when ``rows`` are split as DTensor's ``Shard(0)``
    splits them over ``parts`` ranks (``torch.chunk``: equal chunks of ``ceil(rows / parts)``, the
    last ones shorter or empty)."""
    size = -(-rows // parts) if rows else 0
    out = []
    for i in range(parts):
        start = min(i * size, rows)
        out.append((start, max(0, min(size, rows - start))))
    return out


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
    for i, s in st.items():
        n = by_index.get(i, i if isinstance(i, str) else None)
        if n is None or not isinstance(s, Mapping):
            continue
        section, step = ("dedicated", "muon_step") if n in dedicated else ("fsdp2", "adamw_step")
        sections[section][n] = {k: v for k, v in s.items() if k != "step"}
        seen[step].append(s.get("step", 0))
    steps = {k: _one_step(v) for k, v in seen.items()}
    if groups and "num_steps" in groups[0]:
        steps["num_steps"] = groups[0]["num_steps"]
    return {**sections, **steps, "param_groups": [hparams(g) for g in groups],
            "variant_scalars": groups[0].get("variant_scalars") if groups else None}


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
