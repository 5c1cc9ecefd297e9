"""The step program and the pure distributed step (no processes): ``world_step`` in the simulator
equals one process's Muon at every mesh, ``owner_step`` equals ``muon.update`` (also with the
policy's lr / wd multipliers) and runs any Transform chain, and the program's traffic is the one
count every figure comes from."""
from __future__ import annotations

import random

import pytest
import torch

from dmuon.functional import muon as fmuon
from dmuon.functional import transforms as T
from dmuon.functional.buckets import hook_groups
from dmuon.functional.matrix_view import Batch
from dmuon.functional.packing import pack, presence, unpack
from dmuon.functional.program import ROOT_GROUP, step_program, step_traffic
from dmuon.functional.owner_step import owner_step
from dmuon.functional.step import world_step

HP = fmuon.MuonHParams(lr=0.05, momentum=0.9, weight_decay=0.1, ns_steps=5,
                       ns_dtype=torch.float64)


def _model(seed: int, G: int, R: int, *, root: bool = False):
    rng = random.Random(seed)
    owners, shapes = {}, {}
    for layer in range(3):
        for proj in rng.sample(["q", "k", "v", "o", "up", "down"], rng.randint(2, 4)):
            name = f"model.layers.{layer}.{proj}_proj.weight"
            owners[name] = (rng.randrange(G), rng.randrange(R))
            shapes[name] = (rng.randint(2, 7), rng.randint(2, 9))
    if root:
        owners["lm_head.weight"] = (rng.randrange(G), rng.randrange(R))
        shapes["lm_head.weight"] = (5, 4)
    return owners, shapes


def _program(owners, shapes, G, R, *, z3=True, groups=None):
    f64 = {n: "torch.float64" for n in owners}
    return step_program(owners, shapes, f64, shard_size=G, replicate_size=R,
                        groups=groups or hook_groups(list(owners)), reshard_after_forward=z3)


@pytest.mark.parametrize("G,R", [(1, 1), (2, 1), (4, 1), (2, 2), (1, 4), (3, 2)])
def test_world_step_equals_one_process(G, R):
    owners, shapes = _model(G * 10 + R, G, R)
    prog = _program(owners, shapes, G, R)
    W = G * R
    g = torch.Generator().manual_seed(W)
    full = {n: torch.randn(*s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    names = sorted(owners)
    unused, partial = names[0], names[1]  # no rank has a gradient / only rank 0 has one
    grads = []
    for i in range(W):
        gi = {n: torch.randn(*shapes[n], generator=g, dtype=torch.float64) for n in names
              if n != unused and (n != partial or i == 0)}
        grads.append(gi)
    params = [{n: full[n].clone() for n in names if owners[n][0] == i % G} for i in range(W)]
    states = None
    ref_state = fmuon.init(full)
    ref = full
    for step in range(2):  # a second step: the states carry over
        new, states, sched = world_step(params, grads, prog, states, HP)
        avg = {n: (sum(grads[i][n] for i in range(W) if n in grads[i]) / W
                   if any(n in grads[i] for i in range(W)) else None) for n in names}
        ref, ref_state = fmuon.update(avg, ref_state, ref, HP)
        for i in range(W):
            assert set(new[i]) == {n for n in names if owners[n][0] == i % G}
            for n, v in new[i].items():
                torch.testing.assert_close(v, ref[n], rtol=0, atol=1e-12)
        assert torch.equal(ref[unused], full[unused])  # no rank had a gradient: not stepped
        params = new
    # the schedule the step implies: the reduces in the fixed order, then the publish
    tr, whole = sched.traffic(), prog.traffic()
    for lane in ("reduce", "replicate"):
        assert tr.sent[lane] == whole.sent[lane] and tr.received[lane] == whole.received[lane]
    assert sum(tr.sent["unshard"]) == 0


def test_world_step_states_per_owner():
    owners, shapes = _model(5, 2, 2)
    prog = _program(owners, shapes, 2, 2)
    names = sorted(owners)
    full = {n: torch.randn(*shapes[n], dtype=torch.float64) for n in names}
    params = [{n: full[n].clone() for n in names if owners[n][0] == i % 2} for i in range(4)]
    grads = [{n: torch.randn(*shapes[n], dtype=torch.float64) for n in names}] * 4
    _, states, _ = world_step(params, grads, prog, None, HP)
    for i, st in enumerate(states):  # each rank's state holds exactly what it owns
        assert set(st.momentum) == {n for n in names if owners[n] == (i % 2, i // 2)}


def test_owner_step_is_muon_update_and_groups_multipliers():
    g = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(4 + i, 6, generator=g, dtype=torch.float64) for i in range(4)}
    grads = {n: torch.randn_like(p) for n, p in params.items()}
    grads["w3"] = None
    st = fmuon.init(params)
    new, st2 = owner_step(grads, st, params, HP)
    ref, rst = fmuon.update(grads, st, params, HP)
    for n in params:
        assert torch.equal(new[n], ref[n]) and torch.equal(st2.momentum[n], rst.momentum[n])
    mults = {"w0": (0.5, 2.0), "w2": (0.5, 2.0)}
    new, st3 = owner_step(grads, st, params, HP, mults=mults)
    assert st3.step == 1
    for n in params:
        lm, wm = mults.get(n, (1.0, 1.0))
        one, _ = fmuon.update({n: grads[n]}, fmuon.init({n: params[n]}), {n: params[n]},
                              HP._replace(lr=HP.lr * lm, weight_decay=HP.weight_decay * wm))
        torch.testing.assert_close(new[n], one[n], rtol=0, atol=1e-14)
    views = {"w1": Batch(0)}
    new, _ = owner_step(grads, st, params, HP, views=views)
    assert torch.equal(new["w1"], ref["w1"])


def test_owner_step_runs_a_transform_chain():
    params = {"a": torch.randn(5, 3, dtype=torch.float64), "b": torch.randn(3, 3, dtype=torch.float64)}
    grads = {"a": torch.randn(5, 3, dtype=torch.float64), "b": None}
    chain = T.chain(T.trace_momentum(0.9), T.orthogonalize(), T.scale_by_learning_rate(0.1))
    new, st = owner_step(grads, None, params, chain)
    u, st_ref = chain.update(grads, chain.init(params), params)
    ref = T.apply_updates(params, u)
    assert torch.equal(new["a"], ref["a"]) and torch.equal(new["b"], params["b"])
    with pytest.raises(ValueError, match="multipliers"):
        owner_step(grads, None, params, chain, mults={"a": (2.0, 1.0)})
    with pytest.raises(TypeError, match="MuonHParams or a Transform"):
        owner_step(grads, None, params, {"lr": 0.1})


def test_pack_unpack_presence_roundtrip():
    owners, shapes = _model(3, 2, 1)
    prog = _program(owners, shapes, 2, 1)
    vals = {n: torch.randn(*s, dtype=torch.float64) for n, s in shapes.items()}
    missing = sorted(vals)[0]
    vals[missing] = None
    bufs = pack(prog.reduce_layout.buckets, vals)
    got = unpack(prog.reduce_layout.buckets, bufs)
    flags = presence(prog.reduce_layout.buckets, bufs)
    for n, v in vals.items():
        assert float(flags[n]) == (0.0 if v is None else 1.0)
        assert torch.equal(got[n], torch.zeros(shapes[n], dtype=torch.float64) if v is None else v)


@pytest.mark.parametrize("G,R", [(2, 1), (4, 2), (1, 3)])
def test_program_traffic_is_the_one_count(G, R):
    owners, shapes = _model(7, G, R, root=True)
    groups = hook_groups(list(owners), lambda n: ROOT_GROUP if n.startswith("lm_head") else None)
    z2, z3 = (_program(owners, shapes, G, R, z3=z, groups=groups) for z in (False, True))
    P = {k: sum(b.nbytes for b in z2.unshard_layout.buckets_of(k)) for k in z2.groups}
    # Z3 re-gathers every group but the root group (gathered for the whole forward, as the runtime)
    extra = z3.traffic().total_sent(["unshard"]) - z2.traffic().total_sent(["unshard"])
    assert extra == sum((G - 1) * P[k] * R for k in z2.groups if k != ROOT_GROUP)
    assert not z3.groups[ROOT_GROUP].reshard_after_forward
    # the per-rank counters view equals the traffic's rank columns
    for i in range(G * R):
        c = z3.rank_counters((i % G, i // G))
        for lane in ("unshard", "reduce", "replicate"):
            assert c[lane]["sent_bytes"] == z3.traffic().sent[lane][i]
    # one layout three times: step_traffic is a view of the program
    lay = z2.unshard_layout
    assert step_traffic(lay, True).total_sent(["unshard"]) == \
        sum(2 * (G - 1) * P[k] * R if k != ROOT_GROUP else (G - 1) * P[k] * R for k in z2.groups)


def test_checkpoint_moves_are_program_phases():
    owners, shapes = _model(11, 2, 2)
    prog = _program(owners, shapes, 2, 2)
    k = prog.forward_order[0]
    every = prog.to_every_rank(k, owner_only=True)
    assert {op.lane for op in every} == {"replicate", "unshard"}
    cols = prog.to_columns(k)
    assert all(op.op == "sum" and op.axis == "shard" for op in cols)


def test_a_load_from_one_rank_is_a_program_phase():
    """A rank-0-only load: the shard-axis sums, then per bucket a replicate-axis copy from the
    holder's replica waiting on its sum (none when R == 1); under TP a sum over the holder's TP
    group first (:func:`checkpoint_over_tp`)."""
    from dmuon.functional.program import checkpoint_over_tp
    from dmuon.functional.schedule import AllReduce, Broadcast

    owners, shapes = _model(11, 2, 2)
    prog = _program(owners, shapes, 2, 2)
    k = prog.forward_order[0]
    sums = prog.to_columns(k).ops
    one = prog.to_columns(k, from_replica=1).ops
    assert one[:len(sums)] == sums
    copies = one[len(sums):]
    assert len(copies) == len(sums) and all(
        isinstance(c, Broadcast) and c.axis == "replicate" and c.src == 1 and c.at == s.dst
        and c.bucket == s.bucket and c.numel == s.numel and c.waits == (s.id,)
        for c, s in zip(copies, sums))
    with pytest.raises(ValueError, match="replica index"):
        prog.to_columns(k, from_replica=2)
    o1, s1 = _model(11, 2, 1)
    flat = _program(o1, s1, 2, 1)
    assert flat.to_columns(k, from_replica=0).ops == flat.to_columns(k).ops
    tp = checkpoint_over_tp(k, {"torch.float64": 10, "torch.float32": 4}, (4, 5), world_size=8)
    assert [(type(op), op.lane, op.members, op.numel, op.op) for op in tp] == [
        (AllReduce, "tp", (4, 5), 4, "sum"), (AllReduce, "tp", (4, 5), 10, "sum")]


def test_wrong_inputs_raise_clear_errors():
    """A user's slips raise errors that say what to change: a variant passed as ``update`` (it goes
    in ``transform=``), a compute dtype missing for a planned matrix (was a bare ``KeyError``), and
    ``rank_memory`` of a rank outside the program's mesh (gave plausible wrong numbers)."""
    from dmuon.functional import variants
    from dmuon.functional.memory_model import rank_memory

    owners, shapes = _model(0, 2, 1)
    params = {n: torch.randn(shapes[n], dtype=torch.float64) for n in owners}
    with pytest.raises(TypeError, match="goes in transform="):
        owner_step(dict(params), None, params, variants.normuon())
    first = next(iter(owners))
    dtypes = {n: "torch.float64" for n in owners if n != first}
    with pytest.raises(ValueError, match=f"{first}.*needs a shape and a dtype"):
        step_program(owners, shapes, dtypes, shard_size=2)
    program = _program(owners, shapes, 2, 1)
    rank_memory(program, (1, 0))
    for coord in [(2, 0), (0, 1), (-1, 0)]:
        with pytest.raises(ValueError, match="outside the mesh"):
            rank_memory(program, coord)
    for kw in [dict(state_itemsize=0), dict(chunk_bytes=-5)]:
        with pytest.raises(ValueError, match="state_itemsize must be >= 1"):
            rank_memory(program, (0, 0), **kw)
