"""Tensor parallelism as users combine it (issue 21 review): paths beyond the supported-order tests
(tests/test_tensor_parallel.py), each on 4 gloo ranks, a (dp 2, tp 2) mesh, 3 fp64 steps, equal to
the single-process reference (functional Muon on the full matrices, torch AdamW, torch's
clip_grad_norm_, full batch) to <= 1e-10. Worker and reference: tests/tp_paths_worker.py.
"""
from __future__ import annotations

import pytest

from dist_utils import run_ranks
from stateful_harness import max_rel_err
from tp_paths_worker import reference, run, run_many


def _check(cfg: dict, results: list) -> None:
    ref = reference(cfg)
    for r, out in enumerate(results):
        err, where = max_rel_err(out["sd"], ref["sd"])
        assert err <= 1e-10, (cfg, r, err, where)
        if cfg.get("clip"):
            diff = max(abs(a - b) for a, b in zip(out["norms"], ref["norms"]))
            assert diff <= 1e-10, (cfg, r, out["norms"], ref["norms"])


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_tp_clip_with_a_dedicated_matrix_without_tp():
    """lm_head selected by the predicate but not parallelized, TP on the blocks, then
    dmuon.clip_grad_norm_ every step: the norm and the weights equal torch's clip of the
    single-device model."""
    cfg = {"pred": "lm_head", "clip": 0.5}
    _check(cfg, run_ranks(run, 4, cfg, timeout=120))


@pytest.mark.slow
def test_tp_weight_read_by_the_parent_module():
    """``w = block.mlp.up_proj.weight; w = w.full_tensor()`` in the block's forward (as under
    plain TP, where it is a DTensor), loss + 1e-2 |w|: loss and weights as on one device."""
    cfg = {"model": "reg"}
    results = run_ranks(run, 4, cfg, timeout=120)
    ref = reference(cfg)
    means = [sum(r["losses"][k] for r in results) / 4 for k in range(len(ref["losses"]))]
    assert max(abs(a - b) for a, b in zip(means, ref["losses"])) <= 1e-10, (means, ref["losses"])
    _check(cfg, results)


@pytest.mark.slow
def test_tp_clip_with_only_the_mlp_parallelized():
    cfg = {"tp_only_mlp": True, "clip": 0.5}
    _check(cfg, run_ranks(run, 4, cfg, timeout=120))


@pytest.mark.slow
def test_tp_a_block_unused_on_every_rank_for_one_step():
    """layers.1 skipped on every rank at step 1: its FSDP2 params get no gradient anywhere, so
    AdamW skips them as on one device (dmuon puts ``None`` back where FSDP2's
    ``set_reduce_scatter_unused_params`` gave a zero; before, AdamW decayed them)."""
    cfg = {"model": "skip", "steps": 2}  # layers.1 skipped in step 1
    _check(cfg, run_ranks(run, 4, cfg, timeout=120))


def _check_group(cfgs: list, results: list) -> None:
    for i, cfg in enumerate(cfgs):
        outs = [res[i] for res in results]
        for out in outs:
            assert "error" not in out, (cfg, out.get("tb"))
        _check(cfg, outs)


# paths that work: one spawned group runs several (each a fresh model on the same meshes)
WORKING_FAST = [
    {"ckpt": True},                       # non-reentrant activation checkpointing of each block
    {"accum": 2},                         # dmuon.no_sync gradient accumulation
    {"model": "routed"},                  # TP'd MLP matrices unused on one dp rank in a step
    {"step_twice": True, "steps": 1},     # a second step() without backward: a clear error
    {"clip": 1e9, "torch_clip": True, "steps": 1},  # torch's clip_grad_norm_: a clear error
]

WORKING = [
    {"z3": False},                        # reshard_after_forward=False
    {"model": "reuse"},                   # a TP block called twice per forward
    {"model": "reuse", "ckpt": True, "z3": False},  # ... and checkpointed
    {"bias": True},                       # Colwise bias (Shard(0)) + Rowwise bias (Replicate)
    {"pred": "some"},                     # the predicate selects only the attention's TP matrices
    {"pred": "lm_head"},                  # a dedicated matrix without TP (no clip)
    {"pred": "lm_head", "tp_lm_head": "replicate_out", "clip": 0.5},  # lm_head Colwise, clipped
    {"pred": "lm_head", "tp_lm_head": "dtensor_out", "model": "full_logits"},  # loss on full_tensor
    {"clip": 0.5, "sched": True},         # dmuon.clip_grad_norm_ + LambdaLR
    {"zero_keep": True},                  # zero_grad(set_to_none=False)
    {"hf_zero": True},                    # only model.zero_grad() after each step
    {"eval": True},                       # a no_grad forward before each training forward
    {"frozen": True},                     # a frozen TP matrix (requires_grad=False)
    {"tp_only_mlp": True},                # TP on the MLP only: attention dedicated without TP
    {"root_only": True},                  # fully_shard on the root only
    {"accum": 2, "accum_sync": True},     # accumulation without no_sync (reduce every micro-batch)
    {"accum": 2, "ckpt": True, "z3": False, "boundary": "sub"},  # no_sync + ckpt + sub hooks
    {"ckpt": True, "boundary": "sub"},
    {"ckpt": "reentrant"},                # reentrant activation checkpointing
    {"model": "reg", "reg_kind": "sq"},   # |W|^2 of a slice read by the parent: separable, right
    {"sp": True, "pred": "lm_head", "clip": 0.5},  # SequenceParallel norms, Shard(1) activations
    {"sp": True, "order": "B"},
    {"hsdp3": True, "clip": 0.5},         # (replicate 2, shard 1, tp 2): shard + replicate_mesh
    {"order": "B", "ckpt": True, "bias": True},  # deferred dedication + checkpointing + biases
    {"pred": "lm_head", "resume_at": 0},  # dmuon state dicts -> a fresh model + optimizer
    {"load_plain": True, "pred": "lm_head"},  # a plain model's state_dict loaded before training
]


@pytest.mark.slow
def test_tp_paths_that_work_fast():
    results = run_ranks(run_many, 4, WORKING_FAST, timeout=120)
    _check_group(WORKING_FAST, results)
    for res in results:
        kind, msg = res[3]["second_step"]  # every rank raises, before anything changes
        assert kind == "RuntimeError" and "no fresh gradient" in msg, res[3]["second_step"]
        kind, msg = res[4]["torch_clip"]  # names the fix
        assert kind == "DedicatedParamError" and "dmuon.clip_grad_norm_" in msg, res[4]["torch_clip"]


@pytest.mark.slow
def test_tp_paths_that_work():
    _check_group(WORKING, run_ranks(run_many, 4, WORKING, timeout=300))


@pytest.mark.slow
def test_tp_bf16_mixed_precision_is_close():
    """MixedPrecisionPolicy(param_dtype=bfloat16) given to fully_shard, in both orders: close to
    the fp64 reference (as the non-TP bf16 run is: < 0.1 relative)."""
    cfgs = [{"mp": True}, {"mp": True, "order": "B"}]
    results = run_ranks(run_many, 4, cfgs, timeout=120)
    for i, cfg in enumerate(cfgs):
        ref = reference(cfg)
        for res in results:
            err, where = max_rel_err(res[i]["sd"], ref["sd"])
            assert err < 0.1, (cfg, err, where)
