"""The pure arithmetic of dmuon.clip_grad_norm_ (dmuon.functional.grad_norm), on one process: the
total norm of replicated pieces counted once equals torch's norm of the gradients, and the scale is
torch's clip coefficient."""
from __future__ import annotations

import math

import pytest
import torch

from dmuon.functional.grad_norm import (check_norm_type, local_norm_term, norm_buckets,
                                         scale_buckets_, total_norm)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_total_norm_counts_each_piece_once(p):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(7, generator=g)
    # b is held by 2 ranks (a replica): this rank's piece plus the same piece counted 1/2 twice
    buckets = norm_buckets([(a, 1), (b, 2), (b, 2), (torch.zeros(0), 1)])
    assert {key: len(ts) for key, ts in buckets.items()} == {
        (1, torch.device("cpu"), torch.float64): 1, (2, torch.device("cpu"), torch.float32): 2}
    got = total_norm(local_norm_term(buckets, p, torch.device("cpu")), p)
    want = torch.linalg.vector_norm(torch.cat([a.flatten(), b.double()]), p)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_scale_matches_torch_clip_coefficient():
    a = torch.full((4,), 3.0, dtype=torch.float64)
    buckets = norm_buckets([(a, 1)])
    total = total_norm(local_norm_term(buckets, 2.0, torch.device("cpu")), 2.0)
    scale_buckets_(buckets, 1.0, total)
    torch.testing.assert_close(a, torch.full((4,), 3.0 / (6.0 + 1e-6), dtype=torch.float64))
    scale_buckets_(buckets, 100.0, total)  # below max_norm: unchanged (coefficient clamped at 1)
    torch.testing.assert_close(a, torch.full((4,), 3.0 / (6.0 + 1e-6), dtype=torch.float64))


def test_norm_type_must_be_a_p_norm():
    assert check_norm_type(2) == 2.0 and check_norm_type(math.inf) == math.inf
    for bad in (0, -math.inf, float("nan"), -1.0):
        with pytest.raises(ValueError, match="norm_type must be > 0"):
            check_norm_type(bad)


def test_replication_counts_the_ranks_holding_one_piece():
    from types import SimpleNamespace

    from dmuon.functional.grad_norm import replication

    class _Mesh:
        def __init__(self, *sizes):
            self.sizes = sizes

        def size(self, i=None):
            return math.prod(self.sizes) if i is None else self.sizes[i]

    shard = SimpleNamespace(is_replicate=lambda: False)
    rep = SimpleNamespace(is_replicate=lambda: True)
    assert replication(torch.zeros(2), 8) == 8                        # a plain tensor: everyone
    hsdp = SimpleNamespace(placements=(rep, shard), device_mesh=_Mesh(2, 4))
    assert replication(hsdp, 8) == 2                                  # the replicate dim's size
    sub = SimpleNamespace(placements=(shard,), device_mesh=_Mesh(4))
    assert replication(sub, 8) == 2                                   # two copies of its mesh


def test_clip_value_must_be_positive():
    from dmuon.functional.grad_norm import check_clip_value
    assert check_clip_value(1) == 1.0
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="clip_value must be > 0"):
            check_clip_value(bad)
