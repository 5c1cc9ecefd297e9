"""Bad input to the stateful layer raises a clear exception on every rank (never a hang)."""
from __future__ import annotations

from dist_utils import assert_all_ranks, catch, run_ranks



def _worker(rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.compat.fsdp_patch import install_fully_shard_patch
    from dmuon.stateful.optimizer.muon import Muon
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from models import make_batches, make_model, muon_predicate

    install_fully_shard_patch()
    mesh = init_device_mesh("cpu", (world,))
    out = {}

    m = make_model()
    fully_shard(m, mesh=mesh)
    out["fsdp_first"] = catch(lambda: dedicate_params(m, mesh, muon_predicate))

    out["no_match"] = catch(lambda: dedicate_params(make_model(), mesh, lambda n, p: "nope" in n))
    # a split_ns that is wrong on one rank only: every rank raises (agreed), none waits
    from dmuon.functional.dedicate_options import DedicateOptions
    out["split_ns_one_rank"] = catch(lambda: dedicate_params(
        make_model(), mesh, muon_predicate, options=DedicateOptions(split_ns=0 if rank else 1)))
    out["non_matrix"] = catch(lambda: dedicate_params(make_model(), mesh, lambda n, p: "norm" in n))
    out["muon_without"] = catch(lambda: Muon(make_model()))
    out["muon_not_model"] = catch(lambda: Muon(list(make_model().parameters())))

    from torch.distributed.tensor import Replicate, distribute_tensor
    m = make_model()
    w = m.layers[0].mlp.up_proj.weight
    m.layers[0].mlp.up_proj.weight = torch.nn.Parameter(distribute_tensor(w.detach(), mesh, [Replicate()]))
    out["dtensor"] = catch(lambda: dedicate_params(m, mesh, muon_predicate))

    # plans that differ across ranks (rank 1 builds a different model)
    odd = make_model(hidden=24 if rank == 0 else 32)
    out["plan_mismatch"] = catch(lambda: dedicate_params(odd, mesh, muon_predicate))

    m = make_model()
    dedicate_params(m, mesh, muon_predicate)
    out["twice"] = catch(lambda: dedicate_params(m, mesh, muon_predicate))
    for layer in m.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    good = get_model_state_dict(m)
    bad = dict(good)
    if rank == 1:   # only one rank's dict is wrong: every rank must still raise
        del bad["layers.0.mlp.up_proj.weight"]
        bad["extra.weight"] = torch.zeros(2)
        bad["norm.weight"] = torch.zeros(3)
    out["bad_sd"] = catch(lambda: set_model_state_dict(m, bad))
    # another dedicated model's own state_dict() (DTensors): refused on every rank before anything
    # changes, with and without rank0_only (was a torch error half-way / rank 1 hung)
    other = make_model(seed=3)
    dedicate_params(other, mesh, muon_predicate)
    for layer in other.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(other, mesh=mesh)
    sharded = other.state_dict()
    for r0 in (False, True):
        out[f"dtensor_sd_{r0}"] = catch(lambda: set_model_state_dict(m, sharded, rank0_only=r0))
        out[f"dtensor_sd_untouched_{r0}"] = all(
            torch.equal(good[k], v) for k, v in get_model_state_dict(m).items())
    # still usable afterwards (no collective was left half-done)
    set_model_state_dict(m, good)
    out["after_ok"] = all(torch.equal(good[k], v) for k, v in get_model_state_dict(m).items())

    # NaN in one rank's gradient: step raises on every rank, nothing is updated
    opt = Muon(m, ns_dtype=torch.float64)
    ids = make_batches(1, 4)[0].chunk(world)[rank]
    m(ids).backward()
    if rank == 0:
        g = m.norm.weight.grad
        (g.to_local() if hasattr(g, "to_local") else g).fill_(float("nan"))
    out["nan"] = catch(opt.step)
    out["nan_untouched"] = all(torch.equal(good[k], v) for k, v in get_model_state_dict(m).items())
    opt.zero_grad()
    m(ids).backward()
    opt.step()
    out["after_nan_trains"] = any(not torch.equal(good[k], v)
                                  for k, v in get_model_state_dict(m).items())

    # a step that fails part-way on rank 0 only (inside Newton-Schulz, after the momentum moved):
    # raises on every rank, then refuses until a reload; reloaded, it trains as a clean run
    # (tests/test_step_failure.py: every case, slow tier)
    import dmuon
    ckpt = (get_model_state_dict(m), dmuon.get_optimizer_state_dict(m, opt))

    def iteration():
        opt.zero_grad()
        m(ids).backward()
        opt.step()
    iteration()
    clean = get_model_state_dict(m)
    dmuon.set_model_state_dict(m, ckpt[0])
    dmuon.set_optimizer_state_dict(m, opt, ckpt[1])
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated OOM inside Newton-Schulz")
    ns = opt._orthogonalizer
    if rank == 0:
        opt._orthogonalizer = lambda spec, names: oom
    out["failed_step"] = catch(iteration)
    opt._orthogonalizer = ns
    out["step_again"] = catch(opt.step)
    out["iteration_again"] = catch(iteration)
    out["save_broken"] = catch(lambda: dmuon.get_optimizer_state_dict(m, opt))  # a half step
    dmuon.set_model_state_dict(m, ckpt[0])
    dmuon.set_optimizer_state_dict(m, opt, ckpt[1])
    iteration()
    out["reloaded_equals_clean"] = all(torch.equal(clean[k], v)
                                       for k, v in get_model_state_dict(m).items())
    return out


def test_errors():
    results = run_ranks(_worker, 2)
    assert_all_ranks(results, "fsdp_first", "RuntimeError", "before fully_shard")
    assert_all_ranks(results, "no_match", "ValueError", "matched no")
    assert_all_ranks(results, "non_matrix", "ValueError", "not a matrix", "norm")
    assert_all_ranks(results, "muon_without", "RuntimeError", "dedicate_params")
    assert_all_ranks(results, "muon_not_model", "TypeError")
    assert_all_ranks(results, "dtensor", "TensorParallelUnsupported", "not a row- or column-sharded",
                     "apply tensor parallelism first")
    assert_all_ranks(results, "plan_mismatch", "RuntimeError", "ranks [0]", "ranks [1]")
    assert_all_ranks(results, "twice", "RuntimeError", "already")
    assert_all_ranks(results, "split_ns_one_rank", "ValueError", "split_ns")
    assert_all_ranks(results, "bad_sd", "StateDictError")  # a ValueError
    msg = results[1]["bad_sd"][1]   # rank 1's own dict was the wrong one: its message names why
    assert "layers.0.mlp.up_proj.weight" in msg and "extra.weight" in msg
    assert "norm.weight" in msg
    for r0 in (False, True):
        assert_all_ranks(results, f"dtensor_sd_{r0}", "StateDictError", "a DTensor, not a full")
        assert all(out[f"dtensor_sd_untouched_{r0}"] for out in results)
    assert_all_ranks(results, "nan", "FloatingPointError", "ranks [0]")
    for out in results:
        assert out["after_ok"]
        assert out["nan_untouched"] and out["after_nan_trains"]
    assert_all_ranks(results, "failed_step", "RuntimeError", "failed part-way",
                     "rank(s) [0]: OutOfMemoryError: simulated OOM",
                     "Reload", "load_state_dict", "set_optimizer_state_dict", "load_sharded")
    for k in ("step_again", "iteration_again"):
        assert_all_ranks(results, k, "RuntimeError", "refused", "failed part-way", "Reload")
    assert_all_ranks(results, "save_broken", "RuntimeError", "a checkpoint of the optimizer",
                     "refused", "failed part-way")
    assert all(out["reloaded_equals_clean"] for out in results)
