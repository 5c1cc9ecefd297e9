"""NSEngine's eager path on CPU: grouping by wide shape, chunk splitting, tall/wide, batch dims and
empty inputs must give exactly what the functional ``newton_schulz`` gives per matrix (fp64)."""
import logging

import pytest
import torch

from dmuon.newton_schulz.matrix_shape import as_matrix_shape
from dmuon.newton_schulz.iteration import newton_schulz
from dmuon.newton_schulz.cost import choose_ns_variant
from dmuon.kernels.syrk import make_sym_op, sym_abt, sym_abt_torch
from dmuon.newton_schulz.chunks import plan_ns_chunks
from dmuon.kernels.ns_engine import NSEngine
from dmuon.newton_schulz.config import NSConfig

# (shape, batch_dims): square (direct), wide/tall 4x (gram), 3-D batched, 4-D conv-like, 1.25x
# (direct), a tall twin of a wide shape (same group), an empty one.
CASES = [((32, 32), 0), ((16, 64), 0), ((64, 16), 0), ((3, 16, 64), 1), ((8, 4, 2, 2), 0),
         ((24, 30), 0), ((32, 32), 0), ((0, 5), 0), ((48, 12), 0)]


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype) for s, _ in CASES]


def _reference(xs, **kw):
    """Per input, the functional NS of its (B, m, n) view (a 4-D conv kernel is ONE matrix)."""
    out = []
    for x, (_, bd) in zip(xs, CASES):
        if not x.numel():
            out.append(torch.zeros_like(x))
            continue
        b, m, n = as_matrix_shape(x.shape, bd)
        out.append(newton_schulz(x.reshape(b, m, n), **kw).reshape(x.shape))
    return out


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("max_chunk_bytes", [None, 64 * 64 * 8 * 2, 1])
def test_engine_equals_functional_fp64(max_chunk_bytes):
    xs = _inputs()
    before = [x.clone() for x in xs]
    eng = NSEngine(NSConfig(ns_dtype=torch.float64), max_chunk_bytes=max_chunk_bytes)
    got = eng.orthogonalize(xs, batch_dims=[bd for _, bd in CASES])
    ref = _reference(xs, dtype=torch.float64)
    for x, b in zip(xs, before):
        assert torch.equal(x, b), "inputs were mutated"
    for g, r, x in zip(got, ref, xs):
        assert g.shape == x.shape and g.dtype == x.dtype
        if x.numel() == 0:
            continue
        assert _rel(g, r) < 1e-10
    assert eng.mode(xs, [bd for _, bd in CASES]) == "eager"
    # a second call with new values reuses the program and is still right
    ys = _inputs(seed=1)
    got2 = eng.orthogonalize(ys, batch_dims=[bd for _, bd in CASES])
    for g, r in zip(got2, _reference(ys, dtype=torch.float64)):
        if r.numel():
            assert _rel(g, r) < 1e-10


def test_engine_fp32_default_dtype_and_other_schedules():
    xs = _inputs(torch.float32)
    bds = [bd for _, bd in CASES]
    for coeffs, steps in [("polar_express", 5), ("jordan", 3), ("you", 5)]:
        eng = NSEngine(NSConfig(ns_coefficients=coeffs, ns_steps=steps))
        got = eng.orthogonalize(xs, batch_dims=bds)
        ref = _reference(xs, coefficients=coeffs, steps=steps)
        for g, r in zip(got, ref):
            if r.numel():
                assert g.dtype == torch.float32
                assert _rel(g, r) < 1e-4


def test_plan_groups_tall_with_wide_and_splits():
    shapes = [s for s, _ in CASES]
    bds = [bd for _, bd in CASES]
    chunks, empty = plan_ns_chunks(shapes, bds, steps=5, gram_restart=2, itemsize=8,
                                   max_chunk_bytes=None)
    assert empty == (7,)
    by_shape = {(c.short, c.long): c for c in chunks if not c.tall}
    tall_by_shape = {(c.short, c.long): c for c in chunks if c.tall}
    # 16x64 and 3x16x64 in one wide (16, 64) chunk of 1 + 3 matrices; 64x16 in a tall one
    c = by_shape[(16, 64)]
    assert c.batch == 4 and [e.index for e in c.entries] == [1, 3]
    assert [e.offset for e in c.entries] == [0, 1]
    assert c.variant == choose_ns_variant(16, 64, 5) == "gram"
    t = tall_by_shape[(16, 64)]
    assert t.batch == 1 and [e.index for e in t.entries] == [2] and t.variant == c.variant
    assert by_shape[(32, 32)].batch == 2 and by_shape[(32, 32)].variant == "direct"
    assert by_shape[(24, 30)].variant == "direct"
    assert by_shape[(8, 16)].batch == 1          # (8, 4, 2, 2) is one 8 x 16 matrix
    assert [e.index for e in tall_by_shape[(12, 48)].entries] == [8]
    # splitting: cap of two 16x64 matrices -> chunks of [1, 2] -> 2, 3 (whole inputs only)
    chunks, _ = plan_ns_chunks(shapes, bds, steps=5, gram_restart=2, itemsize=8,
                               max_chunk_bytes=2 * 16 * 64 * 8)
    sizes = [c.batch for c in chunks if (c.short, c.long) == (16, 64) and not c.tall]
    assert sizes == [1, 3]
    assert sum(c.batch for c in chunks) == sum(c.batch for c in plan_ns_chunks(
        shapes, bds, steps=5, gram_restart=2, itemsize=8, max_chunk_bytes=None)[0])


def test_bind_in_place_and_errors():
    xs = _inputs()[:4]
    bds = [bd for _, bd in CASES][:4]
    bufs = [x.clone() for x in xs]
    step = NSEngine(NSConfig(ns_dtype=torch.float64)).bind(bufs, bufs, batch_dims=bds)
    assert step.mode == "eager"
    step()
    for b, r in zip(bufs, _reference(xs, dtype=torch.float64)):
        assert _rel(b, r) < 1e-10
    eng = NSEngine()
    with pytest.raises(ValueError, match="batch_dims"):
        eng.orthogonalize(xs, batch_dims=[0, 1])
    with pytest.raises(ValueError, match="floating"):
        eng.orthogonalize([torch.ones(4, 4, dtype=torch.int64)])
    with pytest.raises(ValueError, match="contiguous"):
        eng.bind([xs[0]], [torch.empty(32, 32).mT.contiguous().mT[:, :32].t()[:16]])
    with pytest.raises(ValueError, match="sym_backend"):
        NSEngine(sym_backend="cutlass")


def test_sym_ops_and_hooked_functional_match():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 12, 20, generator=g, dtype=torch.float64)
    c = torch.randn(2, 12, 12, generator=g, dtype=torch.float64)
    c = c + c.mT
    got = sym_abt(a, alpha=0.5, beta=-2.0, c=c, gamma=3.0, backend="torch")
    ref = 0.5 * a @ a.mT - 2.0 * c + 3.0 * torch.eye(12, dtype=torch.float64)
    assert torch.allclose(got, ref, atol=1e-12)
    assert torch.allclose(sym_abt_torch(a), a @ a.mT)
    with pytest.raises(ValueError, match="3-D"):
        sym_abt(a[0])
    with pytest.raises(ValueError, match="backend"):
        make_sym_op("cutlass")
    # the torch backend of the hook is the functional default: same bits, fp32 and fp64
    for dt in (torch.float32, torch.float64):
        x = torch.randn(3, 16, 48, generator=g, dtype=dt)
        for variant in ("direct", "gram"):
            for restart in (None, 1, 2, 3):
                y = newton_schulz(x, dtype=dt, variant=variant, gram_restart=restart,
                                  sym=make_sym_op("torch"))
                r = newton_schulz(x, dtype=dt, variant=variant, gram_restart=restart)
                assert torch.equal(y, r), (dt, variant, restart)


def test_cuda_graphs_flag_is_harmless_on_cpu(caplog):
    xs = _inputs()[:2]
    with caplog.at_level(logging.WARNING):
        got = NSEngine(NSConfig(ns_dtype=torch.float64), cuda_graphs=True).orthogonalize(xs)
    for g, r in zip(got, _reference(xs, dtype=torch.float64)):
        assert _rel(g, r) < 1e-10
    # CPU tensors run eagerly, silently: the flag costs nothing and warns about nothing
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_twin_computes_the_same_and_keeps_its_own_programs():
    """``NSEngine.twin`` (the NS overlap's per-group engines): bitwise the same results with the
    same settings and timer, its programs its own (the original's are neither evicted nor
    replaced)."""
    eng = NSEngine(NSConfig(ns_dtype=torch.float64, ns_steps=4), max_chunk_bytes=64 * 64 * 8,
                   sym_backend="torch")
    eng.max_programs = 2
    twin = eng.twin()
    assert (twin.config, twin.max_chunk_bytes, twin.sym_backend, twin.max_programs,
            twin.timer) == (eng.config, eng.max_chunk_bytes, "torch", 2, eng.timer)
    xs = _inputs()
    bds = [bd for _, bd in CASES]
    a = eng.orthogonalize_([x.clone() for x in xs], batch_dims=bds)
    keys = list(eng._inplace)
    for seed in range(3):  # more signatures than max_programs, through the twin only
        twin.orthogonalize_([x.clone() for x in _inputs(seed=seed + 2)], batch_dims=bds)
    b = twin.orthogonalize_([x.clone() for x in xs], batch_dims=bds)
    assert list(eng._inplace) == keys and len(twin._inplace) == 2
    assert all(torch.equal(u, v) for u, v in zip(a, b))
