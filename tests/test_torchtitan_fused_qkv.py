"""torchtitan 0.3.0's fused ``wqkv`` (``FusedQKVLinear``) as a dedicated matrix.

``FusedQKVLinear`` rewrites its entry in its own state-dict hooks: on save its post-hook splits
``wqkv.weight`` into the stock ``wq`` / ``wk`` / ``wv`` entries, on load its pre-hook merges them
back. Both hooks run on the submodule, i.e. before (save) and after (load) the root hooks a model
wrapper would install, so dmuon must fill and read the dedicated entry at the owning module.

The llama3 debug model (fused ``wqkv``, torchtitan's default) built on meta, every in-layer matrix
dedicated (wqkv too), its own ``parallelize_llama`` (dp 2, gloo), ``to_empty`` + ``init_weights``:

- ``model.state_dict()`` (full tensors) loads into a plain single-process model whose forward
  equals the dmuon model's bit for bit;
- torchtitan's ``CheckpointManager`` save (with dmuon's optimizer container) -> new processes with
  other initial weights -> ``load``: the same state dict and the same logits as at save;
- a checkpoint with a NaN in ``wq`` raises ``StateDictError`` on every rank and changes nothing
  (the merged entry is checked with all the others, before the first byte loads);
- dmuon's own full-dict functions (``dmuon.get_model_state_dict``), which name params, not
  torchtitan's split entries, raise on every rank naming the fix.
(No training step: torchtitan's attention has no CPU backward in torch 2.13.)
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")

from dist_utils import catch, run_ranks  # noqa: E402

_WQ = "layers.0.attention.qkv_linear.wq.weight"


def _config():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    cfg = llama3_debugmodel()
    cfg.training.mixed_precision_param = "float32"
    cfg.training.seq_len = 32
    mc = cfg.model_spec.model
    mc.update_from_config(config=cfg)
    return cfg, mc


def _inputs():
    tokens = torch.arange(2 * 32).view(2, 32) % 100
    return tokens, torch.arange(32).view(1, 32).expand(2, 32)


def _logits(model):
    tokens, pos = _inputs()
    with torch.no_grad():
        return model(tokens, positions=pos, attention_masks=model.get_attention_masks(pos))


def _full(sd: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in sd.items()}


def _build(world: int, seed: int):
    import torchtitan.distributed.parallel_dims as tt_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.parallelize import parallelize_llama

    import dmuon

    cfg, mc = _config()
    cfg.parallelism.data_parallel_shard_degree = world
    cfg.parallelism.spmd_backend = "partial_dtensor"
    tt_dims.device_type = "cpu"  # CPU-only torch: torchtitan would ask for a cuda mesh
    with torch.device("meta"):
        model = mc.build()
    pd = ParallelDims.from_config(cfg.parallelism, world)
    owners = dmuon.dedicate_params(model, pd.get_mesh("fsdp"),
                                   lambda n, p: p.ndim == 2 and "layers." in n)
    model = parallelize_llama(model, parallel_dims=pd, training=cfg.training,
                              parallelism=cfg.parallelism, compile_config=cfg.compile,
                              ac_config=None, dump_folder="")
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, owners


def _checkpointer(model, folder: str):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    from dmuon.integrations.torchtitan import DMuonOptimizersContainer

    opt = DMuonOptimizersContainer.Config(lr=0.02, adamw_lr=3e-3).build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=10)
    return CheckpointManager.Config(enable=True, folder=folder, interval=1,
                                    last_save_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched, states={},
        sd_adapter=None)


def _save(rank: int, world: int, folder: str) -> dict:
    import dmuon
    model, owners = _build(world, seed=0)
    sd = _full(model.state_dict())
    ckpt = _checkpointer(model, folder)
    ckpt.save(curr_step=1)
    ckpt.close()
    return {"n_dedicated": len(owners), "sd": sd, "logits": _logits(model),
            "dmuon_sd": catch(lambda: dmuon.get_model_state_dict(model))}


def _resume(rank: int, world: int, folder: str, saved_sd: dict) -> dict:
    model, _ = _build(world, seed=7)  # other initial weights: the load must win
    before = _full(model.state_dict())
    bad = dict(saved_sd)  # other values everywhere, and a NaN in wq: only the merged wqkv
    bad[_WQ] = torch.full_like(bad[_WQ], float("nan"))
    bad_load = catch(lambda: model.load_state_dict(bad))
    after = _full(model.state_dict())
    unchanged = sorted(after) == sorted(before) and all(torch.equal(after[k], before[k])
                                                        for k in before)
    ckpt = _checkpointer(model, folder)
    loaded = ckpt.load(step=1)
    ckpt.close()
    return {"loaded": loaded, "sd": _full(model.state_dict()), "logits": _logits(model),
            "bad_load": bad_load, "unchanged": unchanged}


@pytest.mark.slow
def test_fused_wqkv_dedicated_state_dict_and_checkpoint(tmp_path):
    folder = str(tmp_path / "ckpt")
    saved = run_ranks(_save, 2, folder, timeout=180)
    assert saved[0]["n_dedicated"] == 30  # wqkv, wo, w1, w2, w3 of the 6 layers
    sd = saved[0]["sd"]
    assert "layers.0.attention.qkv_linear.wq.weight" in sd, sorted(sd)[:8]
    assert not any("wqkv" in k for k in sd)
    assert all(torch.equal(sd[k], saved[1]["sd"][k]) for k in sd)
    _, mc = _config()
    ref = mc.build()
    ref.load_state_dict(sd, strict=True)  # torchtitan's merge hook fuses wq/wk/wv again
    want = _logits(ref)
    for r in saved:
        assert torch.equal(r["logits"], want)
        kind, msg = r["dmuon_sd"]
        assert kind == "StateDictError" and "FusedQKVLinear" in msg and "model.state_dict()" in msg
    resumed = run_ranks(_resume, 2, folder, sd, timeout=180)
    for r in resumed:
        kind, msg = r["bad_load"]  # checked before anything loads, on every rank
        assert kind == "StateDictError" and "wqkv.weight: non-finite" in msg, r["bad_load"]
        assert r["unchanged"]
        assert r["loaded"] is True
        assert sorted(r["sd"]) == sorted(sd)
        assert all(torch.equal(r["sd"][k], sd[k]) for k in sd)
        assert torch.equal(r["logits"], want)
