"""The step's phases (:mod:`dmuon.functional.phases`) and the replicated path of vector params
(:mod:`dmuon.functional.replicated`) in the simulator, no processes: each phase's buffers and
schedule give every rank what the step needs (bit for bit against a hand computation where the
order of the sum is fixed), the owner's accounting sums several backwards with FSDP2's scale and
resolves presence, the Z3 re-gather is the program's own renamed schedule, and the pure step given
a gradient function gathers first and otherwise equals the step given the gradients. The runtime
calls the same functions: its equality is the gloo tests' (test_step_program_gloo.py,
test_stateful_equality.py, test_hsdp.py, test_fsdp_divide_factor.py, ...)."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from dmuon.functional import adamw as fadamw
from dmuon.functional import muon as fmuon
from dmuon.functional import phases as P
from dmuon.functional import transforms as T
from dmuon.functional.buckets import to_torch_dtype
from dmuon.functional.packing import zero_buffers
from dmuon.functional.program import step_program
from dmuon.functional.replicated import mean, means, replicated_program, replicated_step
from dmuon.functional.schedule import Schedule
from dmuon.functional.simulate import simulate
from dmuon.functional.step import world_step

F64 = torch.float64
HP = fmuon.MuonHParams(lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype=F64)


def _program(G, R, *, seed=0, z3=True, style="per_owner", compute=F64, master=F64):
    rng = random.Random(seed)
    owners, shapes = {}, {}
    for layer in range(3):
        for proj in rng.sample(["q", "k", "v", "o", "up"], rng.randint(2, 4)):
            n = f"layers.{layer}.{proj}.weight"
            owners[n], shapes[n] = (rng.randrange(G), rng.randrange(R)), (rng.randint(2, 6),
                                                                          rng.randint(2, 7))
    prog = step_program(owners, shapes, {n: str(compute) for n in owners}, shard_size=G,
                        replicate_size=R, master_dtypes={n: str(master) for n in owners},
                        reshard_after_forward=z3, collectives=style)
    return prog, shapes


def _coords(prog):
    G = prog.shard_size
    return [(i % G, i // G) for i in range(prog.world_size)]


@pytest.mark.parametrize("G,R,style", [(3, 1, "per_owner"), (2, 2, "per_owner"),
                                       (3, 2, "per_bucket")])
def test_gather_gives_every_rank_every_full_matrix(G, R, style):
    prog, shapes = _program(G, R, style=style, compute=torch.bfloat16, master=torch.float32)
    g = torch.Generator().manual_seed(1)
    full = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    for key in prog.forward_order:
        for regather in (False, True):
            bufs = [zero_buffers(prog.unshard_layout.buckets_of(key)) for _ in _coords(prog)]
            scheds = [P.gather(prog, key, c, {n: full[n] for n in prog.column(c[0])}, bufs[i],
                               regather=regather) for i, c in enumerate(_coords(prog))]
            assert all(s == scheds[0] for s in scheds)  # the same schedule on every rank
            bufs = simulate(scheds[0], bufs, donate=True)
            for i in range(prog.world_size):
                got = P.gathered(prog, key, bufs[i])
                assert set(got) == set(prog.groups[key].names)
                for n, v in got.items():  # cast to the compute dtype, moved bit for bit
                    assert v.dtype == torch.bfloat16 and torch.equal(v, full[n].bfloat16())
    # the re-gather is the step schedule's: the same ops, renamed
    z3_keys = [k for k in prog.reduce_order if prog.groups[k].reshard_after_forward]
    re = [op for op in prog.step_schedule() if op.id.startswith("regather:")]
    assert re == [op for k in z3_keys for op in prog.groups[k].regather]
    assert all(op.id == "regather:" + u.id for k in z3_keys
               for op, u in zip(prog.groups[k].regather, prog.groups[k].unshard))


@pytest.mark.parametrize("G,R", [(3, 1), (2, 2)])
def test_reduce_accumulate_resolve(G, R):
    prog, shapes = _program(G, R, seed=2)
    W, coords = prog.world_size, _coords(prog)
    names = sorted(shapes)
    unused, remote = names[0], names[1]  # no rank has a gradient / only a non-owner has one
    other = next(i for i, c in enumerate(coords) if c != tuple(prog.owners[remote]))
    gen = torch.Generator().manual_seed(3)
    backwards = []  # two synced backwards before a step
    for _ in range(2):
        backwards.append([{n: torch.randn(*shapes[n], generator=gen, dtype=F64) for n in names
                           if n != unused and (n != remote or i == other)} for i in range(W)])
    scale = 0.5  # FSDP2's divide factor, as the runtime reads it
    held: list[dict] = [{} for _ in range(W)]
    for grads in backwards:
        bufs = [zero_buffers(prog.reduce_layout.buckets) for _ in range(W)]
        here = [{} for _ in range(W)]
        for key in prog.reduce_order:
            for i, c in enumerate(coords):
                sched, here[i][key] = P.reduce(prog, key, c, grads[i], bufs[i])
            bufs = simulate(sched, bufs, donate=True)
        for i, c in enumerate(coords):
            for key in prog.reduce_order:
                got = P.reduced(prog, key, c, bufs[i], here[i][key])
                assert {rg.name for rg in got} == {n for n in prog.groups[key].names
                                                   if tuple(prog.owners[n]) == c}
                for rg in got:
                    assert rg.present_here == (rg.name in grads[i])
                    a = P.accumulate(held[i].get(rg.name), rg, scale)
                    b = P.accumulate(held[i].get(rg.name), rg._replace(grad=rg.grad.clone()),
                                     scale, donate=True)
                    assert torch.equal(a.grad, b.grad) and a.present == b.present
                    held[i][rg.name] = a
    for i, c in enumerate(coords):
        owned = prog.owned(c)
        out = P.resolve(held[i], owned)
        assert list(out) == list(owned)
        for n in owned:
            if n == unused:
                assert out[n] is None
                continue
            ref = sum(scale * (sum(g[n] for g in grads if n in g) / W) for grads in backwards)
            torch.testing.assert_close(out[n], ref, rtol=0, atol=1e-15)
            if R == 1 and n != remote:  # one stage: the sum in rank order, then / G
                parts = [scale * (sum(grads[j][n] for j in range(W)) / W) for grads in backwards]
                assert torch.equal(out[n], parts[0] + parts[1])
        if remote in owned:  # known only from the presence elements
            assert not held[i][remote].present and len(held[i][remote].flags) == 2


def test_resolve_reads_no_flag_where_the_owner_had_a_gradient():
    g = torch.ones(2)
    # a present entry's flags are never read (an empty stack would raise)
    out = P.resolve({"a": P.OwnerGrad(g, True, ()), "b": None}, ["a", "b", "c"])
    assert out["a"] is g and out["b"] is None and out["c"] is None
    absent = P.OwnerGrad(g, False, (torch.tensor(0.0), torch.tensor(0.0)))
    present = P.OwnerGrad(g, False, (torch.tensor(0.0), torch.tensor(0.25)))
    assert P.resolve({"a": absent, "b": present}, ["a", "b"]) == {"a": None, "b": g}


@pytest.mark.parametrize("G,R", [(2, 2), (1, 3)])
def test_publish_gives_the_column_the_owners_masters(G, R):
    prog, shapes = _program(G, R, seed=4)
    W, coords = prog.world_size, _coords(prog)
    gen = torch.Generator().manual_seed(5)
    new = {n: torch.randn(*s, generator=gen, dtype=F64) for n, s in shapes.items()}
    bufs = [zero_buffers(prog.master_layout.buckets) for _ in range(W)]
    for i, c in enumerate(coords):  # each rank writes the masters it owns, garbage elsewhere
        mine = {n: (new[n] if tuple(prog.owners[n]) == c else torch.full(shapes[n], 7.0,
                                                                          dtype=F64))
                for n in prog.column(c[0])}
        sched = P.publish(prog, c, bufs[i], mine)
    assert sched == prog.publish_all()
    bufs = simulate(sched, bufs, donate=True)
    for i, c in enumerate(coords):
        got = P.published(prog, c, bufs[i])
        assert set(got) == set(prog.column(c[0]))
        assert all(torch.equal(v, new[n]) for n, v in got.items())


@pytest.mark.parametrize("G,R,z3", [(2, 2, False), (3, 1, True)])
def test_world_step_with_a_gradient_function_gathers_first(G, R, z3):
    prog, shapes = _program(G, R, seed=6, z3=z3)
    W, coords = prog.world_size, _coords(prog)
    gen = torch.Generator().manual_seed(7)
    full = {n: torch.randn(*s, generator=gen, dtype=F64) for n, s in shapes.items()}
    weights = [torch.randn(1, generator=gen, dtype=F64) for _ in range(W)]
    seen = []

    def grads_fn(i, f):  # a rank's gradient, a function of the full matrices it was given
        seen.append((i, {n: v.clone() for n, v in f.items()}))
        return {n: weights[i] * v * v for n, v in f.items()}

    cols = lambda: [{n: full[n].clone() for n in prog.column(c[0])} for c in coords]  # noqa: E731
    a, sa, sched_a = world_step(cols(), grads_fn, prog, None, HP)
    grads = [{n: weights[i] * full[n] * full[n] for n in full} for i in range(W)]
    b, sb, sched_b = world_step(cols(), grads, prog, None, HP)
    assert [i for i, _ in seen] == list(range(W))
    assert all(set(f) == set(full) and all(torch.equal(f[n], full[n]) for n in f) for _, f in seen)
    for i in range(W):
        assert all(torch.equal(a[i][n], b[i][n]) for n in b[i])
    fwd = [op.id for k in prog.forward_order for op in prog.groups[k].unshard]
    assert [op.id for op in sched_a] == fwd + [op.id for op in sched_b]
    if not z3:  # Z2: the whole step of the program, forward gather included
        assert [op.id for op in sched_a] == [op.id for op in prog.step_schedule()]


@pytest.mark.parametrize("G,R", [(2, 1), (2, 2), (1, 3)])
def test_replicated_mean_and_step(G, R):
    W = G * R
    vecs = {"b": torch.zeros(5, dtype=F64), "norm": torch.ones(3, dtype=torch.float32),
            "unused": torch.zeros(2, dtype=F64)}
    rp = replicated_program(vecs, shard_size=G, replicate_size=R)
    assert {to_torch_dtype(b.key.dtype) for b in rp.layout.buckets} == {F64, torch.float32}
    gen = torch.Generator().manual_seed(8)
    grads = [{"b": torch.randn(5, generator=gen, dtype=F64),
              "norm": torch.randn(3, generator=gen) if i == W - 1 else None} for i in range(W)]
    bufs = [zero_buffers(rp.layout.buckets) for _ in range(W)]
    here = [mean(rp, grads[i], bufs[i])[1] for i in range(W)]
    bufs = simulate(rp.mean, bufs, donate=True)
    ref_b = sum(g["b"] for g in grads) / W
    for i in range(W):
        m = means(rp, bufs[i], here[i])
        assert m["unused"] is None  # no rank had one: skipped, as one process skips None
        if R == 1:  # the matrices' reduce: the sum in rank order, then / G
            assert torch.equal(m["b"], ref_b)
        torch.testing.assert_close(m["b"], ref_b, rtol=0, atol=1e-15)
        torch.testing.assert_close(m["norm"], grads[-1]["norm"] / W, rtol=0, atol=1e-7)


def _threaded_world(W: int, fn) -> list:
    """``fn(i, runner)`` on W threads, the runner a simulator of the W ranks: each call waits
    for every rank's buffers, one of them runs the schedule, all return after it."""
    arrived: list = [None] * W
    box: dict = {}
    barrier = threading.Barrier(W, action=lambda: simulate(box["sched"], arrived, donate=True))
    out: list = [None] * W

    def one(i: int) -> None:
        def runner(sched, bufs):
            arrived[i], box["sched"] = bufs, sched
            barrier.wait(timeout=30)
            barrier.wait(timeout=30)  # nobody refills ``arrived`` before everyone read it
        out[i] = fn(i, runner)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("chain", [False, True])
def test_replicated_step_runs_the_same_update_on_every_rank(chain):
    G, R = 2, 2
    W = G * R
    vecs = {"b": torch.zeros(5, dtype=F64) + 0.5, "unused": torch.ones(2, dtype=F64)}
    rp = replicated_program(vecs, shard_size=G, replicate_size=R)
    gen = torch.Generator().manual_seed(9)
    grads = [{"b": torch.randn(5, generator=gen, dtype=F64), "other": torch.ones(1)}
             for _ in range(W)]
    hp = fadamw.AdamWHParams(lr=0.1)
    upd = T.chain(T.scale_by_adam(), T.scale_by_learning_rate(0.1)) if chain else hp
    got = _threaded_world(W, lambda i, run: replicated_step(vecs, grads[i], None, rp, upd, run))
    bufs = [zero_buffers(rp.layout.buckets) for _ in range(W)]
    here = [mean(rp, grads[i], bufs[i])[1] for i in range(W)]
    m = means(rp, simulate(rp.mean, bufs)[0], here[0])
    if chain:
        ref, _ = T.update_params(upd, m, upd.init(vecs), vecs)
    else:
        ref, _ = fadamw.update(m, fadamw.init(vecs), vecs, hp)
    for i in range(W):
        p, _, sched = got[i]
        assert sched == rp.mean
        assert torch.equal(p["b"], ref["b"]) and not torch.equal(p["b"], vecs["b"])
        assert torch.equal(p["unused"], vecs["unused"])  # no gradient anywhere: unchanged
    with pytest.raises(TypeError, match="AdamWHParams or a"):
        replicated_step(vecs, grads[0], None, rp, fmuon.MuonHParams(), lambda s, b: None)
