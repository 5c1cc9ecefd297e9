"""Which params ``dedicate_params`` dedicates: its predicate applied to the trainable params, and
the checks of that selection (pure; the stateful setup agrees the verdict across ranks and acts)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = ["select_params", "check_meta_selection", "check_materialized", "names_by_object",
           "canonical_names", "tied_names"]


def select_params(named: Sequence[tuple[str, Any]], predicate: Callable[[str, Any], bool],
                  model_name: str) -> dict[str, Any]:
    """``{name: param}`` of the trainable params ``named`` (tied params once) that ``predicate``
    picks, from a model of class ``model_name``.

    Raises:
      TypeError: ``predicate`` is not callable.  RuntimeError: it raised (naming the param).
      ValueError: it picks a non-matrix, or nothing; some picked params are on the meta device
        and others not (:func:`check_meta_selection`).
    """
    if not callable(predicate):
        raise TypeError("predicate must be a callable (name, param) -> bool")
    chosen: dict[str, Any] = {}
    for n, p in named:
        try:
            picked = bool(predicate(n, p))
        except Exception as e:
            raise RuntimeError(
                f"dedicate_params: the predicate raised {type(e).__name__}: {e} for param {n!r} "
                f"(shape {tuple(p.shape)}, {p.dtype}). It is called as predicate(name, param) for "
                "every trainable parameter and must return a bool for each; fix it.") from e
        if not picked:
            continue
        if p.ndim < 2:
            raise ValueError(
                f"dedicate_params: the predicate selected {n!r} of shape {tuple(p.shape)}, which is "
                "not a matrix; Muon needs ndim >= 2. Add `p.ndim >= 2` (or `p.ndim == 2`) to the "
                "predicate so vectors stay with AdamW.")
        chosen[n] = p
    if not chosen:
        raise ValueError(
            f"dedicate_params: the predicate matched no trainable parameter of {model_name} "
            f"({len(named)} candidates, e.g. {[n for n, _ in named[:4]]}). Check the names it tests, "
            "e.g. predicate=lambda n, p: p.ndim == 2 and 'proj' in n.")
    check_meta_selection(chosen)  # all on meta (meta-device init) or none
    return chosen


def check_meta_selection(chosen: Mapping[str, Any]) -> bool:
    """Whether the dedicated params are on meta (all of them: True; none: False).

    Raises:
      ValueError: some are on meta and others not.
    """
    meta = [n for n, p in chosen.items() if p.is_meta]
    if meta and len(meta) != len(chosen):
        real = [n for n in chosen if n not in set(meta)]
        raise ValueError(
            f"dedicate_params: some selected params are on the meta device ({meta[:3]}) and "
            f"others are not ({real[:3]}). Build the whole model under torch.device('meta') "
            "(then dedicate_params, fully_shard, model.to_empty(...), init), or materialize it "
            "whole before dedicate_params.")
    return bool(meta)


def check_materialized(chosen: Mapping[str, Any]) -> None:
    """Finishing a deferred dedication: every selected param must hold values by now.

    Raises:
      RuntimeError: some are still on the meta device, naming them and the fix.
    """
    meta = [n for n, p in chosen.items() if p.is_meta]
    if meta:
        raise RuntimeError(
            f"dmuon.Muon(model): the selected matrices {meta[:4]}{' ...' if len(meta) > 4 else ''} "
            "are still on the meta device. With a deferred dedication (dedicate_params before "
            "tensor parallelism, or on a meta-device model) call model.to_empty(device=...) and the "
            "model's init (e.g. init_weights()) after fully_shard and before dmuon.Muon(model).")


def names_by_object(named: Iterable[tuple[str, Any]]) -> dict[int, list[str]]:
    """``{id(param): its names}`` of ``named`` (``named_parameters(remove_duplicate=False)``: a
    param tied across modules has several names, in module order)."""
    out: dict[int, list[str]] = {}
    for n, p in named:
        out.setdefault(id(p), []).append(n)
    return out


def canonical_names(named: Iterable[tuple[str, Any]], canonical: Mapping[str, Any]) -> dict[str, str]:
    """``{name: canonical name}`` for every entry of ``named`` that is (by identity) one of
    ``canonical``'s ``{canonical name: object}``; a tied object under each of its names."""
    canon = {id(p): n for n, p in canonical.items()}
    return {k: canon[id(p)] for k, p in named if id(p) in canon}


def tied_names(named: Iterable[tuple[str, Any]]) -> list[tuple[str, ...]]:
    """Groups of names in ``named`` that share one object (tied params / buffers)."""
    return [tuple(g) for g in names_by_object(named).values() if len(g) > 1]
