"""Default routing that looks at the module, not only the name (pure, reads a model only).

:func:`~dmuon.functional.specs.default_muon_predicate` reads names (``embed``, ``lm_head``, ...):
alone, it would orthogonalize an ``nn.Embedding`` named ``tok`` and a head named ``out`` or
``output`` (torchtitan's Llama). With it, ``dedicate_params`` (and
:func:`dmuon.tools.model_specs.specs_from_model`) also keep off Muon, whatever their names:

* a weight of an ``nn.Embedding`` (or ``nn.EmbeddingBag``) under any of its names: a head tied to
  the embedding too, whichever of its names ``named_parameters()`` gives first;
* a likely output head: the weight of an ``nn.Linear`` outside every ``layers.N`` block
  (:func:`~dmuon.functional.specs.layer_key_from_name`) that projects to the token vocabulary: its
  ``out_features`` is the ``num_embeddings`` of the model's first embedding (token tables come
  first: ``wte``, ``word_embeddings``) or of its largest, and it is not square. Only the
  vocabulary, as a token-type embedding's size can equal a classifier's (2 types, 2 classes); not
  square, as a position embedding's size can equal the width (BERT: 512 positions, hidden 512; a
  pooler is 512 -> 512). A vocabulary narrower than the width (a character-level model: 65 tokens,
  hidden 384) is still a head; a trunk matrix that happens to project to the vocabulary's size goes
  to AdamW too (the safe side, logged; ``Rule(name, route="muon")`` overrides).
  ``dedicate_params`` logs each such head.

The routing table's "decided by" says why (``default predicate: nn.Embedding 'tok'``). Any other
predicate is followed as given, with a logged warning when it puts such a param on Muon; a policy
rule that sets a route overrides both (``Rule("out.weight", route="muon")``).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

from dmuon.functional.selection import names_by_object
from dmuon.functional.specs import default_muon_predicate, layer_key_from_name

__all__ = ["ParamUse", "OffMuon", "param_uses", "off_muon", "module_aware", "module_reasons",
           "module_notes", "route_with_modules"]


class ParamUse(NamedTuple):
    """One module holding a param: the param's ``name`` there, the module's path, its ``kind``
    (``"embedding"`` / ``"linear"`` for its ``weight``, else ``"other"``), ``size`` (an
    embedding's ``num_embeddings``, a linear's ``out_features``) and ``fan_in`` (a linear's
    ``in_features``)."""

    name: str
    module: str
    kind: str
    size: Optional[int]
    fan_in: Optional[int] = None


class OffMuon(NamedTuple):
    """Why the default predicate keeps a param off Muon: ``kind`` (``"embedding"`` / ``"head"``)
    and ``why`` (for the routing table and the log)."""

    kind: str
    why: str


def _kind(module: Any) -> tuple[str, Optional[int], Optional[int]]:
    import torch.nn as nn

    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding", int(module.num_embeddings), None
    if isinstance(module, nn.Linear):
        return "linear", int(module.out_features), int(module.in_features)
    return "other", None, None


def param_uses(model: Any) -> dict[str, tuple[ParamUse, ...]]:
    """``{name: every module holding it}`` for each param of the ``nn.Module`` ``model``, keyed
    by its ``named_parameters()`` name (a tied param once). Reads the model only."""
    modules = dict(model.named_modules(remove_duplicate=False))
    out: dict[str, tuple[ParamUse, ...]] = {}
    for names in names_by_object(model.named_parameters(remove_duplicate=False)).values():
        uses = []
        for n in names:
            path, _, local = n.rpartition(".")
            kind, size, fan_in = _kind(modules[path])
            uses.append(ParamUse(n, path, kind if local == "weight" else "other", size,
                                 fan_in if local == "weight" else None))
        out[names[0]] = tuple(uses)
    return out


def off_muon(uses: Mapping[str, tuple[ParamUse, ...]]) -> dict[str, OffMuon]:
    """``{name: OffMuon}`` of the params the default predicate keeps off Muon (module docstring).
    """
    tables = [u for us in uses.values() for u in us if u.kind == "embedding"]
    # the vocabulary: the first embedding (token tables come first: wte, word_embeddings,
    # tok_embeddings) and the largest one (a model that registers positions first)
    vocab = {u.size: u for u in (tables[:1] + [max(tables, key=lambda u: u.size)] if tables else [])}
    out: dict[str, OffMuon] = {}
    for name, us in uses.items():
        emb = next((u for u in us if u.kind == "embedding"), None)
        head = next((u for u in us if u.kind == "linear" and u.size in vocab
                     and u.size != u.fan_in
                     and layer_key_from_name(u.name) is None), None)
        if emb is not None:
            tied = "" if emb.name == name else f" (tied: also {emb.name!r})"
            out[name] = OffMuon("embedding", f"nn.Embedding {emb.module!r}{tied}")
        elif head is not None:
            out[name] = OffMuon("head", f"likely output head: {head.module!r} has out_features "
                                        f"{head.size} = num_embeddings of {vocab[head.size].module!r} "
                                        f"(the vocabulary), in_features {head.fan_in}")
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
                       ) -> Callable[[str, Any], bool]:
    """``module_aware(predicate, off_muon(param_uses(model)))`` for the ``nn.Module`` ``model``."""
    return module_aware(predicate, off_muon(param_uses(model)))
