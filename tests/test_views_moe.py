"""MoE expert stacks on 2 gloo ranks (fp64, 5 steps): with no user batch_dims, dmuon sees each fused
3-D expert stack of a Hugging Face model (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3-style) as one
matrix per expert and equals the single-process functional reference that runs NS per expert."""
from __future__ import annotations

import pytest

from dist_utils import run_ranks
from hf_tiny import dmuon_run, make_hf, max_rel_err, reference

pytest.importorskip("transformers")

MOE = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3")


def user_predicate(n, p):
    """What a user writes: every matrix but embeddings, head and the routers (``mlp.gate``)."""
    return p.ndim >= 2 and "embed" not in n and "lm_head" not in n and not n.endswith("mlp.gate.weight")


def _worker(rank, world):
    return {k: dmuon_run(rank, world, k, user_predicate) for k in MOE}


def test_moe_experts_per_expert_without_batch_dims():
    results = run_ranks(_worker, 2, timeout=180)
    for kind in MOE:
        ref = reference(kind, user_predicate,
                        batch_dims={n: 1 for n, p in make_hf(kind).named_parameters()
                                    if user_predicate(n, p) and p.ndim == 3})
        for res in results:
            errs = max_rel_err(res[kind]["sd"], ref)
            bad = {k: e for k, e in errs.items() if e > 1e-10}
            assert not bad, (kind, bad)


def test_default_predicate_routes_moe():
    from dmuon.functional.specs import default_muon_predicate
    for kind in MOE:
        for n, p in make_hf(kind).named_parameters():
            want = p.ndim >= 2 and "embed" not in n and "lm_head" not in n and ".gate." not in n
            assert default_muon_predicate(n, p) == want, (kind, n, tuple(p.shape))
