"""MoE expert stacks on gloo ranks (fp64, 5 steps): with no user batch_dims, dmuon sees each fused
3-D expert stack of a Hugging Face model (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3-style with shared
experts and a dense first layer) as one matrix per expert and equals the single-process
functional reference that runs NS per expert. Default tier: Qwen3-MoE and DeepSeek-V3 on 2 ranks
(run from tests/test_views_hf.py, one spawned group for all view tests); slow tier: Mixtral and OLMoE (the same fused experts class layout) on 2 ranks, all four on
4 ranks and on HSDP 2 x 2."""
from __future__ import annotations

import pytest

from dist_utils import run_ranks
from hf_tiny import dmuon_run, make_hf, max_rel_err, reference

pytest.importorskip("transformers")

MOE = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3")


def user_predicate(n, p):
    """What a user writes: every matrix but embeddings, head and the routers (``mlp.gate``)."""
    return p.ndim >= 2 and "embed" not in n and "lm_head" not in n and not n.endswith("mlp.gate.weight")


def moe_worker(rank, world, kinds, hsdp=False):
    """Each of ``kinds`` with the user's predicate; the first also with ``default_muon_predicate``
    (which must route the same params: routers to AdamW, experts to Muon)."""
    from dmuon.functional.specs import default_muon_predicate
    out = {k: dmuon_run(rank, world, k, user_predicate, hsdp=hsdp) for k in kinds}
    out["default"] = dmuon_run(rank, world, kinds[0], default_muon_predicate, hsdp=hsdp)
    return out


def check_moe(results, kinds):
    for kind in kinds:
        experts = {n: 1 for n, p in make_hf(kind).named_parameters()
                   if user_predicate(n, p) and p.ndim == 3}
        assert experts
        ref = reference(kind, user_predicate, batch_dims=experts, world=len(results))
        for res in results:
            assert {n: res[kind]["views"][n] for n in experts} == {n: "batch(1)" for n in experts}
            for r in (res[kind], res["default"]) if kind == kinds[0] else (res[kind],):
                errs = max_rel_err(r["sd"], ref)
                bad = {k: e for k, e in errs.items() if e > 1e-10}
                assert not bad, (kind, bad)


# The default-tier run (Qwen3-MoE and DeepSeek-V3 on 2 ranks) shares one spawned group with the
# other view tests: tests/test_views_hf.py::test_views_on_two_ranks.


@pytest.mark.slow
@pytest.mark.parametrize("world,hsdp,kinds", [(2, False, ("mixtral", "olmoe")), (4, False, MOE),
                                              (4, True, MOE)])
def test_moe_experts_more_models_and_meshes(world, hsdp, kinds):
    check_moe(run_ranks(moe_worker, world, kinds, hsdp=hsdp, timeout=300), kinds)


def test_default_predicate_routes_moe():
    from dmuon.functional.specs import default_muon_predicate
    for kind in MOE:
        for n, p in make_hf(kind).named_parameters():
            want = p.ndim >= 2 and "embed" not in n and "lm_head" not in n and ".gate." not in n
            assert default_muon_predicate(n, p) == want, (kind, n, tuple(p.shape))


def raise_worker(rank, world):
    """A 3-D param outside an experts module, routed to Muon: the error text on this rank."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.stateful.setup.dedicate import dedicate_params

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = torch.nn.Parameter(torch.randn(3, 4, 5))
            self.w = torch.nn.Parameter(torch.randn(4, 4))

    try:
        dedicate_params(Odd(), init_device_mesh("cpu", (world,)), lambda n, p: p.ndim >= 2)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"
