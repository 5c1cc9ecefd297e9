"""Issue 38, the step's transient memory and the offload copies (gloo, 2 ranks, one spawn).

* **Chunked decode**: with a stored momentum that is not the working one (bf16 / fp8, or
  offloaded), the owner's step decodes it chunk by chunk (a byte budget of working momentum), so
  the live decoded bytes never exceed one chunk (measured by counting the live outputs of
  :func:`dmuon.functional.state_dtype.decode`, the one decoder); the chunked run is bitwise the
  one-chunk run.
* **Offload prefetch in backward**: each hook group's host -> device copy starts when that
  group's gradient reduce is issued (none during a ``no_sync`` micro-batch), and the step sees
  the committed values whatever the user does between backward and step: a checkpoint save or
  load, a skipped batch (``zero_grad`` without ``step``), a matrix frozen for a step, a newer
  optimizer on the same model (the superseded one copies nothing and is not kept alive).
"""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from dist_utils import run_ranks

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _count_decodes():
    """Patch ``state_dtype.decode`` to count the bytes of its live outputs; returns the counter
    ``{"live", "peak"}`` (reset ``peak`` before a step)."""
    from dmuon.functional import state_dtype as sd

    counter = {"live": 0, "peak": 0}
    orig = sd.decode

    def _release(n: int) -> None:
        counter["live"] -= n

    def decode(stored, dtype, out=None):
        res = orig(stored, dtype, out)
        if out is None:
            counter["live"] += res.nbytes
            counter["peak"] = max(counter["peak"], counter["live"])
            weakref.finalize(res, _release, res.nbytes)
        return res

    sd.decode = decode
    return counter


def _train(rank, world, kw, batches, *, chunk=None, between=None, freeze_at=None, cap=None):
    """Build the tiny model (4 layers) with ``dmuon.Muon(**kw)``; per batch: zero_grad, forward,
    backward, ``between(i, model, opt)`` (may return "skip": no step), step."""
    from models import make_model
    from stateful_harness import build_dmuon

    model = make_model(n_layers=2)
    model, opt = build_dmuon(rank, world, model, model.layers, dict(muon_kw=kw))
    if chunk is not None:
        opt._storage.chunk_bytes = chunk
    opt._storage.prefetch_bytes = cap
    for i, ids in enumerate(batches):
        opt.zero_grad()
        frozen = model.layers[1].mlp.up_proj.weight
        frozen.requires_grad_(freeze_at != i)
        model(ids.chunk(world)[rank]).backward()
        if between is not None and between(i, model, opt) == "skip":
            continue
        opt.step()
    return model, opt


def _sd(model):
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict
    return {k: v.clone() for k, v in get_model_state_dict(model).items()}


def _worker(rank, world):
    from models import make_batches

    out = {}
    batches = make_batches(4, 4)
    # ---- chunked decode: live decoded bytes <= one chunk; bitwise the one-chunk run
    counter = _count_decodes()
    excess = []  # per step: the peak of live decoded bytes above what lived before the step
    grown = []  # per step: live decoded bytes after it minus before it (0: none outlives it)

    def watch(i, model, opt):
        if i:
            excess.append(counter["peak"] - counter["base"])
            grown.append(counter["live"] - counter["base"])
        counter["peak"] = counter["base"] = counter["live"]

    for key, kw in (("bf16", dict(momentum_dtype=BF16)),
                    ("fp8_offload", dict(momentum_dtype=FP8, offload_state=True))):
        ref_model, _ = _train(rank, world, kw, batches)
        budget = 1  # below any matrix: one matrix per chunk
        excess.clear()
        model, opt = _train(rank, world, kw, batches, chunk=budget, between=watch)
        masters = opt.dedicated_state.owned_masters()
        out[f"{key}_peak"] = max(excess + [counter["peak"] - counter["base"]])
        out[f"{key}_largest"] = max((m.nbytes for m in masters.values()), default=0)
        out[f"{key}_total"] = sum(m.nbytes for m in masters.values())
        a, b = _sd(model), _sd(ref_model)
        out[f"{key}_bitwise"] = all(torch.equal(a[k], b[k]) for k in b)
    out["grown"] = grown

    # ---- offload: copies start in backward, per group, not in no_sync micro-batches
    def copies_seen(i, model, opt):
        out.setdefault("copies_after_backward", []).append(opt._storage.copies.copies_in)

    model, opt = _train(rank, world, dict(offload_state=True), batches[:1], between=copies_seen)
    n_owned = len(opt.dedicated_state.owned_names)
    out["owned"] = n_owned
    out["copies_in_total"] = opt._storage.copies.copies_in
    from dmuon.stateful.runtime.no_sync import no_sync
    opt.zero_grad()
    ids = batches[1].chunk(world)[rank]
    with no_sync(model):
        model(ids[:1]).backward()
    out["copies_after_no_sync"] = opt._storage.copies.copies_in - n_owned
    model(ids[1:]).backward()
    out["copies_after_synced"] = opt._storage.copies.copies_in - n_owned
    opt.step()

    # ---- prefetch_bytes=0: the backward copies nothing, the step copies all; same bits
    first = out.pop("copies_after_backward")
    model, opt = _train(rank, world, dict(offload_state=True), batches[:2], between=copies_seen,
                        cap=0)
    out["capped_copies_after_backward"] = out.pop("copies_after_backward")
    out["copies_after_backward"] = first
    out["capped_vs_uncapped"] = _sd(model)
    model, opt = _train(rank, world, dict(offload_state=True), batches[:2])
    a, b = out["capped_vs_uncapped"], _sd(model)
    out["capped_vs_uncapped"] = all(torch.equal(a[k], b[k]) for k in b)

    # ---- offload vs on device, with the user doing things between backward and step
    def scenario(kw, where):
        saved = {}

        def between(i, model, opt):
            if i == 1:  # a save between backward and step: the state after step 0
                saved["sd1"] = copy.deepcopy(opt.state_dict())
            if i == 2 and where == "load_after_backward":
                opt.load_state_dict(saved["sd1"])
            if i == 1 and where == "skip":
                return "skip"
            if i == 1 and where == "write_state":  # through opt.state (fp32: the buffers)
                for p in opt.param_groups[0]["params"]:
                    buf = opt.state[p]["momentum_buffer"]
                    if buf.numel():  # owned here (else a marker)
                        buf.mul_(0.5)
            return None

        if where == "load_before_forward":
            from models import make_model
            from stateful_harness import build_dmuon
            model = make_model(n_layers=2)
            model, opt = build_dmuon(rank, world, model, model.layers, dict(muon_kw=kw))
            for i, ids in enumerate(batches[:3]):
                opt.zero_grad()
                if i == 2:
                    opt.load_state_dict(saved_sd1[kw.get("offload_state", False)])
                model(ids.chunk(world)[rank]).backward()
                opt.step()
                if i == 0:
                    saved_sd1[kw.get("offload_state", False)] = copy.deepcopy(opt.state_dict())
            return _sd(model), {}
        if where == "skip":
            model, opt = _train(rank, world, kw, batches[:3], between=between)
        elif where == "freeze":
            model, opt = _train(rank, world, kw, batches[:3], freeze_at=1)
        elif where == "skip_ref":
            model, opt = _train(rank, world, kw, [batches[0], batches[2]])
        else:
            model, opt = _train(rank, world, kw, batches[:3], between=between)
        return _sd(model), saved

    saved_sd1 = {}
    for where in ("load_after_backward", "load_before_forward", "skip", "skip_ref", "freeze",
                  "write_state"):
        for key, kw in (("dev", dict(momentum_dtype=BF16)),
                        ("off", dict(momentum_dtype=BF16, offload_state=True))):
            if where == "write_state":  # fp32: opt.state's momentum_buffer is the stored tensor
                kw = {k: v for k, v in kw.items() if k != "momentum_dtype"}
            out[f"{where}_{key}"] = scenario(kw, where)[0]

    # ---- a newer optimizer on the same model: the superseded one copies nothing, is not kept
    from dmuon.stateful.optimizer.muon import Muon
    model, opt1 = _train(rank, world, dict(offload_state=True), batches[:1])
    before = opt1._storage.copies.copies_in
    opt2 = Muon(model, offload_state=True)
    opt2.zero_grad()
    model(batches[1].chunk(world)[rank]).backward()
    out["superseded_copies"] = opt1._storage.copies.copies_in - before
    out["newer_copies"] = opt2._storage.copies.copies_in
    opt2.step()
    ref = weakref.ref(opt1)
    del opt1
    gc.collect()
    out["superseded_freed"] = ref() is None
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 2, timeout=240)


def test_decode_per_chunk(results):
    """Live decoded momentum never exceeds one chunk (here: one matrix, the largest at most),
    where decoding all at once would hold every owned matrix; bitwise the one-chunk run."""
    for r in results:
        for key in ("bf16", "fp8_offload"):
            assert r[f"{key}_bitwise"], key
            if r[f"{key}_total"]:
                assert r[f"{key}_total"] > r[f"{key}_largest"]  # not vacuous: several matrices
                assert 0 < r[f"{key}_peak"] <= r[f"{key}_largest"], (key, r[f"{key}_peak"])
        assert r["grown"] and not any(r["grown"]), r["grown"]  # nothing decoded outlives a step


def test_offload_prefetch_in_backward(results):
    """With offload, each owned momentum is copied in once per step, during the backward that
    issues its group's reduce (none during a no_sync micro-batch)."""
    for r in results:
        n = r["owned"]
        assert n > 0
        assert r["copies_after_backward"] == [n], r["copies_after_backward"]
        assert r["copies_in_total"] == n
        assert r["copies_after_no_sync"] == 0
        assert r["copies_after_synced"] == n
        # prefetch_bytes=0: none in backward (the step copies all), bitwise the same weights
        assert r["capped_copies_after_backward"] == [0, n]
        assert r["capped_vs_uncapped"]


def test_offload_between_backward_and_step(results):
    """The step uses the committed momentum whatever happens between backward and step: a
    checkpoint load (== loading before the forward), a skipped batch (== never seeing it), a
    matrix frozen for a step; offloaded bitwise == on device in each case."""
    for r in results:
        for where in ("load_after_backward", "load_before_forward", "skip", "skip_ref",
                      "freeze", "write_state"):
            a, b = r[f"{where}_off"], r[f"{where}_dev"]
            assert all(torch.equal(a[k], b[k]) for k in b), where
        for key in ("dev", "off"):
            a, b = r[f"load_after_backward_{key}"], r[f"load_before_forward_{key}"]
            assert all(torch.equal(a[k], b[k]) for k in b), key
            a, b = r[f"skip_{key}"], r[f"skip_ref_{key}"]
            assert all(torch.equal(a[k], b[k]) for k in b), key


def test_superseded_optimizer_copies_nothing(results):
    for r in results:
        assert r["superseded_copies"] == 0 and r["newer_copies"] == r["owned"]
        assert r["superseded_freed"]


class _BF16IO:
    """A :class:`~dmuon.functional.stages.momentum.MomentumIO` over bf16-stored momentum, one
    matrix per chunk, in reverse order; counts the chunks alive at once."""

    def __init__(self):
        self.live = self.peak = self.loads = 0

    def chunks(self, names):
        return [[k] for k in reversed(range(len(names)))]

    def load(self, names, stored):
        self.live += 1
        self.peak, self.loads = max(self.peak, self.live), self.loads + 1
        return [s.double() for s in stored]

    def store(self, names, stored, work):
        for s, w in zip(stored, work):
            s.copy_(w.to(s.dtype))
        self.live -= 1


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("tensor_mu", [False, True])
def test_momentum_io_is_bitwise_the_working_update(nesterov, tensor_mu):
    """functional ``muon.update(momentum_io=...)``: the momentum stage loads / stores one chunk at
    a time and the result is bitwise the update on the decoded momentum rounded afterwards (views,
    lr / wd multiplier groups through owner_step, Nesterov or not, a 0-d tensor momentum)."""
    from dmuon.functional import muon as fmuon
    from dmuon.functional.matrix_view import Batch
    from dmuon.functional.owner_step import owner_step

    g = torch.Generator().manual_seed(0)
    shapes = {"a": (16, 24), "b": (24, 16), "c": (16, 24), "e": (3, 8, 12)}
    params = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    mom = {n: torch.randn(s, generator=g, dtype=torch.float64).to(BF16) for n, s in shapes.items()}
    grads = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    grads["c"] = None  # no gradient: params and stored momentum untouched
    hp = fmuon.MuonHParams(lr=0.02, momentum=torch.tensor(0.9, dtype=torch.float64)
                           if tensor_mu else 0.9, nesterov=nesterov, weight_decay=0.1,
                           ns_dtype=torch.float64)
    kw = dict(views={"e": Batch(1)}, mults={"b": (0.5, 2.0)})
    ref_p = {n: p.clone() for n, p in params.items()}
    ref_s = fmuon.MuonState(torch.tensor(3.0, dtype=torch.float64),
                            {n: m.double() for n, m in mom.items()})
    ref_p, ref_s = owner_step({n: None if v is None else v.clone() for n, v in grads.items()},
                              ref_s, ref_p, hp, donate=True, **kw)
    io = _BF16IO()
    st = fmuon.MuonState(torch.tensor(3.0, dtype=torch.float64), dict(mom))
    new_p, new_s = owner_step(grads, st, params, hp, donate=True, donate_grads=True,
                              momentum_io=io, **kw)
    assert io.peak == 1 and io.loads == 3
    assert float(new_s.step) == float(ref_s.step) == 4.0
    for n in shapes:
        assert torch.equal(new_p[n], ref_p[n]), n
        assert new_s.momentum[n] is mom[n]  # the stored tensors, written in place
        assert torch.equal(mom[n], ref_s.momentum[n].to(BF16)), n
    with pytest.raises(ValueError, match="donate=True"):
        fmuon.update(grads, st, params, hp, momentum_io=io)


def test_memory_model_counts_one_chunk_and_the_backward_copies():
    """``rank_memory``: a narrow momentum costs the step one chunk of decoded momentum (not all
    of it); offloaded, the backward holds the copies its reduces started (none with
    ``prefetch_bytes=0``: the backward then holds no momentum at all), and an fp32 offloaded step
    starts as the on-device one."""
    from test_order_check import _program
    from dmuon.functional.memory_model import rank_memory
    from dmuon.functional.state_dtype import chunk_peak

    prog = _program(1, 1)  # one rank owns all 17 matrices (4 layers x 4 + a root matrix)
    sizes = [e.numel * 4 for b in prog.master_layout.buckets for e in b.entries]
    assert chunk_peak(sizes, 1) == max(sizes) and chunk_peak(sizes, None) == sum(sizes)
    assert chunk_peak(sizes, 10 ** 9) == sum(sizes) and chunk_peak([], 1) == 0
    fp32 = rank_memory(prog, (0, 0))
    one = rank_memory(prog, (0, 0), momentum_dtype=BF16, chunk_bytes=None)
    small = rank_memory(prog, (0, 0), momentum_dtype=BF16, chunk_bytes=1)
    assert one.phases["step"] - small.phases["step"] == sum(sizes) - max(sizes)
    off = rank_memory(prog, (0, 0), offload_state=True, chunk_bytes=1)
    capped = rank_memory(prog, (0, 0), offload_state=True, chunk_bytes=1, prefetch_bytes=0)
    assert capped.phases["backward"] == fp32.phases["backward"] - fp32.state
    assert off.phases["backward"] > capped.phases["backward"]
    assert off.phases["step"] == fp32.phases["step"]
    assert capped.phases["step"] == fp32.phases["step"] - fp32.state + 2 * max(sizes)
