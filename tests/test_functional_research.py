"""The research example (``examples/functional_research.py``) at shard size G = 2 with a vector
param: ``torch.func.grad`` + a chain composed by hand + the step program through the runtime's
phases (``forward_gather``, ``rank_step``) and the replicated path of the bias on 2 gloo ranks
equals one process, on every rank; its glue is short and imports only the documented API. In the
same spawned ranks, ``rank_step`` given a gradient function (it gathers first) through the real
executor equals ``world_step`` in the simulator bit for bit. The pure step refuses trees that do
not fit its program (a gradient no matrix of the program takes is an error, never silently
skipped)."""
from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "functional_research.py"


def _example():
    name = "dmuon_example_functional_research"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _gathering_step(rank: int, world: int) -> dict:
    """``rank_step(grads=function)`` on the real executor against ``world_step`` (simulator)."""
    import torch.nn as nn
    from torch.func import functional_call, grad

    import dmuon
    from dmuon.functional import muon, plan_owners, specs_from_named_shapes, step_program
    from dmuon.functional.step import rank_step, world_step

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.Tanh(),
                          nn.Linear(12, 6, bias=False), nn.Tanh(),
                          nn.Linear(6, 4, bias=False)).double()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = plan_owners(specs_from_named_shapes(model.named_parameters()), world)
    prog = step_program(plan.owners, {n: t.shape for n, t in full.items()},
                        {n: "torch.float64" for n in full}, shard_size=world,
                        reshard_after_forward=True)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    hp = muon.MuonHParams(lr=0.05, ns_dtype=torch.float64)

    def grads_of(i: int, f: dict) -> dict:
        loss = lambda p: nn.functional.mse_loss(functional_call(model, p, (x.chunk(world)[i],)),  # noqa: E731
                                                y.chunk(world)[i])
        return grad(loss)(f)

    cols = [{n: full[n].clone() for n in prog.column(i)} for i in range(world)]
    sim, _, sim_sched = world_step(cols, grads_of, prog, None, hp)
    runner = dmuon.mesh_executor(world).run
    mine, _, ran = rank_step((rank, 0), cols[rank], lambda f: grads_of(rank, f), None, prog, hp,
                             runner)
    return {"bitwise": all(torch.equal(mine[n], sim[rank][n]) for n in mine) and
            set(mine) == set(sim[rank]),
            "same_ops": [op.id for op in ran] == [op.id for op in sim_sched],
            "gathers": sum(op.lane == "unshard" for op in ran),
            "column": sorted(prog.column(rank)), "all": sorted(prog.owners)}


def _worker(rank: int, world: int) -> dict:
    ex = _example()
    return {"trained": {n: t.clone() for n, t in ex.train(ex.make_model()).items()},
            "gathering": _gathering_step(rank, world)}


def test_research_example_equals_one_process():
    ex = _example()
    ref = ex.train_one_process(ex.make_model())
    start = {n: p.detach() for n, p in ex.make_model().named_parameters()}
    vectors = {n for n, p in start.items() if p.ndim < 2}
    assert vectors, "the example's model must have a vector param"
    results = run_ranks(_worker, 2, timeout=180)
    held = set()
    for r, res in enumerate(results):
        got = res["trained"]
        # shard axis: a rank holds its column's matrices and the vector params, not every matrix
        assert vectors <= set(got) and set(got) < set(ref), (r, sorted(got))
        held |= set(got)
        for n in got:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-12, msg=f"rank {r} {n}")
            assert not torch.equal(got[n], start[n])  # trained
    assert held == set(ref)
    for r, res in enumerate(results):
        g = res["gathering"]
        assert g["bitwise"] and g["same_ops"], (r, g)
        assert g["gathers"] > 0 and g["column"] != g["all"]  # it gathered; G = 2 really shards


def _glue() -> list[str]:
    text = EXAMPLE.read_text()
    glue = text.split("# --- glue", 1)[1].split("# --- end of glue", 1)[0].splitlines()[1:]
    return [ln for ln in glue if ln.strip() and not ln.strip().startswith("#")]


def test_glue_is_short():
    assert len(_glue()) <= 15, len(_glue())


def test_example_imports_only_the_documented_api():
    """dmuon names the example imports: ``dmuon.functional.__all__`` (a module listed there: its
    ``__all__``), ``dmuon.__all__`` (through ``dmuon.<name>``), and ``dmuon.launch.run`` (the
    examples' launcher)."""
    import dmuon
    import dmuon.functional as F

    tree = ast.parse(EXAMPLE.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dmuon"):
            for alias in node.names:
                name, mod = alias.name, node.module
                if mod == "dmuon.functional":
                    ok = name in F.__all__
                elif mod.startswith("dmuon.functional."):
                    sub = mod.split(".")[2]
                    ok = (sub in F.__all__ and mod.count(".") == 2
                          and name in importlib.import_module(mod).__all__)
                elif mod == "dmuon":
                    ok = name in dmuon.__all__
                else:
                    ok = (mod, name) == ("dmuon.launch", "run")
                if not ok:
                    bad.append(f"from {mod} import {name}")
        elif isinstance(node, ast.Import):
            bad += [f"import {a.name}" for a in node.names
                    if a.name.startswith("dmuon") and a.name != "dmuon"]
    uses = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "dmuon"}
    bad += [f"dmuon.{u}" for u in sorted(uses) if u not in dmuon.__all__]
    assert not bad, bad


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
    with pytest.raises(ValueError, match=r"params lack \['b'\]"):  # before any gather
        world_step([params[0], {}], lambda i, full: {}, prog, None, fmuon.MuonHParams())
