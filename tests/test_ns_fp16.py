"""fp16 as the NS compute dtype: 3 more mantissa bits than bf16, same tensor-core rate on Hopper.

Measured on CPU (``benchmarks/NOTES_ns.md``, session 2): fp16 NS is 5-10x closer to the fp64
iteration than bf16, and Gram NS in fp16 with ONE restart (``gram_restart=3``) is still several
times closer than bf16 with two. On the H200 (session 3, ``benchmarks/ns_accuracy.py``) the same
held from 512x2048 to 8192x28672 (2.0-10x; 4.8-10x with the range lift), so fp16 with one
restart became the CUDA default.
These checks keep that property: a stray bf16 cast in the fp16 path, or a restart schedule that
lets the Gram recursion drift, fails them.
"""
from __future__ import annotations

import pytest
import torch

from dmuon.newton_schulz.iteration import (default_gram_restart, default_ns_dtype, newton_schulz,
                                            resolve_gram_restart)
from dmuon.kernels.ns_engine import NSEngine
from dmuon.newton_schulz.config import NSConfig


def _spectrum(kind: str, b: int, m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(b, m, n, generator=g, dtype=torch.float64)
    u, _ = torch.linalg.qr(torch.randn(b, m, m, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(b, n, m, generator=g, dtype=torch.float64))
    s = 1.0 / torch.arange(1, m + 1, dtype=torch.float64)          # power-law singular values
    return (u * s) @ v.mT


def _err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm(dim=(-2, -1)) / ref.norm(dim=(-2, -1))).max().item()


@pytest.mark.parametrize("kind", ["gauss", "powerlaw"])
def test_fp16_one_restart_beats_bf16_two(kind):
    x = _spectrum(kind, 2, 128, 512, seed=3)
    ref = newton_schulz(x, dtype=torch.float64, variant="direct")
    bf16_default = _err(newton_schulz(x, dtype=torch.bfloat16, variant="gram"), ref)
    assert bf16_default == _err(newton_schulz(x, dtype=torch.bfloat16, variant="gram",
                                              gram_restart=2), ref)
    fp16_two = _err(newton_schulz(x, dtype=torch.float16, variant="gram", gram_restart=2), ref)
    fp16_one = _err(newton_schulz(x, dtype=torch.float16, variant="gram", gram_restart=3), ref)
    fp16_default = _err(newton_schulz(x, dtype=torch.float16, variant="gram"), ref)
    fp16_direct = _err(newton_schulz(x, dtype=torch.float16, variant="direct"), ref)
    bf16_direct = _err(newton_schulz(x, dtype=torch.bfloat16, variant="direct"), ref)
    # measured ratios over 6 seeds: direct 7.5-9x, Gram with two restarts 7-9x, one restart
    # 19-21x (Gaussian) and 2.0-2.1x (power law)
    assert fp16_direct * 5 < bf16_direct
    assert fp16_two * 5 < bf16_default
    assert fp16_one * 1.5 < bf16_default
    assert fp16_default == fp16_one               # "auto" restarts fp16 every 3 iterations
    out = newton_schulz(x.float(), dtype=torch.float16, variant="gram", gram_restart=3)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_auto_restart_period_and_default_dtype():
    assert default_ns_dtype("cuda") == torch.float16 and default_ns_dtype("cpu") == torch.float32
    assert default_gram_restart(torch.float16) == 3
    for dt in (torch.bfloat16, torch.float32, torch.float64):
        assert default_gram_restart(dt) == 2
    assert resolve_gram_restart("auto", torch.float16) == 3
    assert resolve_gram_restart(0, torch.float16) is None
    assert resolve_gram_restart(None, torch.float16) is None
    assert resolve_gram_restart(4, torch.float16) == 4
    for bad in ("Auto", -1, 1.5, True):
        with pytest.raises(ValueError, match="gram_restart must be 'auto', None or an int"):
            resolve_gram_restart(bad, torch.float16)
        with pytest.raises(ValueError, match="gram_restart"):
            newton_schulz(torch.randn(4, 16), gram_restart=bad)
        with pytest.raises(ValueError, match="gram_restart"):
            NSEngine(NSConfig(ns_gram_restart=bad))


def test_engine_auto_restart_follows_its_compute_dtype():
    """The engine resolves ``"auto"`` per program from its compute dtype, as the functional core
    does: the fp16 engine equals the functional fp16 iteration with one restart (same cuBLAS ops
    on CPU), and the fp32 engine the one with two."""
    x = _spectrum("gauss", 1, 64, 256, seed=5)[0].float()
    for dt, period in ((torch.float16, 3), (torch.float32, 2)):
        got = NSEngine(NSConfig(ns_dtype=dt)).orthogonalize([x])[0]
        want = newton_schulz(x, dtype=dt, variant="gram", gram_restart=period)
        other = newton_schulz(x, dtype=dt, variant="gram", gram_restart=5 - period)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert not torch.equal(got, other)
