"""QK-clip (MuonClip): the per-head max logit, the rescale formula on a hand-built attention (MHA and
GQA: every head's max becomes min(S_h, tau)), and the stateful wiring on 2 gloo ranks (MAX
all-reduce of per-rank maxima, owners rescale W_q / W_k) equal to the single-process functional form."""
from __future__ import annotations

import math

import pytest
import torch

from dmuon.functional.qk_clip import QKClipConfig, apply_qk_clip, clip_factors, max_logits

F64 = torch.float64


def _attn(x, wq, wk, hq, hkv, d):
    b, t, _ = x.shape
    q = (x @ wq.t()).view(b, t, hq, d).transpose(1, 2)
    k = (x @ wk.t()).view(b, t, hkv, d).transpose(1, 2)
    return q, k


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_clip_caps_each_head_at_tau(hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    d, H, b, t = 4, 8, 2, 5
    x = torch.randn(b, t, H, dtype=F64, generator=g)
    wq = 3 * torch.randn(hq * d, H, dtype=F64, generator=g)
    wk = 3 * torch.randn(hkv * d, H, dtype=F64, generator=g)
    q, k = _attn(x, wq, wk, hq, hkv, d)
    s = max_logits(q, k)
    # brute force: the causal max of q_i . k_j / sqrt(d) per head
    for h in range(hq):
        kh = h // (hq // hkv)
        want = max(float(q[bb, h, i] @ k[bb, kh, j]) / math.sqrt(d)
                   for bb in range(b) for i in range(t) for j in range(i + 1))
        assert float(s[h]) == pytest.approx(want, rel=1e-12)
    tau = float(s.median())
    cfg = QKClipConfig(tau=tau)
    qf, kf = clip_factors(s, hkv, cfg)
    new_q, new_k = apply_qk_clip(wq, wk, qf, kf)
    s2 = max_logits(*_attn(x, new_q, new_k, hq, hkv, d))
    assert torch.allclose(s2, torch.minimum(s, torch.tensor(tau, dtype=F64)), rtol=1e-12, atol=0)
    assert (s > tau).any() and (s2 <= tau * (1 + 1e-12)).all()
    if hq == hkv:  # Kimi K2's MHA form: sqrt(gamma) on each of W_q and W_k
        gamma = torch.clamp(tau / s, max=1.0)
        assert torch.allclose(qf, gamma.sqrt(), rtol=1e-14) and torch.allclose(kf, gamma.sqrt(), rtol=1e-14)
    # untouched when nothing exceeds tau; alpha moves the rescale between q and k
    q1, k1 = clip_factors(s, hkv, QKClipConfig(tau=float(s.max()) * 2))
    assert (q1 == 1).all() and (k1 == 1).all()
    qa, ka = clip_factors(s, hkv, QKClipConfig(tau=tau, alpha=1.0))
    assert (ka == 1).all() and torch.allclose(qa, torch.clamp(tau / s, max=1.0))
    with pytest.raises(ValueError, match="tau"):
        clip_factors(s, hkv, QKClipConfig(tau=0.0))


def test_layers_pack_for_one_all_reduce_and_give_the_weights_to_rescale():
    from dmuon.functional.qk_clip import (check_layers, pack_max_logits, unpack_max_logits,
                                          weight_factors)
    layers = {"b": ("b.q", "b.k", 1), "a": ("a.q", "a.k", 2)}
    local = {"b": torch.tensor([5.0]), "a": torch.tensor([300.0, 10.0], dtype=F64)}
    check_layers(local, layers, {"a.q", "a.k", "b.q", "b.k"})
    with pytest.raises(ValueError, match="'b.k' \\(layer 'b'\\) is not a dedicated param"):
        check_layers(local, layers, {"a.q", "a.k", "b.q"})
    with pytest.raises(ValueError, match="give both for the same layers"):
        check_layers({"a": local["a"]}, layers, {"a.q", "a.k", "b.q", "b.k"})
    flat = pack_max_logits(local, torch.device("cpu"))
    assert flat.tolist() == [300.0, 10.0, 5.0, 0.0] and flat.dtype == F64   # sorted, flag last
    got = unpack_max_logits(flat, local)
    assert list(got) == ["a", "b"] and got["a"].tolist() == [300.0, 10.0]
    bad = pack_max_logits({"a": torch.tensor([-math.inf, 1.0]), "b": local["b"]}, "cpu")
    with pytest.raises(ValueError, match="NaN or Inf on some rank"):
        unpack_max_logits(bad, local)
    f = weight_factors(got, layers, QKClipConfig(tau=100.0))   # layer b stays under tau
    qf, kf = clip_factors(got["a"], 2, QKClipConfig(tau=100.0))
    assert list(f) == ["a.q", "a.k"] and torch.equal(f["a.q"], qf) and torch.equal(f["a.k"], kf)


def qk_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from models import make_model, muon_predicate
    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.stateful.extras.qk_clip import qk_clip_
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    dedicate_params(model, mesh, muon_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layers = {f"layers.{i}": (f"layers.{i}.self_attn.q_proj.weight",
                              f"layers.{i}.self_attn.k_proj.weight", 2) for i in range(2)}
    local = {"layers.0": torch.tensor([10.0 + 150 * rank, 300.0 - 250 * rank], dtype=F64),
             "layers.1": torch.tensor([50.0, 20.0 + rank], dtype=F64)}
    glob = qk_clip_(model, local, layers, QKClipConfig(tau=100.0))
    ids = torch.arange(9).remainder(32).unsqueeze(0)
    with torch.no_grad():
        loss = float(model(ids))  # the next forward sees the owners' rescaled masters
    sd = get_model_state_dict(model)
    # a NaN max logit on one rank only: a MAX all-reduce may drop it; every rank must raise
    nan = {"layers.0": torch.tensor([float("nan") if rank == 1 else 500.0, 5.0], dtype=F64),
           "layers.1": torch.tensor([50.0, 20.0], dtype=F64)}
    try:
        qk_clip_(model, nan, layers, QKClipConfig(tau=100.0))
        nan_error = None
    except ValueError as e:
        nan_error = str(e)
    after = get_model_state_dict(model)
    unchanged = all(torch.equal(after[k], v) for k, v in sd.items())
    return {"sd": sd, "max": glob, "loss": loss, "nan_error": nan_error,
            "nan_unchanged": unchanged}


def check_qk(res):
    """2 ranks (qk_worker's results) == the functional clip applied in one process. Run in the
    shared spawned group of tests/test_views_hf.py::test_views_on_two_ranks."""
    from models import make_model
    ref = make_model()
    glob = {"layers.0": torch.tensor([160.0, 300.0], dtype=F64),
            "layers.1": torch.tensor([50.0, 21.0], dtype=F64)}
    with torch.no_grad():
        for lay, s in glob.items():
            att = ref.get_submodule(lay).self_attn
            qf, kf = clip_factors(s, 2, QKClipConfig(tau=100.0))
            nq, nk = apply_qk_clip(att.q_proj.weight, att.k_proj.weight, qf, kf)
            att.q_proj.weight.copy_(nq)
            att.k_proj.weight.copy_(nk)
        loss = float(ref(torch.arange(9).remainder(32).unsqueeze(0)))
    sd = ref.state_dict()
    for r in res:
        assert r["nan_error"] is not None and "NaN or Inf" in r["nan_error"], r["nan_error"]
        assert r["nan_unchanged"]
        assert all(torch.equal(r["max"][k], glob[k]) for k in glob)
        for k, v in sd.items():
            assert torch.allclose(r["sd"][k], v, rtol=0, atol=1e-14), k
        assert r["loss"] == pytest.approx(loss, rel=1e-12)
    # the clip changed layer 0's q/k (both heads over tau), not layer 1's
    base = make_model().state_dict()
    assert not torch.equal(sd["layers.0.self_attn.q_proj.weight"], base["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(sd["layers.1.self_attn.k_proj.weight"], base["layers.1.self_attn.k_proj.weight"])
