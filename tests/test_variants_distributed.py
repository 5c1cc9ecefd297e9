"""``dmuon.Muon(model, ..., transform=variant)`` on gloo ranks, fp64, against one process running
the same chain on the full matrices (``tests/variant_worker.py``): NorMuon, Muon-Hyperball and
NorMuonH equal to <= 1e-10 (weights and the variant's state, gathered by name), resumed exactly
through ``Muon.state_dict()`` and ``dmuon.get/set_optimizer_state_dict``; a fixed Transform
refuses a changed lr. Slow tier: ``variants.muon()`` is the default path bitwise; 4 ranks, HSDP 2x2,
TP dp2 x tp2 (column and row slices: NorMuon's sums over the TP group), DDP, and a state saved
on 2 ranks resumed on an HSDP 2x2 mesh; chains with stages written in the optax form only
(tests/optax_stages.py) on 2 ranks."""
from __future__ import annotations

import pytest
import torch

import variant_worker as vw
from dist_utils import run_ranks
from stateful_harness import max_rel_err

KINDS = ("normuon", "muon_hyperball", "normuon_hyperball")


def test_variants_on_two_ranks_equal_one_process():
    results = run_ranks(vw.two_rank_suite, 2, timeout=240)
    for kind in KINDS:
        vw.check([r[kind] for r in results], kind, 3)
    for r in results:
        after = r["normuon"]["after"]
        for how in ("torch", "full"):
            assert max_rel_err(r["normuon"][f"resumed_{how}"], after)[0] == 0.0, how
        kind, msg = r["fixed_changed"]
        assert kind == "RuntimeError" and "fixed Transform" in msg
        # dmuon.Muon.routing_table(): every param, the dedicated ones with their owner rank
        table = r["normuon_hyperball"]["routing"]
        muon_rows = [row for row in table.rows if row.route == "muon"]
        assert muon_rows and all(row.owner in (0, 1) for row in muon_rows)
        assert {row.route for row in table.rows} == {"muon", "adamw"}


@pytest.mark.slow
@pytest.mark.parametrize("mode,world", [("fsdp", 4), ("hsdp", 4), ("tp", 4), ("ddp", 2)])
def test_variants_on_every_mode_equal_one_process(mode, world):
    for kind in KINDS:
        results = run_ranks(vw.run_variant, world, kind, mode, 3, True, timeout=300)
        vw.check(results, kind, 3)
        for r in results:
            assert max_rel_err(r["resumed_full"], r["after"])[0] == 0.0, (mode, kind)
            if "resumed_torch" in r:
                assert max_rel_err(r["resumed_torch"], r["after"])[0] == 0.0, (mode, kind)


@pytest.mark.slow
def test_optax_form_stages_on_two_ranks_equal_one_process():
    """The clip of examples/research_transforms.py (optax form) in Muon's chain, and a stateful
    optax-form stage (per-param state through both state dicts), as ``transform=`` on 2 gloo
    ranks: equal to one process running the chain in the optax form, fp64."""
    for kind in ("optax_clip", "optax_second_moment"):
        results = run_ranks(vw.run_variant, 2, kind, "fsdp", 3, True, timeout=240)
        vw.check(results, kind, 3)
        for r in results:
            for how in ("torch", "full"):
                assert max_rel_err(r[f"resumed_{how}"], r["after"])[0] == 0.0, (kind, how)


@pytest.mark.slow
def test_muon_variant_is_the_default_path_bitwise():
    assert all(run_ranks(vw.muon_chain_bitwise, 2, timeout=240))


@pytest.mark.slow
def test_variant_state_saved_on_two_ranks_resumes_on_hsdp(tmp_path):
    path = str(tmp_path / "normuon.pt")
    run_ranks(vw.save_full, 2, "normuon", path, 3, timeout=240)
    results = run_ranks(vw.resume_full, 4, "normuon", "hsdp", path, 3, 2, timeout=240)
    ref = vw.reference("normuon", 5)
    for r in results:
        assert max_rel_err(r, ref["sd"])[0] <= 1e-10
