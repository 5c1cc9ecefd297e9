"""Random layouts for the schedule / simulator / executor tests (shared by several test files)."""
from __future__ import annotations

import random

import torch

from dmuon.functional.buckets import bucket_layout, hook_groups, to_torch_dtype


def random_layout(seed: int, G: int | None = None, R: int | None = None, *, n_layers: int | None = None,
                  dtypes=("torch.float64",), align: int = 1):
    """A random owner plan over a random (or given) G x R mesh and its bucket layout.

    Returns (layout, owners, shapes, dtypes_by_name)."""
    rng = random.Random(seed)
    G = G or rng.randint(1, 4)
    R = R or rng.randint(1, 4)
    n_layers = n_layers or rng.randint(1, 3)
    owners, shapes, dts = {}, {}, {}
    for layer in range(n_layers):
        for proj in rng.sample(["q", "k", "v", "o", "up", "down", "gate"], rng.randint(1, 5)):
            name = f"model.layers.{layer}.{proj}_proj.weight"
            owners[name] = (rng.randrange(G), rng.randrange(R))
            shapes[name] = (rng.randint(1, 5), rng.randint(1, 6))
            dts[name] = rng.choice(dtypes)
    layout = bucket_layout(owners, shapes, dts, hook_groups(list(owners)), G, R, align=align)
    return layout, owners, shapes, dts


def random_buffers(layout, seed: int, *, integer: bool = False):
    """Per-rank buckets with distinct random content on every rank (all ranks hold all buckets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layout.world_size):
        d = {}
        for b in layout.buckets:
            dt = to_torch_dtype(b.key.dtype)
            if integer:
                x = torch.randint(-64, 64, (b.numel,), generator=g).to(dt)
            else:
                x = torch.randn(b.numel, generator=g, dtype=torch.float64).to(dt)
            d[b.key] = x
        out.append(d)
    return out
