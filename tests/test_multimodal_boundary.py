"""``hook_boundary_predicate`` on the nested vision-language model of
``examples/multimodal_boundary.py`` (2 gloo ranks, fp64):

* with the predicate, the hook groups are the fully_shard units (each vision block, the projector,
  each decoder layer); by default they are whole vision stages plus a root group for the projector;
* with the predicate, fewer dedicated elements are ever gathered at once during forward;
* 3 training steps with the predicate equal a single-process reference (functional Muon on the same
  matrices + ``torch.optim.AdamW`` on the rest), and the loss falls.
"""
from __future__ import annotations

import pytest

import importlib.util
from pathlib import Path

from dist_utils import run_ranks
from stateful_harness import _local_numel

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multimodal_boundary.py"
STEPS = 3


def _ex():
    spec = importlib.util.spec_from_file_location("_ex_multimodal", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _peak_gathered(model, rt):
    """Max over all module pre/post-forward points of the dedicated elements materialized."""
    peak = [0]

    def probe(*_):
        peak[0] = max(peak[0], sum(_local_numel(p) for p in rt.params.values()))

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(probe))
        handles.append(m.register_forward_hook(probe))
    return peak, handles


def _train(rank, world, use_predicate):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from dmuon.stateful.runtime.state import get_state
    ex = _ex()
    mesh = init_device_mesh("cpu", (world,))
    model = ex.build(dtype=torch.float64)
    dmuon.dedicate_params(model, mesh, predicate=ex.muon_predicate,
                          hook_boundary_predicate=ex.boundary if use_predicate else None)
    ex.shard(model, mesh)
    rt = get_state(model)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float64)
    peak, handles = _peak_gathered(model, rt)
    losses = []
    for patches, ids in _global_batches(ex):
        opt.zero_grad()
        loss = model(patches.chunk(world)[rank], ids.chunk(world)[rank])
        loss.backward()
        opt.step()
        losses.append(float(loss))
    for h in handles:
        h.remove()
    return {"groups": list(rt.groups), "peak": peak[0], "losses": losses,
            "sd": dmuon.get_model_state_dict(model) if use_predicate else None}


def _global_batches(ex):
    import torch
    return list(ex.batches(0, STEPS, per_rank=4, dtype=torch.float64))


def _worker(rank, world):
    return [_train(rank, world, True), _train(rank, world, False)]


def _reference():
    import torch
    from dmuon.functional import muon as fmuon
    ex = _ex()
    model = ex.build(dtype=torch.float64)
    mats = {n: p for n, p in model.named_parameters() if ex.muon_predicate(n, p)}
    rest = [p for n, p in model.named_parameters() if n not in mats]
    adam = torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01, foreach=False)
    st = fmuon.init({n: p.detach() for n, p in mats.items()})
    for patches, ids in _global_batches(ex):
        model.zero_grad()
        # each rank's mean loss over its half, averaged over the 2 ranks
        loss = sum(model(p, i) for p, i in zip(patches.chunk(2), ids.chunk(2))) / 2
        loss.backward()
        with torch.no_grad():
            _, st = fmuon.update({n: p.grad for n, p in mats.items()}, st,
                                 {n: p.data for n, p in mats.items()},
                                 fmuon.MuonHParams(lr=0.02, ns_dtype=torch.float64), donate=True)
        adam.step()
    return model.state_dict()


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_multimodal_boundary_predicate():
    results = run_ranks(_worker, 2, timeout=120)
    vision_blocks = [f"vision_tower.encoder.layers.{s}.blocks.{b}" for s in (0, 1) for b in (0, 1)]
    lm = ["language_model.layers.0", "language_model.layers.1"]
    for with_pred, default in results:
        assert with_pred["groups"] == vision_blocks + ["multi_modal_projector"] + lm
        assert sorted(default["groups"]) == sorted(
            ["", "vision_tower.encoder.layers.0", "vision_tower.encoder.layers.1"] + lm)
        assert 0 < with_pred["peak"] < default["peak"], (with_pred["peak"], default["peak"])
        assert with_pred["losses"][-1] < with_pred["losses"][0]
    ref = _reference()
    sd = results[0][0]["sd"]
    assert set(sd) == set(ref)
    for k, v in ref.items():
        err = float((sd[k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
        assert err <= 1e-10, (k, err)
