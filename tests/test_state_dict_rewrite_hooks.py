"""A dedicated param whose module's state-dict hooks rewrite its entry (the pattern of torchtitan's
``FusedQKVLinear``, without torchtitan): a fused ``qkv`` matrix that a post-hook of its parent saves
as ``q`` / ``k`` / ``v`` and a load pre-hook merges back.

On 2 gloo ranks, fp64, every in-layer matrix dedicated (``qkv`` too), FSDP2 on the rest:

- ``model.state_dict()`` has the split entries, and loaded into a plain single-process model gives
  the dmuon model's logits exactly;
- ``model.load_state_dict`` of a plain full dict and ``torch.distributed.checkpoint`` save -> load
  into a model with other weights restore it exactly;
- a NaN in ``q`` (only the merged ``qkv``, a dedicated entry, shows it) raises ``StateDictError``
  on every rank with nothing changed;
- ``dmuon.get_model_state_dict`` (by param name) raises ``StateDictError`` naming the module.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from dist_utils import catch, run_ranks


class FusedQKV(nn.Module):
    """One ``qkv`` projection, checkpointed as three (``q``, ``k``, ``v``) by its hooks."""

    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.register_state_dict_post_hook(FusedQKV._split)
        self.register_load_state_dict_pre_hook(FusedQKV._merge)

    def forward(self, x):
        return self.qkv(x).chunk(3, dim=-1)

    @staticmethod
    def _split(module, sd, prefix, local_metadata) -> None:
        key = prefix + "qkv.weight"
        if key not in sd:
            return
        w = sd.pop(key)
        if hasattr(w, "redistribute"):  # rows of a DTensor: make every rank hold it whole
            from torch.distributed.tensor import Replicate
            w = w.redistribute(w.device_mesh, [Replicate()] * w.device_mesh.ndim)
        for name, part in zip("qkv", w.chunk(3, dim=0)):
            sd[f"{prefix}{name}.weight"] = part.contiguous()

    @staticmethod
    def _merge(module, sd, prefix, *rest) -> None:
        keys = [f"{prefix}{n}.weight" for n in "qkv"]
        if all(k in sd for k in keys):
            sd[prefix + "qkv.weight"] = torch.cat([sd.pop(k) for k in keys], dim=0)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attn = FusedQKV(dim)
        self.o = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim, dtype=torch.float64)

    def forward(self, x):
        q, k, v = self.attn(self.norm(x))
        a = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        x = x + self.o(a)
        return x + self.down(torch.tanh(self.up(x)))


class Model(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


_IDS = torch.arange(24).view(2, 12) % 32
_Q = "layers.0.attn.q.weight"


def _model(seed: int) -> Model:
    torch.manual_seed(seed)
    return Model().double()


def _dedicated(seed: int, mesh) -> Model:
    from torch.distributed.fsdp import fully_shard

    import dmuon
    model = _model(seed)
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and n.startswith("layers."))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(sd: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in sd.items()}


def _logits(model):
    with torch.no_grad():
        return model(_IDS)


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _worker(rank: int, world: int, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    a = _dedicated(0, mesh)
    sd = _full(a.state_dict())
    out["keys"], out["sd"], out["logits"] = sorted(sd), sd, _logits(a)

    b = _dedicated(1, mesh)  # other weights: plain full dict
    b.load_state_dict(sd)
    out["plain_load"] = _same(_full(b.state_dict()), sd) and torch.equal(_logits(b), out["logits"])

    dcp.save(a.state_dict(), checkpoint_id=folder)  # DCP, as torchtitan's checkpointer does
    c = _dedicated(2, mesh)
    target = c.state_dict()
    dcp.load(target, checkpoint_id=folder)
    c.load_state_dict(target)
    out["dcp_load"] = _same(_full(c.state_dict()), sd) and torch.equal(_logits(c), out["logits"])

    d = _dedicated(3, mesh)
    before = _full(d.state_dict())
    bad = dict(sd)  # a's values everywhere (a partial load would show), a NaN in q
    bad[_Q] = torch.full_like(bad[_Q], float("nan"))
    out["bad"] = catch(lambda: d.load_state_dict(bad))
    out["unchanged"] = _same(_full(d.state_dict()), before)

    out["by_name"] = catch(lambda: dmuon.get_model_state_dict(a))
    return out


def test_rewritten_dedicated_entries_save_and_load_exactly(tmp_path):
    res = run_ranks(_worker, 2, str(tmp_path / "dcp"), timeout=90)
    sd = res[0]["sd"]
    assert _Q in sd and not any("qkv" in k for k in sd), sorted(sd)
    ref = Model().double()
    ref.load_state_dict(sd, strict=True)
    want = _logits(ref)
    for r in res:
        assert _same(r["sd"], sd)
        assert torch.equal(r["logits"], want)
        assert r["plain_load"] and r["dcp_load"]
        kind, msg = r["bad"]
        assert kind == "StateDictError" and "layers.0.attn.qkv.weight: non-finite" in msg, r["bad"]
        assert r["unchanged"]
        kind, msg = r["by_name"]
        assert kind == "StateDictError" and "'layers.0.attn' (FusedQKV)" in msg, r["by_name"]
