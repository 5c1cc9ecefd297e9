"""The sharded style without processes: each rank keeps ``1/G`` of a hook group's gathered buffer
(its copy), the gathers are all-gathers of those equal parts, and a refresh (an all-to-all) makes
the copies current after the masters changed. The ops' bytes, the simulator (a sharded step equals
the per-owner step bitwise, Z3 re-gathers and HSDP included; a gather without a refresh reads the
kept copies), the per-rank orders, and the style's choice (asked for only; G = 1 stays per owner)."""
from __future__ import annotations

import pytest
import torch
from stateful_harness import build_dmuon
from test_user_paths_review5 import AllMatrices
from threaded_world import run_threads
from user_paths_harness import TOL, RefMuon

from dmuon.functional import muon as fmuon
from dmuon.functional import phases
from dmuon.functional.buckets import BucketKey, bucket_layout, hook_groups
from dmuon.functional.collectives import LinkCost, choose_style
from dmuon.functional.order_check import check_orders, rank_orders
from dmuon.functional.program import step_program
from dmuon.functional.schedule import (ShardCopyGather, ShardCopyRefresh, op_bytes,
                                       refresh_schedule, unshard_schedule)
from dmuon.functional.simulate import simulate
from dmuon.functional.step import world_step
from test_collective_style import F64, _owners, _program, random_trees


def test_the_ops_move_equal_parts_and_the_refresh_moves_what_is_not_in_place():
    G = 4
    owners = {"layers.0.a": (0, 0), "layers.0.b": (2, 0)}
    shapes = {"layers.0.a": (3, 4), "layers.0.b": (2, 3)}  # buckets of 12 and 6: 18 elements
    lay = bucket_layout(owners, shapes, {n: F64 for n in owners}, hook_groups(list(owners)), G)
    (ag,) = unshard_schedule(lay, "layers.0", style="sharded")
    (rf,) = refresh_schedule(lay, "layers.0")
    assert isinstance(ag, ShardCopyGather) and isinstance(rf, ShardCopyRefresh)
    assert ag.numel == 5 and ag.sizes == (12, 0, 6, 0) and ag.starts == (0, 12, 12, 18)
    assert ag.copy_key == BucketKey("layers.0", -2, F64) and ag.bucket.column == -1
    for pos in range(G):  # an all-gather of equal parts of 5 elements
        assert op_bytes(ag, pos, G) == (3 * 5 * 8, 3 * 5 * 8)
    # column 0's bucket covers parts 0, 1 and 2 of [0, 5), [5, 10), [10, 15); column 2's [12, 18)
    assert [rf.moved(0, j) for j in range(G)] == [(0, 5), (5, 5), (10, 2), (15, 0)]
    assert [rf.moved(2, j) for j in range(G)] == [(12, 0), (12, 0), (12, 3), (15, 3)]
    assert op_bytes(rf, 0, G) == ((5 + 2) * 8, 0)       # keeps its own part 0
    assert op_bytes(rf, 1, G) == (0, 5 * 8)
    assert op_bytes(rf, 2, G) == (3 * 8, 2 * 8)         # keeps [12, 15), receives [10, 12)
    assert op_bytes(rf, 3, G) == (0, 3 * 8)
    tr = refresh_schedule(lay, "layers.0").traffic()
    assert tr.total_sent(["unshard"]) == tr.total_received(["unshard"]) == (18 - 5 - 3) * 8
    with pytest.raises(ValueError, match="ceil"):
        ShardCopyGather(id="x", axis="shard", at=None, bucket=ag.bucket, offset=0, numel=12,
                        dtype=F64, lane="unshard", keys=ag.keys, sizes=ag.sizes)


@pytest.mark.parametrize("G,R,z3", [(2, 1, True), (3, 1, False), (4, 1, True), (2, 2, True),
                                    (3, 2, False)])
def test_a_sharded_step_equals_the_per_owner_step_bitwise_in_the_simulator(G, R, z3):
    po, sh = _program(G, R, "per_owner", z3), _program(G, R, "sharded", z3)
    assert {g.collectives for g in sh.groups.values()} == {"sharded"}
    assert sh.traffic().total_sent(["reduce"]) == po.traffic().total_sent(["reduce"])
    W = G * R
    shapes, params, weights = random_trees(po, 1, W)
    seen: dict = {}

    def grads(style):
        def fn(i, full):  # a gradient of the gathered matrices: wrong gathers change it
            seen.setdefault(style, []).append({n: v.clone() for n, v in full.items()})
            return {n: full[n] * weights[i][n] + full[n] ** 2 for n in full}
        return fn

    col = lambda i: {n: params[n].clone() for n in shapes if po.owners[n][0] == i % G}  # noqa
    hp = fmuon.MuonHParams(lr=0.02, ns_dtype=torch.float64)
    a, _, ran_a = world_step([col(i) for i in range(W)], grads("po"), po, None, hp)
    b, _, ran_b = world_step([col(i) for i in range(W)], grads("sh"), sh, None, hp)
    for i in range(W):
        assert a[i].keys() == b[i].keys()
        assert all(torch.equal(a[i][n], b[i][n]) for n in a[i]), i
        assert all(torch.equal(seen["po"][i][n], params[n]) for n in params)
        assert all(torch.equal(seen["sh"][i][n], params[n]) for n in params)
    assert any(isinstance(op, ShardCopyRefresh) for op in ran_b)
    assert check_orders(rank_orders(sh.step_schedule()), G, R) > 0


@pytest.mark.parametrize("G,R", [(3, 1), (2, 2)])
def test_the_copies_kept_between_gathers_serve_a_gather_without_refresh(G, R):
    """As the runtime runs it: the first gather after the masters changed refreshes the copies;
    the flat buffers are then dropped (Z3's reshard) and the next gather reads the copies alone
    (no master written): every rank gets every matrix again, bitwise."""
    sh = _program(G, R, "sharded")
    W = G * R
    gen = torch.Generator().manual_seed(2)
    shapes = {e.name: e.shape for b in sh.unshard_layout.buckets for e in b.entries}
    params = {n: torch.randn(*s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    for key in sh.forward_order:
        bufs = [phases.gather_buffers(sh, key) for _ in range(W)]
        sched = [phases.gather(sh, key, (i % G, i // G),
                               {n: v for n, v in params.items() if sh.owners[n][0] == i % G},
                               bufs[i]) for i in range(W)][0]
        assert isinstance(sched.ops[0], ShardCopyRefresh)
        simulate(sched, bufs, donate=True)
        for i in range(W):
            for t in bufs[i].values():
                if t._base is None and t.numel() > 0 and t is not bufs[i][sched.ops[0].copy_key]:
                    t.fill_(float("nan"))  # the flat buffer freed: its contents gone
        again = phases.gather(sh, key, (0, 0), {}, bufs[0], regather=True, refresh=False)
        assert not any(isinstance(op, ShardCopyRefresh) for op in again)
        assert all(op.id.startswith("regather:") for op in again)
        simulate(again, bufs, donate=True)
        for i in range(W):
            full = phases.gathered(sh, key, bufs[i])
            assert full.keys() == set(sh.groups[key].names)
            assert all(torch.equal(full[n], params[n]) for n in full), (key, i)


def test_the_style_is_asked_for_and_one_shard_index_stays_per_owner():
    owners, shapes = _owners(2, 1)
    lay = bucket_layout(owners, shapes, {n: F64 for n in owners}, hook_groups(list(owners)), 2)
    assert choose_style(lay, lay, "layers.0", "sharded").style == "sharded"
    for cost in (LinkCost(), LinkCost(alpha_s=1.0)):  # auto weighs the other three only
        assert choose_style(lay, lay, "layers.0", "auto", cost=cost).style != "sharded"
    one = {n: (0, 0) for n in owners}
    lay1 = bucket_layout(one, shapes, {n: F64 for n in owners}, hook_groups(list(owners)), 1)
    c = choose_style(lay1, lay1, "layers.0", "sharded")
    assert c.style == "per_owner" and "G = 1" in c.reason


# ---------------------------------------------------------------- the runtime, on thread-ranks
def _train(rank, world, template, style, z3, hsdp=False):
    """Four steps from a copy of ``template`` (every matrix dedicated): after step 1 the weights
    are loaded anew (``dmuon.set_model_state_dict``, halved: the masters change outside a step),
    after step 2 a no-grad forward gathers them once more; ``world`` 0: ``RefMuon`` in one
    process on every rank's part of the batch."""
    import copy

    import dmuon
    model = copy.deepcopy(template)
    if world:
        model, opt = build_dmuon(rank, world, model, model.layers,
                                 {"z3": z3, "hsdp": hsdp, "predicate": lambda n, p: p.ndim == 2},
                                 options=dmuon.DedicateOptions(collectives=style))
    else:
        opt = RefMuon(model, lambda n, p: p.ndim == 2)
    parts = world or 4
    g, losses = torch.Generator().manual_seed(1), []
    for step in range(4):
        x = torch.randn(8, 8, generator=g, dtype=torch.float64)
        for r in ([rank] if world else range(parts)):
            loss = model(x.chunk(parts)[r]) / (1 if world else parts)
            loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
        if step == 1:
            sd = dmuon.get_model_state_dict(model) if world else model.state_dict()
            half = {k: v * 0.5 for k, v in sd.items()}
            (dmuon.set_model_state_dict(model, half) if world else model.load_state_dict(half))
        if step == 2:
            with torch.no_grad():
                losses.append(float(model(x)))
    out = dmuon.get_model_state_dict(model) if world else model.state_dict()
    styles = ({g.key: g.collectives for g in get_state(model).program.groups.values()}
              if world else {})
    return out, losses, styles


def get_state(model):
    from dmuon.stateful.runtime.state import get_state as gs
    return gs(model)


@pytest.mark.parametrize("world,z3,hsdp", [(2, True, False), (2, False, False), (4, True, False),
                                           (4, True, True)], ids=["z3", "z2", "g4", "hsdp2x2"])
def test_training_with_the_sharded_copy_equals_per_owner_bitwise_and_one_process(world, z3, hsdp):
    torch.manual_seed(0)
    template = AllMatrices().double()
    ref, _, _ = _train(0, 0, template, None, z3)
    po = run_threads(_train, world, template, "per_owner", z3, hsdp)
    sh = run_threads(_train, world, template, "sharded", z3, hsdp)
    for (a, la, _), (b, lb, styles) in zip(po, sh):
        assert set(styles.values()) == {"sharded"}
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert la == lb  # every forward (the no-grad one after the load too) saw the same weights
        assert max(float((b[k] - v).abs().max()) for k, v in ref.items()) <= TOL


# ---------------------------------------------------------------- spawned gloo ranks
CFG_2 = [dict(id="sharded_z3", steps=2, dedicate_kw={"collectives": "sharded"}),
         dict(id="sharded_z2_clip", steps=2, z3=False, clip=0.5,
              dedicate_kw={"collectives": "sharded"})]
CFG_4 = [dict(id="hsdp_sharded_z3", steps=2, hsdp=True, batch=8,
              dedicate_kw={"collectives": "sharded"}),
         dict(id="w4_sharded_bf16_offload", steps=2, batch=8, momentum_dtype=torch.bfloat16,
              dedicate_kw={"collectives": "sharded"},
              muon_kw=dict(momentum_dtype=torch.bfloat16, offload_state=True))]


def _spawned(world, cfgs):
    from dist_utils import run_ranks
    from test_bucket_collectives_gloo import _check, _styles, _worker
    results = run_ranks(_worker, world, cfgs, timeout=300)
    _check(results, cfgs)  # equal to one process; the executor's counters = the program's bytes
    for out in results:
        assert all(_styles(out[c["id"]]) == {"sharded"} for c in cfgs)


def test_two_gloo_ranks_equal_one_process_and_count_the_programs_bytes():
    _spawned(2, CFG_2)


@pytest.mark.slow
def test_four_gloo_ranks_hsdp_and_state_options_equal_one_process():
    _spawned(4, CFG_4)


def test_the_memory_model_counts_the_copies():
    """Every rank keeps ``numel`` elements (its part) of each sharded group and dtype between
    steps, on top of what the per-owner style holds."""
    from dmuon.functional.memory_model import rank_memory
    po, sh = _program(3, 1, "per_owner"), _program(3, 1, "sharded")
    parts = sum(op.nbytes for g in sh.groups.values() for op in g.unshard)
    for s in range(3):
        a, b = rank_memory(po, (s, 0)), rank_memory(sh, (s, 0))
        assert b.phases["between_steps"] - a.phases["between_steps"] == parts > 0
