"""The routing table, fail closed: every param → Muon (with its view) / AdamW / frozen and what
decided it; a rule that matches nothing, a view rule whose params all end on AdamW, and a param
the policy calls a Muon matrix that ends on AdamW raise (unless opted out); ``hf_rules``' generic
rules may match nothing. The distributed table (owners, ``dmuon.Muon.routing_table()``) is checked
in tests/test_variants_distributed.py, the HF Trainer recipe's log of it in
tests/test_recipes_trainer.py."""
from __future__ import annotations

import pytest

from dmuon.functional.hf_policy import hf_rules
from dmuon.functional.matrix_view import Heads
from dmuon.functional.policy import ParamPolicy, Rule
from dmuon.functional.routing import routing_table
from dmuon.functional.policy import decide_params, routing_predicate
from models import make_model, muon_predicate


def _table(model, predicate=muon_predicate, policy=ParamPolicy()):
    pick = routing_predicate(policy, predicate)
    chosen = {n: p for n, p in model.named_parameters() if p.requires_grad and pick(n, p)}
    decisions = decide_params(model, chosen, policy, None)
    return routing_table([(n, tuple(p.shape), p.requires_grad)
                          for n, p in model.named_parameters()], policy, decisions)


def test_every_param_with_its_route_view_and_reason():
    model = make_model()
    model.layers[1].mlp.down_proj.weight.requires_grad_(False)
    policy = ParamPolicy(rules=(Rule("*.self_attn.q_proj.weight", view=Heads(2)),
                                Rule("*.mlp.up_proj.weight", route="adamw")))
    table = _table(model, policy=policy)
    rows = {r.name: r for r in table.rows}
    assert set(rows) == {n for n, _ in model.named_parameters()}
    q = rows["layers.0.self_attn.q_proj.weight"]
    assert (q.route, q.view) == ("muon", "heads(2,rows)")
    assert q.decided_by == "predicate; rule 0: *.self_attn.q_proj.weight"
    assert rows["layers.0.self_attn.k_proj.weight"].decided_by == "predicate; default view"
    assert rows["layers.0.mlp.up_proj.weight"].route == "adamw"
    assert rows["layers.0.mlp.up_proj.weight"].decided_by == "rule 1 (*.mlp.up_proj.weight)"
    assert (rows["embed_tokens.weight"].route, rows["embed_tokens.weight"].decided_by) == \
        ("adamw", "predicate")
    assert rows["layers.1.mlp.down_proj.weight"].route == "frozen"
    text = str(table.with_owners({"layers.0.self_attn.q_proj.weight": 1}))
    assert text.splitlines()[0].startswith("dmuon routing: ")
    assert any("q_proj" in line and " 1 " in line for line in text.splitlines())


def test_a_rule_that_matches_nothing_raises():
    with pytest.raises(ValueError, match=r"rule 0 \('\*.self_atn.q_proj.weight'\) matches no"):
        _table(make_model(), policy=ParamPolicy(rules=(Rule("*.self_atn.q_proj.weight",
                                                             view=Heads(2)),)))
    # hf_rules' generic rules (fused projections the model does not have) are optional
    cfg = {"hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 24}
    _table(make_model(), policy=ParamPolicy(rules=hf_rules(cfg, per_head=True)))


def test_a_rule_shadowed_by_an_earlier_one_raises():
    """The first matching rule decides a param whole: a later rule whose every param an earlier
    rule matches first would silently decide nothing (a user's override behind a wildcard)."""
    model = make_model()
    for later in (Rule("layers.1.mlp.up_proj.weight", route="adamw"),
                  Rule("layers.1.mlp.up_proj.weight", lr_mult=3.0)):
        policy = ParamPolicy(rules=(Rule("*.mlp.up_proj.weight", lr_mult=0.5), later))
        with pytest.raises(ValueError, match=r"rule 1 .* an earlier rule matches each of them "
                                             r"first \(rule\(s\) \[0\]"):
            _table(model, policy=policy)
        ok = ParamPolicy(rules=(later, Rule("*.mlp.up_proj.weight", lr_mult=0.5)))
        assert {r.name: r.route for r in _table(model, policy=ok).rows}[
            "layers.1.mlp.up_proj.weight"] == ("adamw" if later.route else "muon")
    # partly shadowed (it decides layers.0's): fine; optional rules may be shadowed
    _table(model, policy=ParamPolicy(rules=(Rule("layers.1.mlp.up_proj.weight", lr_mult=2.0),
                                            Rule("*.mlp.up_proj.weight", lr_mult=0.5))))
    _table(model, policy=ParamPolicy(rules=(Rule("*.mlp.up_proj.weight", lr_mult=0.5),
                                            Rule("layers.1.mlp.up_proj.weight", lr_mult=2.0,
                                                 optional=True))))


def test_a_declared_muon_matrix_on_adamw_raises_unless_opted_out():
    def no_q(n, p):
        return muon_predicate(n, p) and "q_proj" not in n

    declared = ParamPolicy(rules=(Rule("*.q_proj.weight", view=Heads(2)),))
    with pytest.raises(ValueError, match="view heads.*goes to AdamW|end on AdamW"):
        _table(make_model(), predicate=no_q, policy=declared)
    eligible = ParamPolicy(eligible=lambda n, s: len(s) == 2 and n.startswith("layers."))
    with pytest.raises(ValueError, match=r"end on AdamW: 'layers.0.self_attn.q_proj.weight'"):
        _table(make_model(), predicate=no_q, policy=eligible)
    opted = ParamPolicy(rules=(Rule("*.q_proj.weight", route="adamw"),),
                        eligible=eligible.eligible)
    table = _table(make_model(), predicate=no_q, policy=opted)
    assert "layers.0.self_attn.q_proj.weight" in table.of("adamw")
