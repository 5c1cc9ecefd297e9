"""A ``rank0_only`` load moves the dedicated matrices and their optimizer state only through the
step program's checkpoint moves (``CheckpointTransfer.from_rank0``: rank 0's rows, a shard-axis
sum, in HSDP a replicate-axis copy, under TP a sum over rank 0's TP group first), never by a
per-tensor broadcast; FSDP2's params, buffers and AdamW moments are broadcast one at a time.

4 gloo ranks, fp64, plain Muon and NorMuon (a per-row state field, smaller than its matrix), on
HSDP 2x2 and TP dp2 x tp2: after two steps, the full model and optimizer dicts loaded with
``rank0_only=True`` into a fresh model read back equal, bitwise, to the dicts loaded (the same
as every rank holding them); the per-tensor broadcast ran exactly once per FSDP2 tensor, and the
checkpoint executor's replicate (HSDP) or TP lane ran (TP: in the slow tier, for the default
tier's time budget).
"""
from __future__ import annotations

import pytest

import variant_worker as vw
from dist_utils import run_ranks
from models import make_batches


def _equal(a, b) -> bool:
    import torch
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _rank0_loads(rank: int, world: int, mode: str, kinds: tuple) -> dict:
    import dmuon
    import dmuon.stateful.checkpoint.optimizer_state_dict as osd_mod
    import dmuon.stateful.checkpoint.state_dict as sd_mod

    calls: list[tuple] = []

    def counting(orig):
        def wrapped(t, shape, dtype, rt):
            calls.append(tuple(shape))
            return orig(t, shape, dtype, rt)
        return wrapped

    sd_mod.from_rank0 = counting(sd_mod.from_rank0)
    osd_mod.from_rank0 = counting(osd_mod.from_rank0)
    out = {}
    for kind in kinds:
        plain = {"transform": None} if kind == "muon" else {}  # plain Muon: no transform
        model, opt, i, n = vw.build("normuon" if plain else kind, mode, world, **plain)
        vw.train(model, opt, make_batches(2, vw.BATCH), i, n)
        msd = dmuon.get_model_state_dict(model)
        osd = dmuon.get_optimizer_state_dict(model, opt)
        fresh, fopt, _, _ = vw.build("normuon" if plain else kind, mode, world, seed=5, **plain)
        # (the model's transfer: transfer_of(state) since the runtime stopped importing the
        # checkpoint wing; it was the state's checkpoint_transfer property)
        from dmuon.stateful.checkpoint.transfer import transfer_of
        ex = transfer_of(fopt.dedicated_state).executor
        before = {lane: c["collectives"] for lane, c in ex.counters().items()}
        calls.clear()
        dmuon.set_model_state_dict(fresh, msd if rank == 0 else None, rank0_only=True)
        dmuon.set_optimizer_state_dict(fresh, fopt, osd if rank == 0 else None, rank0_only=True)
        after = {lane: c["collectives"] for lane, c in ex.counters().items()}
        rt = fopt.dedicated_state
        fsdp_tensors = (len([k for k in msd if k not in _dedicated_keys(fresh, rt)])
                        + 2 * len(fopt.adamw_named_params))
        out[kind] = {
            "model": _equal(dmuon.get_model_state_dict(fresh), msd),
            "optim": _equal(dmuon.get_optimizer_state_dict(fresh, fopt), osd),
            "broadcasts": (len(calls), fsdp_tensors),
            "lanes": {lane: after.get(lane, 0) - before.get(lane, 0) for lane in after},
        }
    return out


def _dedicated_keys(model, rt) -> set:
    from dmuon.stateful.checkpoint.state_dict import dedicated_names_by_key
    return set(dedicated_names_by_key(model, rt))


@pytest.mark.slow  # the default tier's 600 s budget (issue 46's tests); the slow tier runs it
@pytest.mark.parametrize("mode,lane", [("hsdp", "replicate"), ("tp", "tp")])
def test_rank0_only_loads_take_the_bucketed_route(mode, lane):
    results = run_ranks(_rank0_loads, 4, mode, ("muon", "normuon"), timeout=240)
    for rank, res in enumerate(results):
        for kind, r in res.items():
            assert r["model"] and r["optim"], (rank, kind, r)
            calls, fsdp_tensors = r["broadcasts"]
            assert calls == fsdp_tensors, (rank, kind, r)  # none for a dedicated entry
            assert r["lanes"]["reduce"] > 0, (rank, kind, r)
        if lane == "replicate" or rank in (0, 1):  # the TP lane: rank 0's TP group only
            assert any(r["lanes"].get(lane, 0) > 0 for r in res.values()), (rank, res)
    assert sum(r["lanes"].get(lane, 0) for res in results for r in res.values()) > 0
