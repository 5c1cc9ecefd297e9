"""Pure checks of full (single-device style) model state dicts and of the values a load writes,
free of ``torch.distributed`` and of any module:

* :func:`check_state_dict` compares what a state dict offers (``{key: shape}``) with what a model
  expects, with *tied* parameters (several names, one tensor) satisfied by any one of their names —
  HuggingFace ``save_pretrained`` drops the tied ``lm_head.weight``. It returns every missing,
  unexpected and wrong-shape entry at once, plus, for each expected key, the key to read it from.
* :func:`model_state_problems` checks a full model state dict against the model's expected
  entries (its keys with :func:`check_state_dict`, then each value); :func:`value_problems`
  checks one value (a tensor of the expected shape, a float for a float,
  finite) and notes a precision change, which :func:`dtype_changes` words for the log;
  :func:`row_chunks` is the rows of each rank in dmuon's ``Shard(0)`` entries.

The optimizer's full format and torch's optimizer protocol: :mod:`dmuon.functional.optimizer_format`.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

import torch

__all__ = [
    "StateDictCheck",
    "check_state_dict",
    "model_state_problems",
    "value_problems",
    "strict_key_problems",
    "rewritten_entries",
    "dtype_changes",
    "row_chunks",
    "all_finite",
    "live_views",
    "written_problems",
    "view_problems",
    "what_changed",
    "load_refusal",
]

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


def strict_key_problems(missing: Sequence[str], unexpected: Sequence[str]) -> list[str]:
    """The problems of a strict ``model.load_state_dict(sd)`` whose dict lacks the entries
    ``missing`` or has the entries ``unexpected`` (torch loads every other entry, then raises,
    and only where the dict is so)."""
    fix = ("(load_state_dict(strict=True) takes exactly the model's entries; pass the model's "
           "dict, or strict=False to load the others)")
    return ([f"{k}: missing from the dict {fix}" for k in missing]
            + [f"{k}: not an entry of this model {fix}" for k in unexpected])


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
