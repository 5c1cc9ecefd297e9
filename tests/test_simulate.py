"""The pure N-rank simulator: broadcast, reduce (avg), two-stage HSDP reduce, poisoning, purity."""
import math

import pytest
import torch

from dmuon.functional.program import program_from_layouts
from dmuon.functional.schedule import (Reduce, Schedule, publish_schedule,
                                       reduce_schedule, unshard_schedule)
from dmuon.functional.simulate import simulate
from sched_cases import random_buffers, random_layout


def _rank(s, r, G):
    return r * G + s


@pytest.mark.parametrize("seed", range(20))
def test_unshard_broadcast_owner_data_everywhere(seed):
    layout, _, _, _ = random_layout(seed)
    G, R = layout.shard_size, layout.replicate_size
    bufs = random_buffers(layout, seed)
    for g in layout.groups:
        out = simulate(unshard_schedule(layout, g), bufs)
        for b in layout.buckets:
            for r in range(R):
                for s in range(G):
                    got = out[_rank(s, r, G)][b.key]
                    if b.key.group == g:   # replica r's copy of column s's bucket
                        want = bufs[_rank(b.key.column, r, G)][b.key]
                    else:                  # other groups untouched
                        want = bufs[_rank(s, r, G)][b.key]
                    assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(20))
def test_reduce_global_average_and_poison(seed):
    layout, owners, _, _ = random_layout(seed)
    G, R = layout.shard_size, layout.replicate_size
    bufs = random_buffers(layout, seed)
    before = [{k: v.clone() for k, v in d.items()} for d in bufs]
    for g in layout.groups:
        sched = reduce_schedule(layout, g)
        out = simulate(sched, bufs)
        for b in layout.buckets_of(g):
            s_o = b.key.column
            allv = torch.stack([bufs[i][b.key] for i in range(G * R)])
            # independent reference: fp64 mean over all G*R ranks, math.fsum per element
            ref = torch.tensor([math.fsum(allv[:, j].tolist()) / (G * R)
                                for j in range(b.numel)], dtype=torch.float64)
            for e in b.entries:
                r_o = e.owner[1]
                got = out[_rank(s_o, r_o, G)][b.key][e.offset:e.offset + e.numel]
                torch.testing.assert_close(got, ref[e.offset:e.offset + e.numel],
                                           rtol=1e-13, atol=1e-14)
                # every other rank's copy of this entry is undefined (NaN) when it has peers
                for i in range(G * R):
                    if i != _rank(s_o, r_o, G) and G * R > 1:
                        v = out[i][b.key][e.offset:e.offset + e.numel]
                        if i % G != s_o and G > 1:
                            assert torch.isnan(v).all()
                        if i % G == s_o and R > 1:
                            assert torch.isnan(v).all()
        # stage 1 only: exact average over G in each replica at column s_o, NaN elsewhere
        s1 = Schedule(sched.by_lane("reduce"), G, R)
        out1 = simulate(s1, bufs)
        for b in layout.buckets_of(g):
            for r in range(R):
                vals = torch.stack([bufs[_rank(s, r, G)][b.key] for s in range(G)])
                ref = torch.tensor([math.fsum(vals[:, j].tolist()) / G for j in range(b.numel)],
                                   dtype=torch.float64)
                torch.testing.assert_close(out1[_rank(b.key.column, r, G)][b.key], ref,
                                           rtol=1e-13, atol=1e-14)
                for s in range(G):
                    if s != b.key.column:
                        assert torch.isnan(out1[_rank(s, r, G)][b.key]).all()
    # purity: inputs untouched
    for a, b_ in zip(bufs, before):
        for k in a:
            assert torch.equal(a[k], b_[k])


def test_reduce_exact_on_integers_and_sum_op():
    layout, _, _, _ = random_layout(7, G=4, R=2, n_layers=2)
    bufs = random_buffers(layout, 1, integer=True)
    G, R = 4, 2
    for g in layout.groups:
        out = simulate(reduce_schedule(layout, g), bufs)
        out_sum = simulate(reduce_schedule(layout, g, op="sum"), bufs)
        for b in layout.buckets_of(g):
            total = sum(bufs[i][b.key] for i in range(G * R))
            for r, off, n in b.ranges:
                i = _rank(b.key.column, r, G)
                assert torch.equal(out[i][b.key][off:off + n], (total / (G * R))[off:off + n])
                assert torch.equal(out_sum[i][b.key][off:off + n], total[off:off + n])


def test_publish_then_unshard_full_cycle():
    layout, owners, _, _ = random_layout(11, G=3, R=2, n_layers=2)
    G, R = 3, 2
    bufs = random_buffers(layout, 5)
    steps = program_from_layouts(layout, layout, layout)
    out = simulate(steps.publish_all(), bufs)
    # after the publish every rank of column s holds each entry's owner-replica value
    for b in layout.buckets:
        for e in b.entries:
            src = bufs[_rank(b.key.column, e.owner[1], G)][b.key][e.offset:e.offset + e.numel]
            for r in range(R):
                got = out[_rank(b.key.column, r, G)][b.key][e.offset:e.offset + e.numel]
                assert torch.equal(got, src)
    # then forward unshard: every rank holds the owners' values
    for g in layout.groups:
        out = simulate(steps.groups[g].unshard, out, donate=True)
    for b in layout.buckets:
        for e in b.entries:
            src = bufs[_rank(b.key.column, e.owner[1], G)][b.key][e.offset:e.offset + e.numel]
            for i in range(G * R):
                assert torch.equal(out[i][b.key][e.offset:e.offset + e.numel], src)


def test_donate_and_errors():
    layout, _, _, _ = random_layout(2, G=2, R=1, n_layers=1)
    g = layout.groups[0]
    bufs = random_buffers(layout, 0)
    key = layout.buckets_of(g)[0].key
    t = bufs[0][key]
    out = simulate(reduce_schedule(layout, g), bufs, donate=True)
    assert out[0][key] is t
    with pytest.raises(ValueError, match="ranks"):
        simulate(unshard_schedule(layout, g), bufs[:1])
    with pytest.raises(KeyError, match="holds no bucket"):
        simulate(unshard_schedule(layout, g), [{}, {}])
    with pytest.raises(ValueError, match="expects"):
        simulate(unshard_schedule(layout, g), [{k: v.float() for k, v in d.items()} for d in bufs])
    nopoison = simulate(reduce_schedule(layout, g), random_buffers(layout, 0), poison=False)
    assert not any(torch.isnan(v).any() for d in nopoison for v in d.values())
