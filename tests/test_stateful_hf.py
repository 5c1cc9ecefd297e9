"""The seeds' HF recipe on a tiny ``LlamaForCausalLM`` (fp64, 2 gloo ranks, gradient checkpointing
as ``gradient_checkpointing_enable`` sets it up): equals the single-process reference."""
from __future__ import annotations

import pytest

from dist_utils import run_ranks

transformers = pytest.importorskip("transformers")

PRED_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pred(n, p):
    return p.ndim == 2 and any(k in n for k in PRED_KEYS)


def _make():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(torch.float64)


def _batches():
    import torch
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (4, 12), generator=g) for _ in range(5)]


def _hp():
    return dict(lr=0.02, adamw_lr=1e-3)


def _worker(rank, world, ckpt):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.stateful.optimizer.muon import Muon
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict

    mesh = init_device_mesh("cpu", (world,))
    model = _make()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    dedicate_params(model, mesh, predicate=_pred)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(model, ns_dtype=torch.float64, **_hp())
    model.train()
    for ids in _batches():
        opt.zero_grad()
        out = model(input_ids=ids.chunk(world)[rank], labels=ids.chunk(world)[rank])
        out.loss.backward()
        opt.step()
    sd = get_model_state_dict(model)
    saved = None
    if not ckpt:  # the save that dmuon's "call it on every rank" error names (session 13: it named
        # save_pretrained(dir, is_main_process=...) on every rank, which fails on FSDP2 models)
        import tempfile

        from transformers import LlamaForCausalLM
        if rank == 0:
            with tempfile.TemporaryDirectory() as d:
                model.save_pretrained(d, state_dict=dict(sd))
                saved = LlamaForCausalLM.from_pretrained(d, dtype=torch.float64).state_dict()
        torch.distributed.barrier()
    return {"sd": sd, "saved": saved, "groups": sorted(opt.dedicated_state.groups)}


def _reference():
    import torch
    from dmuon.functional import muon as fmuon
    model = _make()
    mats = {n: p for n, p in model.named_parameters() if _pred(n, p)}
    rest = [p for n, p in model.named_parameters() if n not in mats]
    adam = torch.optim.AdamW(rest, lr=_hp()["adamw_lr"], weight_decay=0.01, foreach=False)
    st = fmuon.init({n: p.detach() for n, p in mats.items()})
    model.train()
    for ids in _batches():
        model.zero_grad()
        # the mean over ranks of per-rank mean losses (equal token counts) = global mean
        loss = sum(model(input_ids=c, labels=c).loss for c in ids.chunk(2)) / 2
        loss.backward()
        with torch.no_grad():
            _, st = fmuon.update({n: p.grad for n, p in mats.items()}, st,
                                 {n: p.data for n, p in mats.items()},
                                 fmuon.MuonHParams(lr=_hp()["lr"], ns_dtype=torch.float64),
                                 donate=True)
        adam.step()
    return model.state_dict()


def _worker_both(rank, world):
    return [_worker(rank, world, False), _worker(rank, world, True)]


def test_hf_llama_recipe_equals_reference():
    import torch
    results = run_ranks(_worker_both, 2, timeout=120)
    ref = _reference()
    for res in results:
        for r in res:
            assert r["groups"] == ["model.layers.0", "model.layers.1"]
            assert set(r["sd"]) == set(ref)
            for k, v in ref.items():
                err = float((r["sd"][k] - v).abs().max() / v.abs().max())
                assert err <= 1e-10, (k, err)
    saved = results[0][0]["saved"]  # rank 0's save_pretrained(dir, state_dict=sd), reloaded
    assert set(saved) == set(ref)
    assert all(torch.equal(saved[k], v) for k, v in results[0][0]["sd"].items())
