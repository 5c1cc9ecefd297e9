"""The ``dmuon plan`` command and the per-rank step bytes it prints (from the schedule accounting)."""
import json

import pytest

from dmuon.__main__ import main
from dmuon.functional.plan import plan_owners
from dmuon.tools.presets import get_preset, preset_specs
from dmuon.tools.step_bytes import step_bytes_per_rank


@pytest.mark.parametrize("G,R", [(4, 1), (2, 2)])
def test_step_bytes_mean_matches_formula(G, R):
    specs = [s for s in preset_specs(get_preset("llama-3.2-1b")) if s.route == "muon"]
    plan = plan_owners(specs, G, R)
    shapes = {s.name: s.shape for s in specs}
    dtypes = {s.name: s.dtype for s in specs}
    comm = step_bytes_per_rank(plan.owners, shapes, dtypes, G, R)
    P = sum(s.nbytes for s in specs)
    # shard-axis lanes: 2(G-1)/G*P (Z2) and 3(G-1)/G*P (Z3) per rank on average; HSDP adds
    # (R-1)*P stage-2 reduce and (R-1)*P publish in total over all G*R ranks.
    extra = 2 * (R - 1) * P / (G * R)
    assert sum(comm["z2"]) / (G * R) == pytest.approx(2 * (G - 1) / G * P + extra, rel=1e-12)
    assert sum(comm["z3"]) / (G * R) == pytest.approx(3 * (G - 1) / G * P + extra, rel=1e-12)


def test_cli_plan_json(capsys):
    assert main(["plan", "--model", "llama-3.2-1b", "--shard", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "llama-3.2-1b"
    assert len(out["comm_bytes_per_rank"]["z2"]) == 4
    assert all(b > 0 for b in out["comm_bytes_per_rank"]["z3"])


def test_strategy_rows_of_a_plan_with_a_split():
    """A matrix far above the mean rank cost is split over ranks of one node; the rows say so."""
    from dmuon.functional.specs import specs_from_named_shapes
    from dmuon.tools.plan_report import strategy_rows, strategy_table

    named = [(f"layers.{i}.q_proj.weight", (256, 256), "torch.float32") for i in range(6)]
    # (4096 rows: at 2048 x 8192 the executed split's scatter / gather cost more than it saves)
    named.append(("layers.0.big_proj.weight", (4096, 8192), "torch.float32"))
    specs = specs_from_named_shapes(named, lambda n, p: True)
    rows = {r["name"]: r for r in strategy_rows(plan_owners(specs, 8, 1, max_split=4), specs)}
    big = rows["layers.0.big_proj.weight"]
    assert big["placement"] == "split" and big["k"] > 1 and len(set(big["ranks"])) == big["k"]
    assert big["cost_vs_mean"] > 1 and "ways its largest piece costs" in big["reason"]
    assert all(r["placement"] == "owner" for n, r in rows.items() if n != big["name"])
    assert "split/" in strategy_table(list(rows.values()))


@pytest.mark.slow
def test_cli_plan_strategy_table(capsys):
    """Every Muon matrix's placement (whole on one owner, or split over k ranks of a node) with
    the reason, as data (--json) and as text."""
    assert main(["plan", "--model", "llama-3.1-70b", "--shard", "64", "--replicate", "8",
                 "--max-split", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["strategy"]
    specs = [s for s in preset_specs(get_preset("llama-3.1-70b")) if s.route == "muon"]
    assert sorted(r["name"] for r in rows) == sorted(s.name for s in specs)
    split = [r for r in rows if r["placement"] == "split"]
    assert split and all(1 < r["k"] <= 8 and len(set(r["ranks"])) == r["k"] for r in split)
    assert all(len({rk // 8 for rk in r["ranks"]}) == 1 for r in split)  # one node each
    whole = [r for r in rows if r["placement"] == "owner"]
    assert all(r["reason"] == "splitting would not lower the largest rank cost" for r in whole)
    assert main(["plan", "--model", "llama-3.2-1b", "--shard", "4"]) == 0
    out = capsys.readouterr().out
    assert "per-matrix strategy" in out and "splitting not asked for (max_split 1)" in out


def test_version_flag_prints_the_package_version(capsys):
    import dmuon

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"dmuon {dmuon.__version__}"
