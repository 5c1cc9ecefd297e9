"""Hook groups and bucket layout: contiguity, ordering, alignment, dtype keying, errors."""
import math

import pytest
import torch

from dmuon.functional.buckets import (BucketKey, bucket_layout, default_group_key, dtype_itemsize,
                                      dtype_str, hook_groups)
from sched_cases import random_layout


def test_default_group_key():
    assert default_group_key("model.layers.3.mlp.up_proj.weight") == "model.layers.3"
    assert default_group_key("transformer.h.0.attn.c_attn.weight").endswith("h.0")
    assert default_group_key("lm_head.weight") == "lm_head"
    assert default_group_key("w") == ""


def test_hook_groups_order_and_mapping():
    names = ["b.layers.1.x", "b.layers.0.y", "b.layers.1.a", "b.layers.0.b"]
    hg = hook_groups(names)
    assert hg.order == ("b.layers.1", "b.layers.0")                  # first appearance
    assert hg.names("b.layers.1") == ("b.layers.1.a", "b.layers.1.x")  # sorted
    hg2 = hook_groups(names, order=["b.layers.0", "b.layers.1", "unused"])
    assert hg2.order == ("b.layers.0", "b.layers.1")
    hg3 = hook_groups(names, {n: "one" for n in names})
    assert hg3.order == ("one",) and len(hg3.names("one")) == 4
    hg4 = hook_groups(names, lambda n: "odd" if n.endswith("x") else None)
    assert hg4.group_of("b.layers.1.x") == "odd" and hg4.group_of("b.layers.0.y") == "b.layers.0"
    with pytest.raises(ValueError, match="missing"):
        hook_groups(names, {names[0]: "g"})
    with pytest.raises(ValueError, match="order"):
        hook_groups(names, order=["b.layers.0"])
    with pytest.raises(ValueError, match="duplicate"):
        hook_groups(names + names[:1])
    with pytest.raises(KeyError, match="no hook group"):
        hg.group_of("nope")


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("align", [1, 4])
def test_layout_invariants(seed, align):
    layout, owners, shapes, dts = random_layout(seed, dtypes=("torch.float32", "torch.bfloat16"),
                                                align=align)
    seen = {}
    for b in layout.buckets:
        assert b.key.dtype in ("torch.float32", "torch.bfloat16")
        ents = list(b.entries)
        assert [(e.owner[1], e.name) for e in ents] == sorted((e.owner[1], e.name) for e in ents)
        end = 0
        for e in ents:
            assert e.offset % align == 0 and e.offset >= end      # no overlap, aligned
            assert e.numel == math.prod(shapes[e.name]) and e.shape == tuple(shapes[e.name])
            assert e.owner == tuple(owners[e.name]) and e.owner[0] == b.key.column
            assert dtype_str(dts[e.name]) == b.key.dtype
            end = e.offset + e.numel
            seen[e.name] = b.key
        assert b.numel == end
        # each r's entries are exactly one contiguous range
        for r, off, n in b.ranges:
            mine = [e for e in ents if e.owner[1] == r]
            assert off == mine[0].offset and off + n == mine[-1].offset + mine[-1].numel
            assert off % align == 0
            others = [e for e in ents if e.owner[1] != r]
            assert all(e.offset + e.numel <= off or e.offset >= off + n for e in others)
        assert [r for r, _, _ in b.ranges] == sorted({e.owner[1] for e in ents})
        assert b.nbytes == b.numel * dtype_itemsize(b.key.dtype)
    assert set(seen) == set(owners)                               # every param exactly once
    for name, key in seen.items():
        assert layout.locate(name)[0] == key
    if align == 1:
        assert layout.nbytes() == sum(math.prod(shapes[n]) * dtype_itemsize(dts[n]) for n in owners)
    # buckets ordered by group order then column
    gpos = {g: i for i, g in enumerate(layout.groups)}
    order = [(gpos[b.key.group], b.key.column, b.key.dtype) for b in layout.buckets]
    assert order == sorted(order)
    assert "BucketLayout" in layout.table()


def test_layout_errors_and_determinism():
    owners = {"layers.0.a": (0, 0), "layers.0.b": (1, 0)}
    shapes = {n: (2, 3) for n in owners}
    dts = {n: torch.float32 for n in owners}
    a = bucket_layout(owners, shapes, dts, hook_groups(list(owners)), 2)
    b = bucket_layout(dict(reversed(list(owners.items()))), shapes, dts,
                      {n: "layers.0" for n in owners}, 2)
    assert a == b
    assert a.bucket(BucketKey("layers.0", 1, "torch.float32")).entries[0].name == "layers.0.b"
    with pytest.raises(ValueError, match="outside the mesh"):
        bucket_layout({"layers.0.a": (2, 0)}, shapes, dts, {"layers.0.a": "g"}, 2)
    with pytest.raises(ValueError, match="shape and a dtype"):
        bucket_layout(owners, {}, dts, hook_groups(list(owners)), 2)
    with pytest.raises(ValueError, match="align"):
        bucket_layout(owners, shapes, dts, hook_groups(list(owners)), 2, align=0)
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_str("torch.nope")
    with pytest.raises(KeyError, match="unknown hook group"):
        a.buckets_of("x")
