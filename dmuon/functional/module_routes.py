"""Default routing that looks at the module, not only the name (pure, reads a model only).

:func:`~dmuon.functional.specs.default_muon_predicate` reads names (``embed``, ``lm_head``, ...):
alone, it would orthogonalize an ``nn.Embedding`` named ``tok`` and a head named ``out`` or
``output`` (torchtitan's Llama). With it, ``dedicate_params`` (and
:func:`dmuon.tools.model_specs.specs_from_model`) also keep off Muon, whatever their names:

* a weight of an ``nn.Embedding`` (or ``nn.EmbeddingBag``) under any of its names: a head tied to
  the embedding too, whichever of its names ``named_parameters()`` gives first;
* a likely output head: the weight of an ``nn.Linear`` outside every ``layers.N`` block
  (:func:`~dmuon.functional.specs.layer_key_from_name`) whose ``out_features`` is an embedding's
  ``num_embeddings``. Outside blocks only, as a position or token-type embedding's size can equal a
  block's width (BERT: 512 positions, hidden 512). ``dedicate_params`` logs each such head.

The routing table's "decided by" says why (``default predicate: nn.Embedding 'tok'``). Any other
predicate is followed as given, with a logged warning when it puts such a param on Muon; a policy
rule that sets a route overrides both (``Rule("out.weight", route="muon")``).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

from dmuon.functional.specs import default_muon_predicate, layer_key_from_name

__all__ = ["ParamUse", "OffMuon", "param_uses", "off_muon", "module_aware", "module_reasons",
           "module_notes", "route_with_modules"]


class ParamUse(NamedTuple):
    """One module holding a param: the param's ``name`` there, the module's path, its ``kind``
    (``"embedding"`` / ``"linear"`` for its ``weight``, else ``"other"``) and ``size`` (an
    embedding's ``num_embeddings``, a linear's ``out_features``)."""

    name: str
    module: str
    kind: str
    size: Optional[int]


class OffMuon(NamedTuple):
    """Why the default predicate keeps a param off Muon: ``kind`` (``"embedding"`` / ``"head"``)
    and ``why`` (for the routing table and the log)."""

    kind: str
    why: str


def _kind(module: Any) -> tuple[str, Optional[int]]:
    import torch.nn as nn

    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding", int(module.num_embeddings)
    if isinstance(module, nn.Linear):
        return "linear", int(module.out_features)
    return "other", None


def param_uses(model: Any) -> dict[str, tuple[ParamUse, ...]]:
    """``{name: every module holding it}`` for each param of the ``nn.Module`` ``model``, keyed
    by its ``named_parameters()`` name (a tied param once). Reads the model only."""
    first = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, list[ParamUse]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        kind, size = _kind(m)
        for local, p in m.named_parameters(recurse=False):
            if id(p) in first:
                out.setdefault(first[id(p)], []).append(ParamUse(
                    f"{path}.{local}" if path else local, path,
                    kind if local == "weight" else "other", size))
    return {n: tuple(us) for n, us in out.items()}


def off_muon(uses: Mapping[str, tuple[ParamUse, ...]]) -> dict[str, OffMuon]:
    """``{name: OffMuon}`` of the params the default predicate keeps off Muon (module docstring).
    """
    vocab: dict[int, str] = {}  # num_embeddings -> the first embedding module of that size
    for us in uses.values():
        for u in us:
            if u.kind == "embedding":
                vocab.setdefault(u.size, u.module)
    out: dict[str, OffMuon] = {}
    for name, us in uses.items():
        emb = next((u for u in us if u.kind == "embedding"), None)
        head = next((u for u in us if u.kind == "linear" and u.size in vocab
                     and layer_key_from_name(u.name) is None), None)
        if emb is not None:
            tied = "" if emb.name == name else f" (tied: also {emb.name!r})"
            out[name] = OffMuon("embedding", f"nn.Embedding {emb.module!r}{tied}")
        elif head is not None:
            out[name] = OffMuon("head", f"likely output head: {head.module!r} has out_features "
                                        f"{head.size} = num_embeddings of {vocab[head.size]!r}")
    return out


def module_aware(predicate: Any, off: Mapping[str, OffMuon]) -> Any:
    """The predicate to select with: :func:`~dmuon.functional.specs.default_muon_predicate` also
    keeps ``off``'s params off Muon; any other predicate is the user's, as given."""
    if predicate is not default_muon_predicate or not off:
        return predicate

    def default_by_module(name: str, p: Any) -> bool:
        return name not in off and default_muon_predicate(name, p)
    return default_by_module


def module_reasons(predicate: Any, off: Mapping[str, OffMuon], muon: Any) -> dict[str, str]:
    """``{name: "decided by" text}`` of the params whose route the predicate decided (no rule) and
    whose module matters: kept off Muon by the default predicate, or put on Muon (``muon``: the
    names on Muon) by another predicate."""
    if predicate is default_muon_predicate:
        return {n: f"default predicate: {o.why}" for n, o in off.items() if n not in muon}
    return {n: f"predicate, though {o.why}" for n, o in off.items() if n in muon}


def module_notes(predicate: Any, off: Mapping[str, OffMuon], muon: Any) -> tuple[str, ...]:
    """The warnings ``dedicate_params`` logs: each likely head the default predicate kept off
    Muon; each embedding or likely head another predicate put on Muon (``muon``: as above)."""
    if predicate is default_muon_predicate:
        return tuple(
            f"dmuon: {n!r} goes to AdamW, not Muon: {o.why} (default_muon_predicate). If it is "
            f"not an output head, route it to Muon with a policy rule: Rule({n!r}, route='muon')"
            for n, o in off.items() if o.kind == "head" and n not in muon)
    return tuple(
        f"dmuon: the predicate puts {n!r} on Muon, though it is a {o.why}; embeddings and output "
        "heads usually train with AdamW. Followed as given; if not meant, use "
        f"dmuon.functional.specs.default_muon_predicate or Rule({n!r}, route='adamw')"
        for n, o in off.items() if n in muon)


def route_with_modules(model: Any, predicate: Callable[[str, Any], bool]
                       ) -> tuple[Callable[[str, Any], bool], dict[str, OffMuon]]:
    """``(module_aware(predicate, off), off)`` for the ``nn.Module`` ``model``."""
    off = off_muon(param_uses(model))
    return module_aware(predicate, off), off
