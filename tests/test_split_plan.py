"""Owner plans with split Newton–Schulz units: when they are chosen, what they contain, and the
schedules and simulator that carry them (exact against single-device NS in fp64)."""
import math

import torch

from dmuon.functional.program import program_from_layouts
from dmuon.__main__ import main
from dmuon.functional.buckets import bucket_layout, hook_groups
from dmuon.newton_schulz.coefficients import ns_coefficient_table
from dmuon.newton_schulz.iteration import newton_schulz
from dmuon.functional.plan import plan_owners
from dmuon.tools.plan_report import plan_summary, plan_table
from dmuon.tools.presets import preset_specs
from dmuon.functional.simulate import simulate
from dmuon.functional.specs import specs_from_named_shapes
from dmuon.functional.split_ns import simulate_split_ns, split_ns_schedule
from dmuon.functional.split_plan import SPLIT_NOTE, owner_entries


def _check_split_plan(plan, specs, node):
    by = {s.name: s for s in specs}
    split = {sp.param for sp in plan.splits}
    for s in specs:
        if s.route == "muon" and s.name not in split:
            assert s.name in plan.owners
    for sp in plan.splits:
        assert sp.param not in plan.owners
        slots = sp.members
        assert len(set(slots)) == sp.k >= 2 and len({x // node for x in slots}) == 1
        long_side = by[sp.param].shape[sp.dim]
        assert [(b.start, b.stop) for b in sp.blocks] == list(sp.layout.col_ranges)
        assert sp.blocks[-1].stop == long_side == sp.layout.n
        for b in sp.blocks:
            assert plan.owners[b.name] == (b.slot % plan.shard_size, b.slot // plan.shard_size)
    entries = owner_entries(plan, specs)
    assert sum(math.prod(e[0]) for e in entries.values()) == sum(s.numel for s in specs
                                                                 if s.route == "muon")


def test_70b_on_64x8_balances_with_splits():
    specs = preset_specs("llama-3.1-70b")
    whole = plan_owners(specs, 64, 8)
    plan = plan_owners(specs, 64, 8, max_split=8)
    assert whole.imbalance > 1.6 and not whole.splits
    assert plan.imbalance <= 1.2 and plan.splits and plan.strategy == "lpt+split"
    assert max(plan.slot_costs) < max(whole.slot_costs)
    _check_split_plan(plan, specs, 8)
    assert plan_owners(specs, 64, 8, max_split=8).fingerprint == plan.fingerprint
    assert plan.fingerprint != whole.fingerprint
    summ = plan_summary(plan)
    assert summ["split_note"] == SPLIT_NOTE and len(summ["splits"]) == len(plan.splits)
    assert SPLIT_NOTE in plan_table(plan, max_rows=4)


def test_no_split_where_it_does_not_help():
    specs = preset_specs("llama-3.1-8b")
    whole = plan_owners(specs, 8)
    plan = plan_owners(specs, 8, max_split=8)
    assert not plan.splits and dict(plan.owners) == dict(whole.owners)
    assert plan_owners(specs, 8, max_split=1).fingerprint == whole.fingerprint
    assert plan_summary(whole)["split_note"] is None


def test_split_plan_schedules_and_simulated_ns_are_exact(monkeypatch):
    """Two big and two small matrices on 4 ranks of one node: the big ones split; their blocks ride
    the ordinary bucket schedules, and their NS run through the plan's split schedules equals
    single-device NS. (Matrices this small would never pay for a split's latency: the test zeroes
    the communication charge to reach the mechanics.)"""
    import dmuon.functional.split_plan as sp_mod
    monkeypatch.setattr(sp_mod, "SPLIT_COLLECTIVE_FLOPS", 0)
    monkeypatch.setattr(sp_mod, "SPLIT_COMM_FLOPS_PER_BYTE", 0)
    monkeypatch.setattr(sp_mod, "EXEC_FLOPS_PER_BYTE", 0)
    named = [("layers.0.big_a.weight", (96, 24), torch.float64),
             ("layers.0.big_b.weight", (24, 80), torch.float64),
             ("layers.1.small_a.weight", (8, 16), torch.float64),
             ("layers.1.small_b.weight", (8, 16), torch.float64)]
    specs = specs_from_named_shapes(named)
    plan = plan_owners(specs, 4, 1, max_split=4, node_size=4)
    # (block 0 of a split holds the whole master since the optimizer executes splits: big_b,
    # 24 x 80, then no longer pays for its bytes on that rank)
    assert "layers.0.big_a.weight" in {sp.param for sp in plan.splits}
    assert plan.imbalance < plan_owners(specs, 4).imbalance
    _check_split_plan(plan, specs, 4)
    entries = owner_entries(plan, specs)
    layout = bucket_layout(plan.owners, {n: e[0] for n, e in entries.items()},
                           {n: e[1] for n, e in entries.items()}, hook_groups(sorted(plan.owners)), 4)
    sched = program_from_layouts(layout, layout, layout)
    torch.manual_seed(0)
    data = {s.name: torch.randn(s.shape, dtype=torch.float64) for s in specs}
    bufs = []
    for rank in range(4):                                  # owners hold their blocks, others zeros
        mine = {}
        for b in layout.buckets:
            t = torch.zeros(b.numel, dtype=torch.float64)
            for e in b.entries:
                if e.owner == (rank, 0):
                    sp = next((x for x in plan.splits if e.name.startswith(x.param + "@")), None)
                    src = data[e.name] if sp is None else _block(data[sp.param], sp, e.name)
                    t[e.offset:e.offset + e.numel] = src.reshape(-1)
            mine[b.key] = t
        bufs.append(mine)
    for g in layout.groups:                                # forward: every rank gets every block
        bufs = simulate(sched.groups[g].unshard, bufs)
    for sp in plan.splits:
        full = data[sp.param]
        for b in sp.blocks:
            key, e = layout.locate(b.name)
            got = bufs[3 - b.slot][key][e.offset:e.offset + e.numel].reshape(b.shape)
            assert torch.equal(got, _block(full, sp, b.name))
        wide = full if sp.dim == 1 else full.mT
        ns_sched = split_ns_schedule(sp.param, sp.layout, sp.members, 4, 1, steps=5,
                                     variant=sp.variant, gram_restart=sp.gram_restart,
                                     dtype=torch.float64, acc_dtype=torch.float64)
        y = simulate_split_ns(wide, sp.layout, ns_coefficient_table("polar_express", 5),
                              variant=sp.variant, gram_restart=sp.gram_restart, schedule=ns_sched)
        want = newton_schulz(full, dtype=torch.float64)
        y = y if sp.dim == 1 else y.mT
        assert ((y - want).norm() / want.norm()).item() <= 1e-12


def _block(full, sp, name):
    b = next(b for b in sp.blocks if b.name == name)
    return full[b.start:b.stop] if sp.dim == 0 else full[:, b.start:b.stop]


def test_cli_plan_with_splits(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "-G", "64", "-R", "8", "--max-split", "8",
                 "--max-rows", "4"]) == 0
    out = capsys.readouterr().out
    assert "split Newton-Schulz:" in out and SPLIT_NOTE in out
