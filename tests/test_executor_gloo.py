"""The torch.distributed executor on gloo equals the simulator, with the very same schedule objects;
its payload counters equal the schedule accounting; the lane process groups come from explicit sizes
or from a DeviceMesh (2-D, or 1-D shard + 1-D replicate). Also tests ``dist_utils.run_ranks``."""
import pytest
import torch

from dist_utils import run_ranks
from dmuon.functional.program import program_from_layouts, step_traffic
from dmuon.functional.simulate import simulate
from sched_cases import random_buffers, random_layout


def _sequence(steps, layout):
    """The schedules a training step runs, in order: unshard all, reduce all, publish."""
    seq = ([steps.groups[g].unshard for g in layout.groups]
           + [steps.groups[g].reduce for g in layout.groups])
    if len(steps.publish_all()):
        seq.append(steps.publish_all())
    return seq


def _worker(rank, world, layout, *, seed):
    import torch.distributed as dist
    from dmuon.stateful.runtime.executor import Executor
    from dmuon.stateful.runtime.process_groups import make_process_groups

    G, R = layout.shard_size, layout.replicate_size
    res = {}
    mg = make_process_groups(shard_size=G, replicate_size=R)
    res["coord"] = mg.coord
    ex = Executor(mg)
    steps = program_from_layouts(layout, layout, layout)
    seq = _sequence(steps, layout)
    # 1) each schedule launched and waited in turn, on integer-valued and random data
    for kind in ("int", "randn"):
        bufs = random_buffers(layout, seed, integer=(kind == "int"))[rank]
        snaps = []
        for sched in seq:
            ex.launch(sched, bufs).wait()
            snaps.append({k: v.clone() for k, v in bufs.items()})
        res[kind] = snaps
    # 2) everything launched back to back without host waits, each launch ordered after the
    #    previous one by `after` (same buffers: a real data dependency); waited in reverse order.
    #    HSDP stage-2 ops stay queued behind their stage 1, later launches queue behind them.
    bufs = random_buffers(layout, seed + 1)[rank]
    pend = []
    for sched in seq:
        pend.append(ex.launch(sched, bufs, after=pend[-1:]))
    for p in reversed(pend):
        p.wait()
    assert all(p.is_completed() for p in pend)
    res["async"] = bufs
    # 3) counters: one Z2 step and one Z3 step (re-unshard in backward)
    bufs = random_buffers(layout, seed)[rank]
    ex.reset_counters()
    for sched in seq:
        ex.launch(sched, bufs).wait()
    res["z2"] = ex.counters()
    ex.reset_counters()
    p = [ex.launch(steps.groups[g].unshard, bufs) for g in layout.groups]
    p += [ex.launch(steps.groups[g].unshard, bufs) for g in layout.groups]
    p += [ex.launch(steps.groups[g].reduce, bufs) for g in layout.groups]
    p.append(ex.launch(steps.publish_all(), bufs, after=p[-1]))
    for x in p:
        x.wait()
    res["z3"] = ex.counters()
    # 4) gloo's own AVG reduce overwrites non-destination buffers (why the simulator poisons)
    x = torch.arange(4, dtype=torch.float64) + rank
    dist.reduce(x, dst=0, op=dist.ReduceOp.AVG)
    res["avg_dst"] = x if rank == 0 else None
    # 5) groups from a DeviceMesh: 2-D (replicate, shard) and 1-D shard + 1-D replicate meshes
    if R > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (R, G), mesh_dim_names=("replicate", "shard"))
        mg2 = make_process_groups(mesh)
        mg1 = make_process_groups(mesh["shard"], replicate_mesh=mesh["replicate"])
        res["grids"] = (mg2.grid, mg1.grid, mg2.coord, mg1.coord)
        bufs = random_buffers(layout, seed)[rank]
        ex2 = Executor(mg1)
        for sched in seq:
            ex2.launch(sched, bufs).wait()
        res["mesh_final"] = bufs
    return res


def _check_equal(got, want, exact):
    for k, w in want.items():
        g = got[k]
        defined = ~torch.isnan(w)
        if exact:
            assert torch.equal(g[defined], w[defined]), k
        else:
            torch.testing.assert_close(g[defined], w[defined], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("G,R,seed", [pytest.param(2, 1, 0, marks=pytest.mark.slow),
                                       pytest.param(4, 1, 1, marks=pytest.mark.slow),
                                       pytest.param(2, 2, 2, marks=pytest.mark.slow)])
def test_gloo_executor_matches_simulator(G, R, seed):
    layout, _, _, _ = random_layout(seed, G=G, R=R, n_layers=2)
    W = G * R
    results = run_ranks(_worker, W, layout, seed=seed)   # also checks args/kwargs passing
    steps = program_from_layouts(layout, layout, layout)
    seq = _sequence(steps, layout)
    assert [r["coord"] for r in results] == [(i % G, i // G) for i in range(W)]
    for kind in ("int", "randn"):
        state = random_buffers(layout, seed, integer=(kind == "int"))
        for i, sched in enumerate(seq):
            state = simulate(sched, state)
            for rank in range(W):
                # int data: every order of summation is exact -> bitwise; randn: 2 ranks per
                # group is one addition (bitwise), 4 ranks may associate differently -> 1e-13
                _check_equal(results[rank][kind][i], state[rank], exact=(kind == "int" or G == 2))
    state = random_buffers(layout, seed + 1)
    for sched in seq:
        state = simulate(sched, state)
    for rank in range(W):
        _check_equal(results[rank]["async"], state[rank], exact=(G == 2))
    # counters == schedule accounting, per rank and lane; averages are the spec's figures
    P = layout.nbytes()
    for mode in ("z2", "z3"):
        tr = step_traffic(layout, reshard_after_forward=(mode == "z3"))
        for rank in range(W):
            assert results[rank][mode] == tr.for_rank(rank)
        k = 2 if mode == "z2" else 3
        for key in ("sent_bytes", "received_bytes"):
            tot = sum(results[rank][mode][lane][key] for rank in range(W)
                      for lane in ("unshard", "reduce"))
            assert tot == k * (G - 1) * P * R          # mean per rank = k (G-1)/G P
            rep = sum(results[rank][mode]["replicate"][key] for rank in range(W))
            assert rep == 2 * (R - 1) * P              # stage-2 reduce (R-1)P + publish (R-1)P
    assert torch.equal(results[0]["avg_dst"],
                       torch.arange(4, dtype=torch.float64) + (W - 1) / 2)
    if R > 1:
        grid = tuple(tuple(r * G + s for s in range(G)) for r in range(R))
        for rank, res in enumerate(results):
            g2, g1, c2, c1 = res["grids"]
            assert g2 == g1 == grid and c2 == c1 == (rank % G, rank // G)
        state = random_buffers(layout, seed)
        for sched in seq:
            state = simulate(sched, state)
        for rank in range(W):
            _check_equal(results[rank]["mesh_final"], state[rank], exact=True)


def _failing_worker(rank, world):
    import torch.distributed as dist
    if rank == 1:
        raise RuntimeError("boom from rank 1")
    dist.barrier()   # rank 0 would wait forever for rank 1
    return rank


def test_run_ranks_reports_worker_failure():
    # rank 1 raises, rank 0 hangs in a barrier: the call fails with rank 1's traceback, no hang
    with pytest.raises(AssertionError, match="boom from rank 1") as info:
        run_ranks(_failing_worker, 2, timeout=20)
    assert "--- rank 1 ---" in str(info.value) and "Traceback" in str(info.value)
