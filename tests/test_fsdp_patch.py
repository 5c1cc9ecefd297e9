"""The ``fully_shard`` patch: its contract, its lifecycle, and what happens when it does not act.

* Contract: ``fully_shard`` skips params carrying ``_dedicated_owner_rank`` once dmuon's patch is
  installed, even when user code imported ``fully_shard`` *before* dmuon (a name bound to the
  original function); a module all of whose params are dedicated is left out of FSDP2's managed
  modules, as with ``fully_shard(..., ignored_params=...)``.
* Lifecycle: installing twice wraps once; :func:`remove_fully_shard_patch` restores torch's very
  functions; ``dedicate_params`` installs it again.
* A dedicated param FSDP2 took over (the patch removed before ``fully_shard``) makes the first
  forward and ``dmuon.Muon`` raise, naming the patch and the torch version.
* ``fully_shard`` with per-param meshes (``shard_placement_fn``: several FSDP2 param groups on one
  module, torch >= 2.13) works under ``dmuon.Muon`` (it used a torch property that asserted one).
* On a torch outside the supported range ``import dmuon`` warns, the pure core works, and
  ``dedicate_params`` raises naming the range.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import catch, run_ranks

ROOT = Path(__file__).parents[1]


def _patch_contract(world, mesh):
    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_init as init_mod
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from dmuon.compat import fsdp_patch

    out = {"installed_by_import": fsdp_patch.is_installed()}
    fsdp_patch.install_fully_shard_patch()
    fsdp_patch.install_fully_shard_patch()  # idempotent
    fn = init_mod._get_managed_states
    out["single_wrap"] = not hasattr(getattr(fn, "__wrapped__", None), "_dmuon_skip_dedicated")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 6, bias=False), nn.Linear(6, 2))
    model[0].weight._dedicated_owner_rank = 0
    model[1].weight._dedicated_owner_rank = 1 % world   # a module with no FSDP-managed param left
    managed = init_mod._get_managed_modules((model,), None)
    out["all_dedicated_module_managed"] = any(m is model[1] for m in managed)
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


def _lifecycle():
    import torch.distributed.fsdp._fully_shard._fsdp_init as init_mod

    from dmuon.compat import fsdp_patch

    wrapped = {n: getattr(init_mod, n) for n in ("_get_managed_states", "_get_managed_modules")}
    originals = {n: f.__wrapped__ for n, f in wrapped.items()}
    fsdp_patch.remove_fully_shard_patch()
    out = {"removed": not fsdp_patch.is_installed(),
           "restored_exactly": all(getattr(init_mod, n) is f for n, f in originals.items())}
    fsdp_patch.remove_fully_shard_patch()  # no-op
    fsdp_patch.install_fully_shard_patch()
    out["reinstalled"] = fsdp_patch.is_installed()
    return out


def _taken_over(rank, world, mesh):
    import torch
    from models import make_model, muon_predicate
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.compat import fsdp_patch

    out = {}
    torch.manual_seed(0)
    model = make_model(n_layers=1)
    dmuon.dedicate_params(model, mesh, muon_predicate)
    fsdp_patch.remove_fully_shard_patch()  # as if a torch update had moved the hook points
    try:  # FSDP2 reads the placeholder to shard it: the placeholder guard refuses
        out["fully_shard"] = catch(lambda: fully_shard(model.layers[0], mesh=mesh))
    finally:
        fsdp_patch.install_fully_shard_patch()
    # a dedicated param replaced behind dmuon's back (here by hand): the first forward and
    # dmuon.Muon refuse the model
    model2 = make_model(n_layers=1)
    dmuon.dedicate_params(model2, mesh, muon_predicate)
    q = model2.layers[0].self_attn.q_proj
    q.weight = torch.nn.Parameter(torch.zeros(16, 16, dtype=torch.float64))
    fully_shard(model2, mesh=mesh)
    ids = torch.randint(0, 32, (2, 8))
    out["forward"] = catch(lambda: model2(ids))
    out["muon"] = catch(lambda: dmuon.Muon(model2))
    return out


def _several_param_groups(rank, world, mesh):
    import torch
    from models import make_model, muon_predicate
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo,
                                                                  ShardPlacementResult)
    from torch.distributed.tensor import Shard

    import dmuon
    from dmuon.compat.torch_api import fsdp_param_groups, fsdp_state

    torch.manual_seed(0)
    model = make_model(n_layers=1)
    dmuon.dedicate_params(model, mesh, muon_predicate)
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    other_pg = dist.new_group(list(range(world)))  # the same ranks, another process group
    other = FSDPMeshInfo(DeviceMesh.from_group(other_pg, "cpu"), shard_mesh_dim=0)

    def placement(p):
        return ShardPlacementResult(Shard(0), other) if p is model.norm.weight else None

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    n_groups = len(fsdp_param_groups(fsdp_state(model)))
    opt = dmuon.Muon(model)
    ids = torch.randint(0, 32, (2, 8))
    for _ in range(2):
        opt.zero_grad()
        model(ids).backward()
        opt.step()
    return {"groups": n_groups, "stepped": opt.num_steps}


def _worker(rank, world):
    # import the public name first, as the HF recipe does
    from torch.distributed.fsdp import fully_shard  # noqa: F401,I001
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon  # noqa: F401 - after fully_shard was imported: must install the hook

    mesh = init_device_mesh("cpu", (world,))
    out = {"contract": _patch_contract(world, mesh), "lifecycle": _lifecycle(),
           "taken_over": _taken_over(rank, world, mesh)}
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult  # noqa
    except ImportError:  # torch 2.11 / 2.12: one param group per module
        out["several"] = None
    else:
        out["several"] = _several_param_groups(rank, world, mesh)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 2)


def test_patch_with_fully_shard_imported_first(results):
    for out in results:
        c = out["contract"]
        assert c["installed_by_import"] and c["single_wrap"]
        assert c["types"]["0.weight"] == "Parameter"
        assert c["types"]["1.weight"] == "Parameter"
        assert c["types"]["0.bias"] == "DTensor"
        assert c["types"]["2.weight"] == "DTensor"
        assert c["dedicated_untouched"]
        assert not c["all_dedicated_module_managed"]   # _get_managed_modules is wrapped too
        assert c["types2"] == {"0.weight": True, "0.bias": True, "1.weight": True,
                               "1.bias": False}


def test_remove_restores_torch_functions(results):
    for out in results:
        assert out["lifecycle"] == {"removed": True, "restored_exactly": True,
                                    "reinstalled": True}


def test_taken_over_params_raise_naming_the_patch(results):
    import torch
    for out in results:
        kind, msg = out["taken_over"]["fully_shard"]
        assert kind == "DedicatedParamError", (kind, msg)
        assert "patch is NOT installed" in msg and torch.__version__ in msg, msg
        for key in ("forward", "muon"):
            kind, msg = out["taken_over"][key]
            assert kind == "RuntimeError", (key, kind, msg)
            assert "q_proj.weight" in msg and "patch" in msg and torch.__version__ in msg


def test_several_fsdp_param_groups_per_module(results):
    for out in results:
        if out["several"] is None:
            pytest.skip("this torch has one FSDP2 param group per module")
        assert out["several"] == {"groups": 2, "stepped": 2}


def test_missing_hook_point_fails_loudly(monkeypatch):
    import torch.distributed.fsdp._fully_shard._fsdp_init as init_mod
    import torch.distributed.fsdp._fully_shard._fully_shard as fs_mod

    from dmuon.compat import fsdp_patch

    monkeypatch.delattr(init_mod, "_get_managed_states")
    monkeypatch.delattr(fs_mod, "_get_managed_states", raising=False)
    with pytest.raises(RuntimeError, match="_get_managed_states"):
        fsdp_patch.install_fully_shard_patch()


_UNSUPPORTED = r"""
import warnings, torch
torch.__version__ = "2.10.0"  # older than the range (a newer one runs: tests/test_torch_newer.py)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import dmuon
from dmuon.compat import fsdp_patch
print("WARNED", any("needs torch >= 2.11" in str(x.message) for x in w))
print("PATCHED", fsdp_patch.is_installed())
x = torch.randn(8, 4, dtype=torch.float64)
from dmuon.newton_schulz import newton_schulz
u = newton_schulz(x, dtype=torch.float64)
print("CORE", tuple(u.shape))
try:
    dmuon.dedicate_params(torch.nn.Linear(4, 4), None, lambda n, p: True)
except RuntimeError as e:
    print("RAISED", "needs torch >= 2.11" in str(e) and "2.10.0" in str(e))
"""


def test_unsupported_torch_warns_and_dedicate_raises():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _UNSUPPORTED], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    for want in ("WARNED True", "PATCHED False", "CORE (8, 4)", "RAISED True"):
        assert want in lines, (want, proc.stdout, proc.stderr[-2000:])
