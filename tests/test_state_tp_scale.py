"""8-bit momentum of tensor-parallel slices (issue 38), without processes: the scale is a pure
function of the absolute max (:func:`dmuon.functional.state_dtype.scale_from_absmax`, the one
definition ``encode`` uses), and ``MomentumStorage.share_scales`` makes each slice encode with its
whole matrix's scale: two slices stepped in two threads, whose MAX "collective" is a barrier,
store exactly the whole matrix's ``round_trip`` (the 4-rank gloo run is in the slow tier:
``tests/test_state_storage_modes.py::test_tp_fp8``)."""
from __future__ import annotations

import math
import threading

import pytest
import torch

from dmuon.functional import state_dtype as sd

FP8, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_scale_from_absmax():
    fmax = float(torch.finfo(FP8).max)  # 448
    amax = torch.tensor([0.0, fmax, fmax * 1.5, 1e-3, fmax * 2.0, 1e-38], dtype=torch.float64)
    got = sd.scale_from_absmax(amax, FP8)
    want = [1.0, 1.0, 2.0, 2.0 ** math.ceil(math.log2(1e-3 / fmax)), 2.0, 2.0 ** -126]
    assert got.dtype == torch.float32 and got.tolist() == want
    assert sd.scale_from_absmax(torch.tensor(57344.0), E5M2).item() == 1.0
    with pytest.raises(ValueError, match="no scale"):
        sd.scale_from_absmax(torch.tensor(1.0), torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 24, generator=g, dtype=torch.float64) * 3e-3
    # encode's scale is scale_from_absmax(absmax(x)); slices given the whole matrix's absmax
    # encode as their part of the whole matrix's encoding, bitwise
    whole = sd.encode(x, FP8)
    assert torch.equal(whole.scale, sd.scale_from_absmax(sd.absmax(x), FP8))
    assert sd.absmax(x[:0]).item() == 0.0
    amax = torch.stack([sd.absmax(s) for s in x.chunk(2, dim=1)]).amax()
    parts = [sd.encode(s, FP8, amax=amax) for s in x.chunk(2, dim=1)]
    assert all(torch.equal(p.scale, whole.scale) for p in parts)
    assert torch.equal(torch.cat([p.data.float() for p in parts], dim=1), whole.data.float())
    # without the whole absmax a small slice takes its own (finer) scale: not the whole's encoding
    x[:, 12:] *= 1e-3
    own = sd.encode(x[:, 12:], FP8)
    assert not torch.equal(own.scale, sd.encode(x, FP8).scale)


class _Threads:
    """A MAX "all-reduce" of two threads (a barrier); counts the calls per thread."""

    def __init__(self, n: int):
        self.bar, self.vals, self.calls = threading.Barrier(n, timeout=30), [None] * n, [0] * n

    def reduce(self, k: int):
        def run(v: torch.Tensor) -> torch.Tensor:
            self.calls[k] += 1
            self.vals[k] = v.clone()
            self.bar.wait()
            out = torch.stack(self.vals).amax(0)
            self.bar.wait()
            return out
        return run


@pytest.mark.parametrize("path", ["muon_state", "chain"])
@pytest.mark.parametrize("offload", [False, True, "capped"])
def test_tp_slices_encode_with_the_whole_matrix_scale(offload, path):
    """Two column slices of ``w`` and ``v`` (and a matrix ``u`` each holds whole) stepped with
    ``StepIO`` in chunks of one matrix: a step's first pass hands the slices' updated absmaxes to
    one MAX per step; the stored slices decode to the whole matrix's fp8 round trip, bitwise, with
    the whole matrix's scale (also the initial store, as a checkpoint load stores). ``path``:
    ``muon.update``'s ``momentum_io``, or a chain's (``dmuon.Muon``'s one owner path for Muon and
    every variant: the io handed to the leaves serves the momentum stage whose buffers it
    stores)."""
    from dmuon.functional import muon as fmuon
    from dmuon.functional.owner_step import owner_step
    from dmuon.stateful.optimizer.state_storage import MomentumStorage, StepIO

    g = torch.Generator().manual_seed(1)
    mu = 0.9
    shapes = {"w": (16, 24), "u": (8, 8), "v": (16, 24)}
    # a column slice of v holds much smaller values: its own scale would differ from v's
    b0 = {n: torch.randn(s, generator=g, dtype=torch.float64) * 1e-2 for n, s in shapes.items()}
    b0["v"][:, 12:] *= 1e-3
    grads = {n: torch.randn(s, generator=g, dtype=torch.float64) * 1e-3 for n, s in shapes.items()}
    grads["v"][:, 12:] *= 1e-3
    params = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    whole = {n: sd.round_trip(b, FP8) for n, b in b0.items()}  # the loaded (stored) momentum
    updated = {n: whole[n] * mu + grads[n] for n in shapes}  # b <- mu*b + g, as the stage
    want = {n: sd.round_trip(b, FP8) for n, b in updated.items()}
    hp = fmuon.MuonHParams(lr=0.02, momentum=mu, nesterov=True, ns_dtype=torch.float64)
    grp, out, errs = _Threads(2), [None, None], []

    def cut(t: torch.Tensor, n: str, k: int) -> torch.Tensor:
        return (t if n == "u" else t.chunk(2, dim=1)[k]).clone()  # the step writes in place

    def slice_holder(k: int) -> None:
        try:
            st = MomentumStorage(FP8, bool(offload), torch.device("cpu"))
            st.chunk_bytes = 1  # one matrix per chunk
            if offload == "capped":  # the first pass drops its staged copies (the cap holds)
                st.prefetch_bytes = 0
            st.share_scales(["w", "v"], grp.reduce(k))
            stored = st.store({n: cut(whole[n], n, k) for n in shapes})
            loaded = {n: sd.decode(sd.Stored(t, st.scales[n]), torch.float64)
                      for n, t in stored.items()}
            p = {n: cut(params[n], n, k) for n in shapes}
            io = StepIO(st, stored, p)
            g_k = {n: cut(grads[n], n, k) for n in shapes}
            if path == "chain":
                from dmuon.functional import transforms as T
                from dmuon.functional import variants
                state = T.ChainState((T.MomentumState(stored),) + (T.EmptyState(),) * 3)
                owner_step(g_k, state, p, hp, transform=variants.muon(), donate=True,
                           donate_grads=True, momentum_io=io)
            else:
                owner_step(g_k, fmuon.MuonState(torch.tensor(0.0), stored), p, hp, donate=True,
                           donate_grads=True, momentum_io=io)
            st.copies.synchronize()  # offload: the host buffers are current once copies back ran
            out[k] = (loaded, {n: sd.decode(sd.Stored(t, st.scales[n]), torch.float64)
                               for n, t in stored.items()}, dict(st.scales), st.last_chunks,
                      st.copies.copies_in)
        except Exception as e:  # noqa: BLE001 (reported below)
            errs.append(e)
            grp.bar.abort()

    ts = [threading.Thread(target=slice_holder, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs, errs
    assert grp.calls == [2, 2]  # one MAX at the store (load), one per step
    for n in shapes:
        for key, ref in ((0, whole[n]), (1, want[n])):
            got = out[0][key][n] if n == "u" else torch.cat([out[k][key][n] for k in (0, 1)], 1)
            assert torch.equal(got, ref), (n, key)
        scale = sd.encode(updated[n], FP8).scale
        assert all(torch.equal(out[k][2][n], scale) for k in (0, 1)), n
    assert out[0][3] == 5  # the first pass over w, v (2 chunks) and the storing pass (3)
    assert out[0][4] == {False: 0, True: 3, "capped": 5}[offload]
