"""SPEC §5 on a real 4-rank gloo mesh: bad input raises a clear error on *every* rank, never a hang.

One spawned group (world 4, ``(R, G) = (2, 2)`` where a 2-D mesh is needed) checks:

* local mistakes made on one rank only (``fully_shard`` first, a predicate that raises, matches
  nothing or picks a vector, an int ``reshard_after_forward``) raise on all ranks (dedicate_params agrees before any collective);
* meta-device params; a mesh over a subset of the world; each replica passing its own 1-D shard
  mesh without ``replicate_mesh``; ``replicate size x shard size != world``; a mesh on another
  device type than the params; something that is not a DeviceMesh;
* a model ``fully_shard``-ed on another mesh than the one ``dedicate_params`` got (``Muon`` raises);
* ``Muon(model)`` twice: the superseded optimizer's ``step()`` raises, nothing changes;
* collective timeouts: ``dedicate_params(timeout=2 s)`` and one rank skips the forward: the others
  raise within the bound, naming the dmuon operation, hook group and ranks.

Other §5 items are proven elsewhere: ``tests/test_stateful_errors.py`` (fully_shard first, no
match, non-matrix, plan mismatch, bad state dict, NaN), ``tests/test_checkpoint_topology.py``
(checkpoint names / shapes, model and optimizer dicts), ``tests/test_hsdp.py`` (two steps with a
pending publish), ``tests/test_checkpoint_check.py`` (the pure name / shape check).
"""
from __future__ import annotations

import pytest

from dist_utils import assert_all_ranks, catch, run_ranks

TIMEOUT_S = 2.0



def _worker(rank, world):
    import datetime
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.compat.fsdp_patch import install_fully_shard_patch
    from dmuon.stateful.optimizer.muon import Muon
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict
    from models import make_batches, make_model, muon_predicate

    install_fully_shard_patch()
    mesh = init_device_mesh("cpu", (world,))
    mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out = {}

    def ded(model=None, m=mesh, pred=muon_predicate, **kw):
        return catch(lambda: dedicate_params(model if model is not None else make_model(), m,
                                              pred, **kw))

    # one rank's mistake raises everywhere
    m = make_model()
    if rank == 0:
        fully_shard(m, mesh=mesh)
    out["fsdp_first_rank0"] = ded(m)

    def boom(n, p):
        if rank == 1 and n == "layers.1.mlp.up_proj.weight":
            raise KeyError("oops")
        return muon_predicate(n, p)
    out["pred_raises"] = ded(pred=boom)
    out["no_match_rank2"] = ded(pred=lambda n, p: muon_predicate(n, p) and rank != 2)
    out["vector_rank3"] = ded(pred=lambda n, p: muon_predicate(n, p) or (rank == 3 and "norm" in n))
    # FSDP2's int reshard_after_forward (before: 2 ran as Z3, 0 raised at the first forward)
    out["reshard_int_rank1"] = ded(reshard_after_forward=2 if rank == 1 else True)
    with torch.device("meta"):
        meta_model = make_model()
    out["meta_whole"] = ded(meta_model)  # meta-device init (tests/test_meta_init.py)
    mixed = make_model()  # one selected matrix on meta, the others materialized
    mixed.layers[0].mlp.up_proj.weight = torch.nn.Parameter(
        torch.empty_like(mixed.layers[0].mlp.up_proj.weight, device="meta"))
    out["meta"] = ded(mixed)
    # meshes that do not match the process group
    out["sub_mesh"] = ded(m=DeviceMesh("cpu", [0, 1]))
    out["per_replica_1d"] = ded(m=mesh2d["shard"])
    out["rep_size"] = ded(m=mesh2d["shard"], replicate_mesh=mesh)
    out["both_2d_and_rep"] = ded(m=mesh2d, replicate_mesh=mesh2d["replicate"])
    out["device_type"] = ded(m=DeviceMesh("cuda", list(range(world))))
    out["not_a_mesh"] = ded(m=dist.group.WORLD)
    # the model still dedicates fine afterwards (no collective was left half-done)
    out["hsdp_ok"] = ded(m=mesh2d["shard"], replicate_mesh=mesh2d["replicate"])

    # fully_shard on another mesh than dedicate_params': Muon refuses
    m = make_model()
    dedicate_params(m, mesh, muon_predicate)
    for layer in m.layers:
        fully_shard(layer, mesh=mesh2d["shard"])
    fully_shard(m, mesh=mesh2d["shard"])
    out["fsdp_other_mesh"] = catch(lambda: Muon(m))

    # Muon(model) twice: the superseded one cannot step; the newest trains
    m = make_model()
    dedicate_params(m, mesh, muon_predicate)
    for layer in m.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    before = get_model_state_dict(m)
    old, new = Muon(m), Muon(m)
    ids = make_batches(1, 4)[0].chunk(world)[rank]
    m(ids).backward()
    out["old_step"] = catch(old.step)
    after = get_model_state_dict(m)
    out["old_untouched"] = all(torch.equal(before[k], v) for k, v in after.items())
    new.step()
    out["new_trains"] = any(not torch.equal(before[k], v)
                            for k, v in get_model_state_dict(m).items())

    # a rank that never arrives: the others get a clear error within the bound, not a hang
    m = make_model()  # no fully_shard: only dmuon's lane groups (timeout 2 s) talk in forward
    dedicate_params(m, mesh, muon_predicate, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    t0 = time.monotonic()
    if rank != world - 1:
        out["timeout"] = catch(lambda: m(ids).backward())
    out["timeout_s"] = time.monotonic() - t0
    dist.barrier()  # the default group (60 s) still works; the skipping rank waits here
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 4)


def test_one_rank_mistakes_raise_on_every_rank(results):
    assert_all_ranks(results, "fsdp_first_rank0", "RuntimeError", "before fully_shard")
    assert_all_ranks(results, "pred_raises", "RuntimeError", "predicate raised KeyError",
         "layers.1.mlp.up_proj.weight")
    assert "on ranks [1]" in results[0]["pred_raises"][1]
    assert_all_ranks(results, "no_match_rank2", "ValueError", "matched no")
    assert "on ranks [2]" in results[0]["no_match_rank2"][1]
    assert_all_ranks(results, "vector_rank3", "ValueError", "not a matrix", "norm")
    assert_all_ranks(results, "reshard_int_rank1", "TypeError", "must be a bool, got 2",
                     "no dmuon counterpart")
    assert "on ranks [1]" in results[0]["reshard_int_rank1"][1]


def test_meta_params(results):
    assert_all_ranks(results, "meta", "ValueError", "meta device", "to_empty")
    assert_all_ranks(results, "meta_whole", None)


def test_meshes_that_do_not_match_the_process_group(results):
    assert_all_ranks(results, "sub_mesh", "ValueError", "covers ranks [0, 1]", "ranks [0, 1, 2, 3]")
    assert_all_ranks(results, "per_replica_1d", "ValueError", "disagree on the mesh", "replicate_mesh")
    assert_all_ranks(results, "rep_size", "ValueError", "4 x 2 = 8", "world size 4")
    assert_all_ranks(results, "both_2d_and_rep", "ValueError", "not both")
    assert_all_ranks(results, "device_type", "ValueError", "'cuda'", "['cpu']", "model.to")
    assert_all_ranks(results, "not_a_mesh", "TypeError", "DeviceMesh")
    assert_all_ranks(results, "hsdp_ok", None)
    assert_all_ranks(results, "fsdp_other_mesh", "ValueError", "fully_shard-ed", "ranks [0, 1, 2, 3]")
    assert "ranks [0, 1]" in results[0]["fsdp_other_mesh"][1]
    assert "ranks [2, 3]" in results[3]["fsdp_other_mesh"][1]


def test_muon_twice(results):
    assert_all_ranks(results, "old_step", "RuntimeError", "newer dmuon.Muon", "Nothing was updated")
    for out in results:
        assert out["old_untouched"] and out["new_trains"]


def test_collective_timeout_is_bounded_and_reported(results):
    for out in results[:-1]:
        kind, msg = out["timeout"]
        assert kind == "RuntimeError", out["timeout"]
        assert msg.startswith("dmuon: the ") and "never reached" in msg, msg
        assert "ranks [0, 1, 2, 3]" in msg and "hook group 'layers." in msg, msg
        assert "timeout 0:00:02" in msg and "dedicate_params(..., timeout=...)" in msg, msg
        assert out["timeout_s"] < TIMEOUT_S + 8.0, out["timeout_s"]


def test_check_setups_pure():
    """The pure verdict, no processes: grids from each mesh form, and each mismatch's message."""
    from dmuon.functional.setup_check import RankSetup as S, check_fsdp_meshes, check_setups

    names = ("shard", "replicate")  # dims in the other order: the grid is transposed back
    assert check_setups([S(i, ((0, 2), (1, 3)), names) for i in range(4)], 4).grid == \
        ((0, 1), (2, 3))
    hsdp = [S(i, (2 * (i // 2), 2 * (i // 2) + 1), replicate=(i % 2, i % 2 + 2)) for i in range(4)]
    assert check_setups(hsdp, 4).grid == ((0, 1), (2, 3))
    bad = check_setups([S(i, ((0, 1), (2, 3)), ("a", "b")) for i in range(4)], 4)
    assert bad.grid is None and "mesh_dim_names" in bad.problems[0]
    dup = check_setups([S(i, (0, 0)) for i in range(2)], 2)
    assert dup.grid is None and "covers ranks [0, 0]" in dup.problems[0]
    err = check_setups([S(0, (0, 1), error=("ValueError", "x")), S(1, (0, 1))], 2)
    assert err.problems == ("on ranks [0]: ValueError: x",)
    from dmuon.functional.setup_check import error_type  # the type every rank raises it as
    assert error_type([S(0, (0, 1), error=("TypeError", "x")), S(1, (0, 1))]) is TypeError
    assert error_type([S(0, error=("TypeError", "x")), S(1, error=("KeyError", "y"))]) is ValueError
    assert check_fsdp_meshes(((0, 1),), "cpu", [("", (1, 0), "cpu")]) == ()
    (msg,) = check_fsdp_meshes(((0, 1),), "cpu", [("", (0, 1), "cuda"), ("l", (0, 1), "cuda")])
    assert "['<root>', 'l']" in msg and "'cuda'" in msg
