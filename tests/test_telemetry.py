"""``Muon.last_step_stats()``: lane counters per step, NS time and mode, ownership (CPU, gloo)."""
from __future__ import annotations

import torch

from dist_utils import run_ranks
from models import make_batches, make_model, muon_predicate


def _train(rank, world, ns_engine, steps=3):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.stateful.optimizer.muon import Muon
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    dedicate_params(model, mesh, muon_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(model, lr=0.02, weight_decay=0.01, ns_dtype=torch.float64, ns_engine=ns_engine)
    rt = opt.dedicated_state
    out = {"before": opt.last_step_stats(), "stats": [], "counters": []}
    for ids in make_batches(steps, 4):
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()
        st = opt.last_step_stats()
        out["stats"].append(st.as_dict())
        out["counters"].append(rt.executor.counters())
    out["owned"] = list(rt.owned_names)
    out["owned_numel"] = sum(rt.masters[n].numel() for n in rt.owned_names)
    out["n_dedicated"] = len(rt.names)
    out["grad_buffers"] = len(rt.pool.buffers)
    sd = get_model_state_dict(model)
    out["sd"] = {k: v.detach().clone() for k, v in sd.items()}
    return out


def _worker(rank, world):
    import torch.distributed as dist
    res = {"functional": _train(rank, world, "auto"), "engine": _train(rank, world, "engine")}
    dist.barrier()
    return res


def test_last_step_stats_cpu():
    world = 2
    results = run_ranks(_worker, world)
    n_owned = [len(results[r]["functional"]["owned"]) for r in range(world)]
    assert sum(n_owned) == results[0]["functional"]["n_dedicated"]
    for r in range(world):
        res = results[r]["functional"]
        assert res["before"] is None
        prev = {lane: {k: 0 for k in c} for lane, c in res["counters"][0].items()}
        for i, (st, cnt) in enumerate(zip(res["stats"], res["counters"])):
            assert st["step"] == i + 1
            assert st["owned_matrices"] == n_owned[r]
            assert st["owned_elements"] == res["owned_numel"]
            assert st["dedicated_matrices"] == res["n_dedicated"]
            assert st["host_syncs"] == 0 and st["device"] == "cpu"
            assert st["adamw_impl"] == "reference"
            # per-step lane counters are the differences of the executor's cumulative counters
            for lane, c in cnt.items():
                for k, v in c.items():
                    assert st["lanes"][lane][k] == v - prev[lane][k], (lane, k)
            prev = cnt
            # world 2, no HSDP: every step gathers and reduces, nothing is published
            assert st["lanes"]["unshard"]["collectives"] > 0
            assert st["lanes"]["reduce"]["collectives"] > 0
            assert st["lanes"]["replicate"]["collectives"] == 0
            assert st["collectives"] == sum(c["collectives"] for c in st["lanes"].values())
            assert st["payload_bytes"] > 0
            if n_owned[r]:
                assert st["ns_mode"] == "functional" and st["ns_calls"] == 1
                assert st["ns_ms"] is not None and st["ns_ms"] > 0
            else:
                assert st["ns_mode"] == "none" and st["ns_calls"] == 0 and st["ns_ms"] is None
        # the steps are identical in shape: same traffic every step
        assert res["stats"][1]["lanes"] == res["stats"][2]["lanes"]
        assert res["grad_buffers"] >= 1 if n_owned[r] else True
        eng = results[r]["engine"]
        if n_owned[r]:
            assert all(s["ns_mode"] == "eager" for s in eng["stats"])
        # the engine (batched per shape, fp64) computes the same NS as the functional core
        for k, v in res["sd"].items():
            w = eng["sd"][k]
            assert (w - v).norm() <= 1e-10 * max(1.0, float(v.norm())), k
