"""Tiny Hugging Face models built from their config classes (fp64, same weights on every process)
and the single-process reference training the view tests compare dmuon against."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

VOCAB = 64


def make_hf(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny ``kind`` model (``qwen3_moe``, ``mixtral``, ``olmoe``, ``deepseek_v3``, ``phi3``,
    ``gpt2``, ``llama``) in fp64, seeded (norms perturbed so their gradients are not trivial)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                head_dim=4, **common)
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    elif kind == "olmoe":
        cfg = tf.OlmoeConfig(num_experts=4, num_experts_per_tok=2, **common)
    elif kind == "deepseek_v3":
        cfg = tf.DeepseekV3Config(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                  moe_intermediate_size=8, first_k_dense_replace=1, q_lora_rank=None,
                                  kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                  v_head_dim=8, head_dim=4, n_group=1, topk_group=1, **common)
    elif kind == "phi3":
        cfg = tf.Phi3Config(**common)
    elif kind == "llama":
        cfg = tf.LlamaConfig(**common)
    elif kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=32,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=1, eos_token_id=2)
    else:
        raise ValueError(kind)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    kw = {"experts_implementation": "eager"} if "moe" in kind or kind in ("mixtral", "deepseek_v3") else {}
    model = tf.AutoModelForCausalLM.from_config(cfg, **kw).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    torch.random.set_rng_state(state)
    return model


def batches(steps: int = 5, batch: int = 4, seq: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (batch, seq), generator=g) for _ in range(steps)]


LR, ADAMW_LR = 0.02, 1e-3


def reference(kind: str, muon_names: Callable[[str, torch.Tensor], bool], *, views: Any = None,
              batch_dims: Any = None, world: int = 2, lr_scale: str = "moonlight",
              hp_of: Optional[Callable[[str], tuple[float, float]]] = None,
              muon_wd: float = 0.0) -> dict:
    """Single-process training: functional Muon (fp64 NS, ``views`` / ``batch_dims`` as
    ``muon.update``'s ``view`` / ``batch_dims``)
    on ``muon_names`` and ``torch.optim.AdamW`` (dmuon.Muon's AdamW defaults) on the rest; the
    loss is the mean of the ``world`` per-rank mean losses (equal token counts). ``hp_of(name)``
    gives a param's ``(lr_mult, wd_mult)`` (Muon weight decay ``muon_wd``)."""
    from dmuon.functional import muon as fmuon
    model = make_hf(kind)
    mats = {n: p for n, p in model.named_parameters() if muon_names(n, p)}
    rest = [p for n, p in model.named_parameters() if n not in mats]
    adam = torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.01, foreach=False)
    kw = {} if views is None else {"view": views}
    if batch_dims is not None:
        kw["batch_dims"] = batch_dims
    groups: dict = {}  # (lr_mult, wd_mult) -> names; each group its own functional state
    for n in mats:
        groups.setdefault(hp_of(n) if hp_of else (1.0, 1.0), []).append(n)
    states = {g: fmuon.init({n: mats[n].detach() for n in ns}) for g, ns in groups.items()}
    model.train()
    for ids in batches():
        model.zero_grad()
        loss = sum(model(input_ids=c, labels=c).loss for c in ids.chunk(world)) / world
        loss.backward()
        with torch.no_grad():
            for (lm, wm), ns in groups.items():
                gkw = dict(kw)
                if "view" in gkw and isinstance(gkw["view"], dict):
                    gkw["view"] = {n: v for n, v in gkw["view"].items() if n in ns}
                if "batch_dims" in gkw and isinstance(gkw["batch_dims"], dict):
                    gkw["batch_dims"] = {n: v for n, v in gkw["batch_dims"].items() if n in ns}
                _, states[(lm, wm)] = fmuon.update(
                    {n: mats[n].grad for n in ns}, states[(lm, wm)], {n: mats[n].data for n in ns},
                    fmuon.MuonHParams(lr=LR * lm, weight_decay=muon_wd * wm,
                                      ns_dtype=torch.float64, lr_scale=lr_scale),
                    donate=True, **gkw)
        adam.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def dmuon_run(rank: int, world: int, kind: str, predicate: Any, muon_kw: Optional[dict] = None,
              hsdp: bool = False, **dedicate_kw: Any) -> dict:
    """dedicate_params + fully_shard per decoder layer + dmuon.Muon (fp64 NS), 5 steps, on a 1-D
    mesh or (``hsdp``) a 2 x (world / 2) HSDP mesh; returns the full state dict and the
    per-param views dmuon chose."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.stateful.optimizer.muon import Muon
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict

    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        dedicate_kw["replicate_mesh"] = mesh["replicate"]
        shard_mesh = mesh["shard"]
    else:
        mesh = shard_mesh = init_device_mesh("cpu", (world,))
    model = make_hf(kind)
    dedicate_params(model, shard_mesh, predicate, **dedicate_kw)
    layers = model.transformer.h if kind == "gpt2" else model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(model, lr=LR, adamw_lr=ADAMW_LR, ns_dtype=torch.float64, **(muon_kw or {}))
    model.train()
    for ids in batches():
        opt.zero_grad()
        c = ids.chunk(world)[rank]
        model(input_ids=c, labels=c).loss.backward()
        opt.step()
    rt = opt.dedicated_state
    return {"sd": get_model_state_dict(model),
            "views": {n: str(v) for n, v in rt.matrices.views.items()},
            "dedicated": sorted(rt.params)}


def max_rel_err(a: dict, b: dict) -> dict[str, float]:
    assert set(a) == set(b)
    return {k: float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)) for k in b}
