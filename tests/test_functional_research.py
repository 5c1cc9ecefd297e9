"""The research example (``examples/functional_research.py``): ``torch.func.grad`` + a chain
composed by hand + the step program through ``rank_step`` on 2 gloo ranks equals one process, on
every rank, and the pure step refuses trees that do not fit its program (a gradient no matrix of
the program takes is an error, never silently skipped)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _example():
    name = "dmuon_example_functional_research"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "functional_research.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _worker(rank: int, world: int) -> dict:
    ex = _example()
    return {n: t.clone() for n, t in ex.train(ex.make_model()).items()}


def test_research_example_equals_one_process():
    ex = _example()
    ref = ex.train_one_process(ex.make_model())
    start = {n: p.detach() for n, p in ex.make_model().named_parameters()}
    results = run_ranks(_worker, 2, timeout=180)
    for r, got in enumerate(results):
        assert set(got) == set(ref)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-12, msg=f"rank {r} {n}")
            assert not torch.equal(got[n], start[n])  # trained


def test_glue_is_short():
    text = (ROOT / "examples" / "functional_research.py").read_text()
    glue = text.split("# --- glue", 1)[1].split("# --- end of glue", 1)[0].splitlines()[1:]
    code = [ln for ln in glue if ln.strip() and not ln.strip().startswith("#")]
    assert len(code) <= 30, len(code)


def test_pure_step_refuses_trees_that_do_not_fit():
    from dmuon.functional import muon as fmuon
    from dmuon.functional.program import step_program
    from dmuon.functional.step import world_step

    owners = {"a": (0, 0), "b": (1, 0)}
    shapes = {"a": (3, 4), "b": (4, 4)}
    prog = step_program(owners, shapes, {n: "torch.float64" for n in owners}, shard_size=2)
    params = [{"a": torch.zeros(3, 4, dtype=torch.float64)},
              {"b": torch.zeros(4, 4, dtype=torch.float64)}]
    stray = [{"c": torch.ones(2, 2, dtype=torch.float64)}, {}]
    with pytest.raises(ValueError, match=r"gradients of \['c'\]"):
        world_step(params, stray, prog, None, fmuon.MuonHParams())
    with pytest.raises(ValueError, match=r"params lack \['b'\]"):
        world_step([params[0], {}], [{}, {}], prog, None, fmuon.MuonHParams())
