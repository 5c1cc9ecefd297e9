"""``fully_shard`` skips params carrying ``_dedicated_owner_rank`` once dmuon's patch is installed,
even when user code imported ``fully_shard`` *before* dmuon (a name bound to the original function)."""
from __future__ import annotations

from dist_utils import run_ranks


def _worker(rank, world):
    # import the public name first, as the HF recipe does
    from torch.distributed.fsdp import fully_shard  # noqa: I001
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import dmuon  # after fully_shard was imported: must install the hook (once the lead wires it)
    from dmuon.stateful import fsdp_patch

    out = {"wired": hasattr(dmuon, "dedicate_params")}
    out["installed_by_import"] = fsdp_patch.is_installed()
    fsdp_patch.install_fully_shard_patch()
    fsdp_patch.install_fully_shard_patch()  # idempotent
    import torch.distributed.fsdp._fully_shard._fsdp_init as init_mod
    fn = init_mod._get_managed_states
    out["single_wrap"] = not hasattr(getattr(fn, "__wrapped__", None), "_dmuon_skip_dedicated")
    out["installed_after"] = fsdp_patch.is_installed()

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 6, bias=False), nn.Linear(6, 2))
    model[0].weight._dedicated_owner_rank = 0
    model[1].weight._dedicated_owner_rank = 1 % world   # a module with no FSDP-managed param left
    before = model[0].weight.detach().clone()
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    out["types"] = {n: type(p).__name__ for n, p in model.named_parameters()}
    out["dedicated_untouched"] = bool(torch.equal(model[0].weight.detach(), before))
    # the public ignored_params argument still works alongside the patch
    m2 = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    fully_shard(m2, mesh=mesh, ignored_params={m2[1].bias})
    out["types2"] = {n: isinstance(p, DTensor) for n, p in m2.named_parameters()}
    return out


def test_patch_with_fully_shard_imported_first():
    results = run_ranks(_worker, 2)
    for out in results:
        if out["wired"]:  # dmuon/__init__.py exports the stateful API and installs the patch
            assert out["installed_by_import"]
        assert out["installed_after"] and out["single_wrap"]
        assert out["types"]["0.weight"] == "Parameter"
        assert out["types"]["1.weight"] == "Parameter"
        assert out["types"]["0.bias"] == "DTensor"
        assert out["types"]["2.weight"] == "DTensor"
        assert out["dedicated_untouched"]
        assert out["types2"] == {"0.weight": True, "0.bias": True, "1.weight": True,
                                 "1.bias": False}


def test_missing_hook_point_fails_loudly(monkeypatch):
    import pytest
    import torch.distributed.fsdp._fully_shard._fsdp_init as init_mod
    import torch.distributed.fsdp._fully_shard._fully_shard as fs_mod

    from dmuon.stateful import fsdp_patch

    monkeypatch.delattr(init_mod, "_get_managed_states")
    monkeypatch.delattr(fs_mod, "_get_managed_states", raising=False)
    with pytest.raises(RuntimeError, match="_get_managed_states"):
        fsdp_patch.install_fully_shard_patch()
