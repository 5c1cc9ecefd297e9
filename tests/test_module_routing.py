"""Default routing looks at the module, not only the name (issue 46): with
``dmuon.functional.specs.default_muon_predicate``, an ``nn.Embedding`` named ``tok`` (and a weight
tied to it, whichever name comes first) and an output head named ``out`` (a root ``nn.Linear``
whose ``out_features`` is the embedding's ``num_embeddings``) go to AdamW, the routing table says
why, and the head is logged as a likely head. An explicit rule routing the head to Muon, or an
explicit predicate selecting the embedding, is honored (the latter with a warning).

One spawn of 2 gloo ranks (fp64) trains every variant 3 steps; the parent compares each with one
process (:class:`user_paths_harness.RefMuon`, the reference routing given explicitly)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from models import make_batches
from user_paths_harness import TOL, RefMuon

VOCAB, DIM, STEPS, BATCH, WORLD = 24, 8, 3, 4, 2


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(DIM, 2 * DIM)
        self.down = torch.nn.Linear(2 * DIM, DIM)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class TokModel(torch.nn.Module):
    """``tok`` (Embedding), ``layers.N`` blocks, ``out`` (Linear(DIM, VOCAB), the head); ``tie``:
    ``"tok"`` ties the head to the embedding (``tok.weight`` named first), ``"out"`` builds the
    head first, so the tied weight's first name is ``out.weight`` (a Linear's)."""

    def __init__(self, tie=None):
        super().__init__()
        if tie == "out":
            self.out = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(_Block() for _ in range(2))
        if tie != "out":
            self.out = torch.nn.Linear(DIM, VOCAB, bias=False)
        if tie == "tok":
            self.out.weight = self.tok.weight
        elif tie == "out":
            self.tok.weight = self.out.weight

    def forward(self, ids):
        h = self.tok(ids)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), ids.roll(1, -1).flatten())


def _make(tie):
    torch.manual_seed(3)
    return TokModel(tie).double()


def _blocks_only(n, p):
    return p.ndim == 2 and n.startswith("layers.")


def _head_too(n, p):
    return _blocks_only(n, p) or n == "out.weight"


def _every_matrix(n, p):
    return p.ndim == 2


# variant: (tie, predicate of the dedication ("default" or a function), policy rules, reference)
VARIANTS = {
    "untied": (None, "default", (), _blocks_only),
    "tied_tok_first": ("tok", "default", (), _blocks_only),
    "tied_out_first": ("out", "default", (), _blocks_only),
    "rule_routes_head_to_muon": (None, "default", (("out.weight", "muon"),), _head_too),
    "predicate_selects_embedding": (None, _every_matrix, (), _every_matrix),
}


def _train(model, opt, rank, dist):
    for ids in make_batches(STEPS, BATCH, vocab=VOCAB):
        opt.zero_grad()
        for r in ([rank] if dist else range(WORLD)):
            loss = model(ids.chunk(WORLD)[r])
            (loss if dist else loss / WORLD).backward()
        opt.step()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _worker(rank, world):
    import dmuon
    from dmuon.functional.policy import ParamPolicy, Rule
    from dmuon.functional.specs import default_muon_predicate
    from stateful_harness import HP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    records = _Records()
    logging.getLogger("dmuon").addHandler(records)
    logging.getLogger("dmuon").setLevel(logging.INFO)
    out = {}
    for key, (tie, pred, rules, _) in VARIANTS.items():
        records.lines.clear()
        model = _make(tie)
        mesh = init_device_mesh("cpu", (world,))
        policy = ParamPolicy(rules=tuple(Rule(p, route=r) for p, r in rules))
        ded = dmuon.dedicate_params(
            model, mesh, default_muon_predicate if pred == "default" else pred,
            options=dmuon.DedicateOptions(policy=policy))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                         weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                         ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"],
                         adamw_betas=HP["adamw_betas"], adamw_eps=HP["adamw_eps"],
                         adamw_weight_decay=HP["adamw_weight_decay"])
        _train(model, opt, rank, True)
        out[key] = {"sd": dmuon.get_model_state_dict(model),
                    "rows": {r.name: (r.route, r.decided_by) for r in ded.routing.rows},
                    "log": list(records.lines)}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD, timeout=120)


def _reference(key):
    tie, _, _, ref_pred = VARIANTS[key]
    model = _make(tie)
    _train(model, RefMuon(model, ref_pred), 0, False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("key", list(VARIANTS))
def test_training_equals_one_process_with_the_module_aware_routing(results, key):
    ref = _reference(key)
    for rank, r in enumerate(results):
        assert set(r[key]["sd"]) == set(ref), key
        worst = max(float((r[key]["sd"][k] - v).abs().max()) for k, v in ref.items())
        assert worst <= TOL, f"{key} rank {rank}: max abs diff {worst:.3g}"


def test_routing_table_and_log_say_why(results):
    for r in results:
        rows = r["untied"]["rows"]
        assert rows["tok.weight"][0] == "adamw" and "nn.Embedding" in rows["tok.weight"][1]
        assert rows["out.weight"][0] == "adamw" and "likely output head" in rows["out.weight"][1]
        assert "'tok'" in rows["out.weight"][1] and str(VOCAB) in rows["out.weight"][1]
        assert rows["layers.0.up.weight"] == ("muon", "predicate; default view")
        assert any(level == "WARNING" and "out.weight" in msg and "likely output head" in msg
                   for level, msg in r["untied"]["log"]), r["untied"]["log"]
        for key in ("tied_tok_first", "tied_out_first"):  # one row: the tied weight's first name
            tied = r[key]["rows"]
            name = "tok.weight" if key == "tied_tok_first" else "out.weight"
            assert tied[name][0] == "adamw" and "nn.Embedding" in tied[name][1], (key, tied)
        # an explicit rule overrides the default; an explicit predicate is followed, with a warning
        ruled = r["rule_routes_head_to_muon"]["rows"]
        assert ruled["out.weight"] == ("muon", "rule 0 (out.weight); default view")
        assert ruled["tok.weight"][0] == "adamw"
        chosen = r["predicate_selects_embedding"]
        assert chosen["rows"]["tok.weight"][0] == "muon"
        assert "nn.Embedding" in chosen["rows"]["tok.weight"][1]
        assert any(level == "WARNING" and "tok.weight" in msg and "nn.Embedding" in msg
                   for level, msg in chosen["log"]), chosen["log"]


# ----------------------------------------------------------------------- pure (no processes)
class _Bertish(torch.nn.Module):
    """Position embeddings as wide as the blocks (BERT-small: 512 and 512): a block's Linear of
    that width is no head; a root Linear of the vocabulary's width is."""

    def __init__(self):
        super().__init__()
        self.word = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Embedding(DIM, DIM)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(DIM, DIM)])
        self.cls = torch.nn.Linear(DIM, VOCAB)


def test_off_muon_by_module_pure():
    from dmuon.functional.module_routes import module_aware, off_muon, param_uses
    from dmuon.functional.specs import default_muon_predicate
    from dmuon.tools.model_specs import specs_from_model

    off = off_muon(param_uses(TokModel()))
    assert {n: o.kind for n, o in off.items()} == {"tok.weight": "embedding", "out.weight": "head"}
    off = off_muon(param_uses(TokModel("out")))  # tied, the Linear's name first
    assert {n: o.kind for n, o in off.items()} == {"out.weight": "embedding"}
    assert "also 'tok.weight'" in off["out.weight"].why
    off = off_muon(param_uses(_Bertish()))
    assert {n: o.kind for n, o in off.items()} == {"word.weight": "embedding", "pos.weight":
                                                  "embedding", "cls.weight": "head"}
    model = TokModel()
    off = off_muon(param_uses(model))
    pick = module_aware(default_muon_predicate, off)
    assert [n for n, p in model.named_parameters() if pick(n, p)] == \
        [n for n, p in model.named_parameters() if _blocks_only(n, p)]
    assert module_aware(_every_matrix, off) is _every_matrix  # another predicate: as given
    specs, _ = specs_from_model(model)  # `dmuon plan`'s specs route the same way
    assert {s.name for s in specs if s.route == "muon"} == \
        {n for n, p in model.named_parameters() if _blocks_only(n, p)}


class _BertLike(torch.nn.Module):
    """BERT-shaped: word (vocabulary 40), position (16 = hidden 16) and token-type (2) embeddings,
    blocks under ``encoder.layer.N``, a pooler and a transform as wide as the positions, a 2-class
    ``cls`` head and a vocabulary-sized ``decoder`` (``tie``: tied to ``word``)."""

    def __init__(self, tie=False):
        super().__init__()
        hidden = 16
        self.word = torch.nn.Embedding(40, hidden)
        self.pos = torch.nn.Embedding(hidden, hidden)
        self.tt = torch.nn.Embedding(2, hidden)
        self.encoder = torch.nn.Module()
        self.encoder.layer = torch.nn.ModuleList(_Block() for _ in range(2))
        self.pooler = torch.nn.Linear(hidden, hidden)
        self.cls_transform = torch.nn.Linear(hidden, hidden)
        self.cls = torch.nn.Linear(hidden, 2)
        self.decoder = torch.nn.Linear(hidden, 40, bias=False)
        if tie:
            self.decoder.weight = self.word.weight


class _SequentialTrunk(torch.nn.Module):
    """A trunk ``nn.Sequential`` (``stack.N``, no ``layers.N`` name) as wide as the position
    embedding, then a head to the vocabulary (``vocab``: 40, or 8 < hidden 16 as a character-level
    model's)."""

    def __init__(self, vocab=40):
        super().__init__()
        self.word = torch.nn.Embedding(vocab, 16)
        self.pos = torch.nn.Embedding(16, 16)
        self.stack = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        self.out = torch.nn.Linear(16, vocab)


def test_only_vocabulary_sized_linears_are_heads_pure():
    from dmuon.functional.module_routes import off_muon, param_uses

    tables = {"word.weight": "embedding", "pos.weight": "embedding", "tt.weight": "embedding"}
    off = off_muon(param_uses(_BertLike()))
    assert {n: o.kind for n, o in off.items()} == {**tables, "decoder.weight": "head"}
    assert "'word'" in off["decoder.weight"].why
    off = off_muon(param_uses(_BertLike(tie=True)))
    assert {n: o.kind for n, o in off.items()} == tables
    for vocab in (40, 8):  # a head narrower than the width (character-level) is a head too
        off = off_muon(param_uses(_SequentialTrunk(vocab)))
        assert {n: o.kind for n, o in off.items()} == {
            "word.weight": "embedding", "pos.weight": "embedding", "out.weight": "head"}, vocab
    positions_first = torch.nn.ModuleDict({"pos": torch.nn.Embedding(16, 16),
                                           "word": torch.nn.Embedding(40, 16),
                                           "pooler": torch.nn.Linear(16, 16),
                                           "head": torch.nn.Linear(16, 40)})
    off = off_muon(param_uses(positions_first))  # the vocabulary is the largest table then
    assert {n: o.kind for n, o in off.items()} == {
        "pos.weight": "embedding", "word.weight": "embedding", "head.weight": "head"}
