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
