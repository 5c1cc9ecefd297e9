"""Matrix views through dedicate_params on 2 gloo ranks (fp64, 5 steps), in one spawned group: the
MoE cases of tests/test_views_moe.py (Qwen3-MoE, DeepSeek-V3, no batch_dims); per-head, split
and transposed views, each equal to the single-process functional reference with the views spelled out:
Llama with per-head q / k / v / o (GQA: k / v per kv head), Phi-3 with its fused qkv_proj and
gate_up_proj split into parts, GPT-2 with its Conv1D (in, out) weights seen transposed by default
(lr_scale="jordan", whose factor depends on the orientation); per-param dtypes of the policy
(tests/test_policy_dtypes.py)."""
from __future__ import annotations

import pytest

from dist_utils import run_ranks
from hf_tiny import dmuon_run, make_hf, max_rel_err, reference

pytest.importorskip("transformers")


def _policy(kind):
    from dmuon.functional.hf_policy import hf_rules
    from dmuon.functional.policy import ParamPolicy
    cfg = make_hf(kind).config
    return ParamPolicy(rules=hf_rules(cfg, per_head=kind == "llama", split_fused=True))


MOE_DEFAULT = ("qwen3_moe", "deepseek_v3")


def _worker(rank, world):
    from dmuon.functional.specs import default_muon_predicate
    from test_policy_dtypes import dtype_worker
    from test_qk_clip import qk_worker
    from test_views_moe import moe_worker, raise_worker
    return {"moe": moe_worker(rank, world, MOE_DEFAULT), "raise": raise_worker(rank, world),
            "dtypes": dtype_worker(rank, world),
            "qk": qk_worker(rank, world),
            "llama": dmuon_run(rank, world, "llama", default_muon_predicate, policy=_policy("llama")),
            "phi3": dmuon_run(rank, world, "phi3", default_muon_predicate, policy=_policy("phi3")),
            "gpt2": dmuon_run(rank, world, "gpt2", default_muon_predicate,
                              muon_kw={"lr_scale": "jordan"}),
            "mults": dmuon_run(rank, world, "llama", default_muon_predicate, policy=_mult_policy(),
                               muon_kw={"weight_decay": 0.1})}


def _mult_policy():
    from dmuon.functional.matrix_view import Heads
    from dmuon.functional.policy import ParamPolicy, Rule
    return ParamPolicy(rules=(Rule("*.mlp.down_proj.weight", lr_mult=0.5, wd_mult=3.0),
                              Rule("*.self_attn.o_proj.weight", view=Heads(4, "cols"), lr_mult=2.0)))


def _mults(n):
    return (0.5, 3.0) if "down_proj" in n else (2.0, 1.0) if "o_proj" in n else (1.0, 1.0)


def _ref_views(kind):
    """The views, written out by hand (4 heads of 4, 2 kv heads; H = 16, I = 24)."""
    from dmuon.functional.matrix_view import Heads, Split, Transposed
    out = {}
    for n, p in make_hf(kind).named_parameters():
        if kind == "llama":
            for key, v in (("q_proj", Heads(4)), ("k_proj", Heads(2)), ("v_proj", Heads(2)),
                           ("o_proj", Heads(4, "cols"))):
                if f"self_attn.{key}.weight" in n:
                    out[n] = v
        elif kind == "phi3":
            if "qkv_proj" in n:
                out[n] = Split((16, 8, 8))
            elif "gate_up_proj" in n:
                out[n] = Split((24, 24))
        elif kind == "gpt2" and p.ndim == 2 and ".h." in n:
            out[n] = Transposed()
    return out


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_views_on_two_ranks():
    """One spawned group: MoE experts per expert (tests/test_views_moe.py), a 3-D param outside
    experts raising on every rank, QK-clip on 2 ranks (tests/test_qk_clip.py), per-head / split /
    transposed views, policy multipliers, per-param dtypes (tests/test_policy_dtypes.py)."""
    from dmuon.functional.specs import default_muon_predicate
    from test_views_moe import check_moe
    results = run_ranks(_worker, 2, timeout=240)
    check_moe([r["moe"] for r in results], MOE_DEFAULT)
    from test_qk_clip import check_qk
    check_qk([r["qk"] for r in results])  # QK-clip: MAX all-reduce + owners' rescale
    from test_policy_dtypes import check_dtypes
    check_dtypes([r["dtypes"] for r in results])  # per-param param / reduce / master dtypes
    for r in results:
        assert "no default matrix view" in r["raise"] and "batch, heads, split, transposed" in r["raise"]
    for kind in ("llama", "phi3", "gpt2"):
        views = _ref_views(kind)
        ref = reference(kind, default_muon_predicate, views=views,
                        lr_scale="jordan" if kind == "gpt2" else "moonlight")
        for res in results:
            r = res[kind]
            assert {n: r["views"][n] for n in views} == {n: str(v) for n, v in views.items()}
            errs = max_rel_err(r["sd"], ref)
            bad = {k: e for k, e in errs.items() if e > 1e-10}
            assert not bad, (kind, bad)
    # policy lr / weight-decay multipliers (and a view in the same rule)
    from dmuon.functional.matrix_view import Heads
    o_views = {n: Heads(4, "cols") for n, _ in make_hf("llama").named_parameters() if "o_proj" in n}
    ref = reference("llama", default_muon_predicate, views=o_views, hp_of=_mults, muon_wd=0.1)
    plain = reference("llama", default_muon_predicate, views=o_views, muon_wd=0.1)
    for res in results:
        errs = max_rel_err(res["mults"]["sd"], ref)
        assert max(errs.values()) <= 1e-10, {k: e for k, e in errs.items() if e > 1e-10}
    errs = max_rel_err(results[0]["mults"]["sd"], plain)
    assert max(e for k, e in errs.items() if "down_proj" in k or "o_proj" in k) > 1e-3
    # the views matter: the plain-matrix reference is far away (GPT-2 through the jordan scale)
    for kind in ("llama", "phi3", "gpt2"):
        plain = reference(kind, default_muon_predicate,
                          lr_scale="jordan" if kind == "gpt2" else "moonlight")
        errs = max_rel_err(results[0][kind]["sd"], plain)
        assert max(errs[n] for n in _ref_views(kind)) > 1e-3, kind
