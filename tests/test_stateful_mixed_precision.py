"""Mixed precision (FSDP2's MixedPrecisionPolicy or an explicit one; bf16 params), root group,
custom hook boundaries, HF-style ``model.zero_grad()`` loops and no-grad forwards, on 2 gloo ranks."""
from __future__ import annotations

import torch

from dist_utils import run_ranks
from stateful_harness import distributed_run, max_rel_err, reference_run

CONFIGS = [
    dict(id="fsdp_mp", dtype=torch.float32, mp="fsdp"),
    dict(id="explicit_mp", dtype=torch.float32, mp="explicit", z3=False),
    dict(id="bf16_params", dtype=torch.bfloat16),
    dict(id="fp32", dtype=torch.float32),
    dict(id="root_sub_hf_eval", root_proj=True, boundary="sub", hf_zero=True, eval=True, ckpt=True),
]


def _worker(rank, world, cfgs):
    return {c["id"]: distributed_run(rank, world, c) for c in cfgs}


def test_mixed_precision_and_boundaries():
    results = run_ranks(_worker, 2, CONFIGS, timeout=120)
    ref = reference_run({})
    for rank in range(2):
        r = results[rank]
        for cid in ("fsdp_mp", "explicit_mp"):
            assert r[cid]["seen_dtypes"] == ["torch.bfloat16"], r[cid]["seen_dtypes"]
            assert r[cid]["master_dtypes"] == ["torch.float32"]
            assert r[cid]["reduce_dtypes"] == ["torch.float32"]
            assert all(v.dtype == torch.float32 for v in r[cid]["sd"].values())
            err, where = max_rel_err(r[cid]["sd"], ref["sd"])
            assert err < 0.1, (cid, err, where)
        b = r["bf16_params"]
        assert b["seen_dtypes"] == ["torch.bfloat16"] and b["master_dtypes"] == ["torch.float32"]
        assert b["reduce_dtypes"] == ["torch.bfloat16"]
        assert all(v.dtype == torch.bfloat16 for v in b["sd"].values())
        assert max_rel_err(b["sd"], ref["sd"])[0] < 0.1
        f = r["fp32"]
        assert f["seen_dtypes"] == ["torch.float32"] and f["master_dtypes"] == ["torch.float32"]
        assert max_rel_err(f["sd"], ref["sd"])[0] < 1e-5
    # root group (a matrix outside layers.N) + attention/MLP boundaries + checkpointing +
    # model.zero_grad() only + extra no-grad forwards: exact
    ref2 = reference_run(dict(root_proj=True, ckpt=True))
    for rank in range(2):
        r = results[rank]["root_sub_hf_eval"]
        assert r["groups"] == ["", "layers.0.mlp", "layers.0.self_attn", "layers.1.mlp",
                               "layers.1.self_attn"], r["groups"]
        err, where = max_rel_err(r["sd"], ref2["sd"])
        assert err <= 1e-10, (err, where)
