"""One rank's setup as ``dedicate_params`` all-gathers it (:func:`dmuon.functional.setup_check.
rank_setup`), read from DeviceMesh-like objects without any process group."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from dmuon.functional.setup_check import RankSetup, check_setups, rank_setup


def _mesh(ranks, names=None, device_type="cpu"):
    return SimpleNamespace(mesh=torch.tensor(ranks), mesh_dim_names=names, device_type=device_type)


def test_read_from_meshes():
    su = rank_setup(1, _mesh([[0, 1], [2, 3]], ("replicate", "shard")),
                    param_device_types=["cpu", "cpu"], tp_ranks=[1, 5])
    assert su == RankSetup(rank=1, mesh=((0, 1), (2, 3)), mesh_dim_names=("replicate", "shard"),
                           mesh_device_type="cpu", param_device_types=("cpu",), tp=(1, 5))
    hsdp = rank_setup(2, _mesh([2, 3]), _mesh([0, 2]))
    assert hsdp.mesh == (2, 3) and hsdp.mesh_dim_names is None
    assert hsdp.replicate == (0, 2) and hsdp.replicate_device_type == "cpu"
    assert check_setups([rank_setup(r, _mesh([0, 1])) for r in range(2)], 2).grids == (((0, 1),),)


def test_not_a_mesh_and_local_errors():
    su = rank_setup(0, [0, 1])
    assert su.error[0] == "TypeError" and "got list / NoneType" in su.error[1]
    err = ValueError("bad predicate")
    assert rank_setup(0, [0, 1], local_err=err).error == ("ValueError", "bad predicate")
    assert rank_setup(0, _mesh([0]), local_err=err).error == ("ValueError", "bad predicate")
