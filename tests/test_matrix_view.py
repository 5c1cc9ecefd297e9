"""Matrix views (dmuon.functional.matrix_view) and the per-param policy (dmuon.functional.policy):
exact inverses (property-tested), NS and the shape scale per block equal to per-part references,
the plan's cost and fingerprint, the module-aware defaults and their errors."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon.functional import muon, transforms as T
from dmuon.functional.lr_scale import lr_scale_factor, lr_scale_factors
from dmuon.functional.matrix_view import Batch, Heads, Split, Transposed, describe_view
from dmuon.functional.plan import param_cost, plan_owners
from dmuon.functional.policy import ParamPolicy, Rule, default_view
from dmuon.functional.specs import ParamSpec
from dmuon.newton_schulz.batched import orthogonalize_batched
from dmuon.newton_schulz.config import NSConfig

F64 = torch.float64


@st.composite
def view_and_shape(draw):
    kind = draw(st.sampled_from(["batch", "heads", "split", "transposed"]))
    if kind == "batch":
        dims = draw(st.integers(0, 2))
        shape = tuple(draw(st.lists(st.integers(1, 4), min_size=dims + 2, max_size=dims + 3)))
        return Batch(dims), shape
    h, d, n = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    axis = draw(st.sampled_from(["rows", "cols"]))
    sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    if kind == "heads":
        return Heads(h, axis), ((h * d, n) if axis == "rows" else (n, h * d))
    if kind == "split":
        return Split(sizes, axis), ((sum(sizes), n) if axis == "rows" else (n, sum(sizes)))
    inner = draw(st.sampled_from(["batch", "heads", "split"]))
    if inner == "batch":
        return Transposed(), (d, n)
    if inner == "heads":  # stored (in, out): out = h*d rows after the transpose
        return Transposed(Heads(h, "rows")), (n, h * d)
    return Transposed(Split(sizes, "rows")), (n, sum(sizes))


@settings(max_examples=150, deadline=None)
@given(view_and_shape(), st.integers(0, 2**31 - 1))
def test_views_are_exact_inverses(vs, seed):
    view, shape = vs
    x = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(seed))
    blocks = view.to_blocks(x)
    assert [tuple(b.shape) for b in blocks] == list(view.blocks(shape))
    assert all(b.is_contiguous() for b in blocks)
    assert sum(b.numel() for b in blocks) == x.numel()
    back = view.from_blocks(blocks, shape)
    assert tuple(back.shape) == shape and torch.equal(back, x)
    assert view.matrices(shape) == sum(b.shape[0] for b in blocks)


def _ref_update(W, g, hp, parts):
    """One Muon step from zero momentum, NS per part: ``parts`` = [(index, s-shape fn)]."""
    x = g + hp.momentum * g  # nesterov, b = g
    U = torch.zeros_like(W)
    cfg = NSConfig.from_hparams(hp)
    for idx, transpose in parts:
        piece = x[idx].t() if transpose else x[idx]
        u = orthogonalize_batched([piece.unsqueeze(0).contiguous()], cfg)[0][0]
        m, n = piece.shape
        s = math.sqrt(max(1.0, m / n)) if hp.lr_scale == "jordan" else 0.2 * math.sqrt(max(m, n))
        U[idx] = (u.t() if transpose else u) * s
    return W * (1 - hp.lr * hp.weight_decay) - hp.lr * U


@pytest.mark.parametrize("rule", ["jordan", "moonlight"])
def test_update_through_views_equals_ns_per_part(rule):
    hp = muon.MuonHParams(lr=0.1, weight_decay=0.1, ns_dtype=F64, lr_scale=rule)
    gen = torch.Generator().manual_seed(0)
    h, d, H = 4, 3, 8
    cases = {
        # per-head q (rows) and o (cols)
        "q": ((h * d, H), Heads(h, "rows"), [(slice(i * d, (i + 1) * d), False) for i in range(h)]),
        "o": ((H, h * d), Heads(h, "cols"),
              [(((slice(None), slice(i * d, (i + 1) * d))), False) for i in range(h)]),
        # Phi-3 fused qkv with GQA (q 32 rows, k 8, v 8): unequal parts, unequal jordan scales
        "qkv": ((48, 16), Split((32, 8, 8)), [(slice(0, 32), False), (slice(32, 40), False),
                                              (slice(40, 48), False)]),
        # gate_up: two equal halves = one (2, I, H) block
        "gate_up": ((24, 8), Split((12, 12)), [(slice(0, 12), False), (slice(12, 24), False)]),
        # GPT-2 Conv1D c_fc stored (in=16, out=64)
        "c_fc": ((16, 64), Transposed(), [(slice(None), True)]),
        # GPT-2 c_attn stored (in=8, out=3*8), split into q, k, v after the transpose
        "c_attn": ((8, 24), Transposed(Split((8, 8, 8))),
                   [((slice(None), slice(i * 8, (i + 1) * 8)), True) for i in range(3)]),
    }
    params = {k: torch.randn(s, dtype=F64, generator=gen) for k, (s, _, _) in cases.items()}
    grads = {k: torch.randn(s, dtype=F64, generator=gen) for k, (s, _, _) in cases.items()}
    views = {k: v for k, (_, v, _) in cases.items()}
    new, _ = muon.update(grads, muon.init(params), params, hp, view=views)
    chained_t = muon.transform(hp, view=views)
    upd, _ = chained_t.update(grads, chained_t.init(params), params)
    chained = T.apply_updates(params, upd)
    for k, (_, _, parts) in cases.items():
        want = _ref_update(params[k], grads[k], hp, parts)
        assert torch.allclose(new[k], want, rtol=0, atol=1e-12), k
        assert torch.allclose(chained[k], want, rtol=0, atol=1e-12), k
    # the plain view differs (the feature matters); a transpose alone changes only the jordan
    # scale (NS commutes with transposition; the moonlight scale is symmetric)
    plain, _ = muon.update(grads, muon.init(params), params, hp)
    for k in cases:
        if k == "c_fc" and rule == "moonlight":
            assert torch.allclose(plain[k], new[k], rtol=0, atol=1e-12)
            continue
        assert (plain[k] - new[k]).abs().max() > 1e-3, k


def test_shape_scale_follows_the_view():
    # GPT-2 c_fc (16, 64) stored (in, out): jordan 2.0 through Transposed, 1.0 as stored
    assert lr_scale_factor((16, 64), "jordan") == 1.0
    assert lr_scale_factors((16, 64), "jordan", Transposed()) == (2.0,)
    assert lr_scale_factors((64, 16), "jordan", Transposed()) == (1.0,)  # c_proj
    assert lr_scale_factors((48, 16), "jordan", Split((32, 8, 8))) == (math.sqrt(2), 1.0)
    assert lr_scale_factors((12, 8), "moonlight", Heads(4, "rows")) == (0.2 * math.sqrt(8),)
    assert lr_scale_factors((8, 9, 4), "jordan", Batch(1)) == (lr_scale_factor((8, 9, 4), "jordan", 1),)


def test_view_and_batch_dims_are_one_option():
    p = {"w": torch.ones(3, 4, 5, dtype=F64)}
    with pytest.raises(ValueError, match="not both"):
        muon.update(p, muon.init(p), p, batch_dims=1, view=Batch(1))
    a, _ = muon.update(p, muon.init(p), p, muon.MuonHParams(ns_dtype=F64), batch_dims={"w": 1})
    b, _ = muon.update(p, muon.init(p), p, muon.MuonHParams(ns_dtype=F64), view={"w": Batch(1)})
    assert torch.equal(a["w"], b["w"])
    with pytest.raises(ValueError, match="needs a 2-D param"):
        muon.update(p, muon.init(p), p, view=Heads(3))
    q = {"w": torch.ones(8, 4, dtype=F64)}
    with pytest.raises(ValueError, match="do not divide into 3 heads"):
        muon.update(q, muon.init(q), q, view=Heads(3))


def test_spec_cost_and_fingerprint_follow_the_view():
    F32 = "torch.float32"
    plain = ParamSpec("l.0.q", (64, 32), F32, "l.0", "muon")
    heads = ParamSpec("l.0.q", (64, 32), F32, "l.0", "muon", view=Heads(8))
    as_batch = ParamSpec("e", (4, 8, 6), F32, "l.0", "muon", view=Batch(1))
    assert as_batch.view is None and as_batch.batch_dims == 1  # one spelling
    assert as_batch == ParamSpec("e", (4, 8, 6), F32, "l.0", "muon", batch_dims=1)
    with pytest.raises(ValueError, match="not both"):
        ParamSpec("e", (4, 8, 6), F32, "l.0", "muon", batch_dims=1, view=Heads(2))
    with pytest.raises(ValueError, match="not a matrix"):
        ParamSpec("q", (64, 32), F32, "l.0", "muon", view=Heads(5))
    c_heads, fl_heads, _, mats = param_cost(heads)
    assert mats == 8 and fl_heads < param_cost(plain)[1]
    from dmuon.newton_schulz.cost import ns_cost
    assert fl_heads == ns_cost(8, 32, 5, batch=8).flops
    f_plain = plan_owners([plain], 2).fingerprint
    assert plan_owners([heads], 2).fingerprint != f_plain
    assert plan_owners([ParamSpec("l.0.q", (64, 32), F32, "l.0", "muon", view=Batch(0))],
                       2).fingerprint == f_plain


def test_default_views_and_their_error():
    assert default_view("m.layers.0.mlp.experts.gate_up_proj", (4, 16, 8), "experts") == Batch(1)
    assert default_view("m.moe.experts.w1", (4, 16, 8), "other") == Batch(1)  # path rule
    assert default_view("m.conv.weight", (8, 3, 3, 3), "conv") == Batch(0)
    assert default_view("h.0.mlp.c_fc.weight", (16, 64), "conv1d") == Transposed()
    assert default_view("q.weight", (16, 16), "other") == Batch(0)
    with pytest.raises(ValueError, match="batch, heads, split, transposed") as e:
        default_view("m.layers.0.attn.qkv", (3, 16, 16), "other")
    assert "m.layers.0.attn.qkv" in str(e.value)
    assert describe_view(Batch(1), (4, 16, 8)) == "batch(1) 4x(16x8)"
    assert describe_view(Batch(0), (8, 3, 3, 3)) == "flatten 8x27"


def test_policy_first_match_and_precedence():
    pol = ParamPolicy(rules=(Rule("*.q_proj.weight", view=Heads(4)),
                             Rule("*.q_proj.*", route="adamw"),
                             Rule("*.router.weight", route="muon"),
                             Rule("*.mlp.gate_up_proj.weight", view=Split((12, 12)))))
    d = pol.decide("l.0.q_proj.weight", (16, 8), predicate_says_muon=True)
    assert (d.route, d.view, d.source) == ("muon", Heads(4), "rule 0: *.q_proj.weight")
    assert pol.decide("l.0.q_proj.bias", (16,), predicate_says_muon=True).route == "adamw"
    assert pol.route("l.0.router.weight", False) == "muon"
    # batch_dims (k > 0) comes after the rules and before the defaults
    bd = lambda n, s: 1 if len(s) == 3 else 0  # noqa: E731
    assert pol.decide("l.0.x.experts", (2, 3, 4), predicate_says_muon=True,
                      batch_dims=bd).source == "batch_dims"
    assert pol.decide("l.0.c_fc.weight", (4, 8), predicate_says_muon=True, kind="conv1d",
                      batch_dims=bd).view == Transposed()
    with pytest.raises(ValueError, match="does not fit"):
        pol.decide("l.0.mlp.gate_up_proj.weight", (20, 8), predicate_says_muon=True)
    with pytest.raises(ValueError, match="AdamW"):
        Rule("x", route="adamw", view=Batch(1))
    with pytest.raises(TypeError):
        ParamPolicy(rules=("*.q_proj",))
    assert pol.canonical() != ParamPolicy(rules=pol.rules[:1]).canonical()
    assert "first match wins" in pol.describe()
