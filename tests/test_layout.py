"""The package layout's dependency rules, read from the code itself (static imports) and from a
fresh interpreter's ``sys.modules``.

* the pure core (:mod:`dmuon.functional`, :mod:`dmuon.newton_schulz`) never imports
  ``torch.distributed``, the acting layer (:mod:`dmuon.stateful`), torch compatibility
  (:mod:`dmuon.compat`), the device kernels (:mod:`dmuon.kernels`) or the offline tools
  (:mod:`dmuon.tools`);
* nothing the training path imports (:mod:`dmuon.stateful`, :mod:`dmuon.compat`,
  :mod:`dmuon.kernels`, :mod:`dmuon.integrations`) imports the offline tools or the file-level
  checkpoint manager (:mod:`dmuon.checkpoint`: it sits above the stateful layer), lazy imports
  included; a fresh interpreter that imports every module of :mod:`dmuon.stateful` and runs a
  training step (and torch's state-dict protocol) loads no module of :mod:`dmuon.checkpoint`;
* ``import dmuon.functional`` loads no module of :mod:`dmuon.stateful` or :mod:`dmuon.tools`;
  ``import dmuon`` still installs the ``fully_shard`` patch (the seeds' contract);
* the wings of the stateful layer depend one way (:data:`WINGS`, lowest first): a module imports
  only modules of its own wing or of a wing before it, lazy imports included, so the package
  graph has no cycle;
* no file of the package is longer than 600 lines (the cap names files that may hold more than
  one concept; where code goes is the wing rule's, not the count's).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dmuon"


def _imports(path: Path) -> set[str]:
    return _imports_in(path.read_text(encoding="utf-8"))


def _imports_in(source: str) -> set[str]:
    """Every module name ``source`` imports (top level and inside functions), by an import
    statement, ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name, or
    an attribute of ``dmuon`` that loads a module on first use (``dmuon.save_sharded``: the module
    :data:`dmuon._PUBLIC` names; ``dmuon.checkpoint``: the subpackage)."""
    import dmuon

    tree = ast.parse(source)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and (
                    getattr(node.func, "attr", None) == "import_module"
                    or getattr(node.func, "id", None) in ("import_module", "__import__")):
            out.add(node.args[0].value)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "dmuon":
            if node.attr in dmuon._PUBLIC:
                out.add(dmuon._PUBLIC[node.attr])
            elif node.attr in dmuon._SUBPACKAGES:
                out.add(f"dmuon.{node.attr}")
    return out


def _files(*subdirs: str) -> list[Path]:
    return sorted(p for d in subdirs for p in (PKG / d).rglob("*.py"))


def _offenders(files: list[Path], banned: tuple[str, ...]) -> list[str]:
    bad = []
    for f in files:
        for m in sorted(_imports(f)):
            if any(m == b or m.startswith(b + ".") for b in banned):
                bad.append(f"{f.relative_to(PKG.parent)} imports {m}")
    return bad


def test_pure_core_imports_nothing_that_acts():
    banned = ("torch.distributed", "dmuon.stateful", "dmuon.compat", "dmuon.tools", "dmuon.kernels",
              "dmuon.integrations", "dmuon.demo")
    files = _files("functional", "newton_schulz")
    assert len(files) > 20
    assert _offenders(files, banned) == []


def test_training_path_never_imports_the_offline_tools():
    files = _files("stateful", "compat", "kernels", "integrations", "functional", "newton_schulz")
    assert _offenders(files, ("dmuon.tools",)) == []


#: the packages a training step reaches (``dedicate_params``, the hooks, ``Muon.step``, torch's
#: state-dict protocol); :mod:`dmuon.checkpoint` (save_sharded / load_sharded, read_state_dict)
#: builds on them and is never imported by them
TRAINING_PATH = ("stateful", "compat", "kernels", "integrations", "functional", "newton_schulz")


def test_training_path_never_imports_the_checkpoint_manager():
    files = _files(*TRAINING_PATH)
    assert len(files) > 100
    # (and verify mode, dmuon.verify: a check on the real mesh, not training, since issue 45)
    assert _offenders(files, ("dmuon.checkpoint", "dmuon.verify")) == []
    # the check sees lazy imports: the checkpoint manager's own modules import dmuon.stateful
    # inside and outside functions, and dmuon's PEP 562 names resolve to their modules
    assert _offenders(_files("checkpoint"), ("dmuon.stateful",)) != []
    lazy = ("def f():\n    import dmuon\n    dmuon.save_sharded\n    dmuon.checkpoint\n"
            "    importlib.import_module('dmuon.checkpoint.files')\n")
    assert {"dmuon.checkpoint.sharded", "dmuon.checkpoint", "dmuon.checkpoint.files"} <= \
        _imports_in(lazy)


#: the wings of :mod:`dmuon.stateful`, lowest first: the runtime (storage, groups, hooks, ledger,
#: executor, the model's state) < the modes (DDP, TP, meta init, deferred dedication) < the torch
#: state-dict protocol of the model (checkpoint) < the optimizer (``dmuon.Muon``, its owner
#: driver, its state dicts) < extras (clipping, QK-clip, verify) < setup (``dedicate_params``,
#: ``release``); :mod:`dmuon.checkpoint` (the file-level manager) sits above them all
WINGS = ("runtime", "modes", "checkpoint", "optimizer", "extras", "setup")


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["dmuon", "stateful"] else None


def test_stateful_wings_depend_one_way():
    assert sorted(p.name for p in (PKG / "stateful").iterdir() if p.is_dir()
                  and p.name != "__pycache__") == sorted(WINGS)
    against = []
    for f in _files("stateful"):
        mine = _wing("dmuon." + ".".join(f.relative_to(PKG).with_suffix("").parts))
        if mine is None:
            continue
        for m in sorted(_imports(f)):
            theirs = _wing(m)
            if theirs in WINGS and WINGS.index(theirs) > WINGS.index(mine):
                against.append(f"{f.relative_to(PKG.parent)} ({mine}) imports {m} ({theirs})")
    assert against == []
    # the check sees lazy imports (the rule's reason: a lazy import is a cycle all the same)
    assert "dmuon.stateful.setup.dedicate" in _imports_in(
        "def f():\n    from dmuon.stateful.setup.dedicate import dedicate_params\n")


def test_compat_imports_only_torch():
    assert _offenders(_files("compat"), ("dmuon.stateful", "dmuon.functional", "dmuon.tools",
                                         "dmuon.newton_schulz", "dmuon.kernels")) == []


def _fresh_modules(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\n"
                          "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('dmuon'))))"],
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def test_import_functional_loads_nothing_stateful():
    mods = _fresh_modules("import dmuon.functional")
    assert "dmuon.functional.simulate" not in mods  # the core's names load on first use
    mods = _fresh_modules("from dmuon.functional import muon, adamw, transforms, step_program, "
                          "simulate, plan_owners\nimport dmuon.functional.step")
    assert {"dmuon.functional.muon", "dmuon.functional.step", "dmuon.functional.simulate"} <= set(mods)
    assert [m for m in mods if m.startswith(("dmuon.stateful", "dmuon.tools"))] == []


def test_import_dmuon_installs_the_patch_and_loads_the_api_on_use():
    mods = _fresh_modules("import dmuon\n"
                          "from dmuon.compat.fsdp_patch import is_installed\n"
                          "assert is_installed()")
    assert [m for m in mods if m.startswith("dmuon.stateful")] == []
    mods = _fresh_modules("import dmuon\nassert dmuon.Muon.__name__ == 'Muon'")
    assert "dmuon.stateful.optimizer.muon" in mods


_TRAINING_STEP = """
import importlib, os, pkgutil, sys, tempfile
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import dmuon, dmuon.stateful
for info in pkgutil.walk_packages(dmuon.stateful.__path__, "dmuon.stateful."):
    importlib.import_module(info.name)
with tempfile.TemporaryDirectory() as d:
    dist.init_process_group("gloo", init_method=f"file://{d}/rdzv", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.LayerNorm(16), nn.Linear(16, 4))
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.02)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    full = dmuon.get_model_state_dict(model)
    dmuon.set_model_state_dict(model, full)
    dmuon.set_optimizer_state_dict(model, opt, dmuon.get_optimizer_state_dict(model, opt))
    model.load_state_dict(model.state_dict())
    opt.load_state_dict(opt.state_dict())
    dist.destroy_process_group()
"""


def test_a_training_step_loads_no_checkpoint_module():
    mods = _fresh_modules(_TRAINING_STEP)
    assert {"dmuon.stateful.optimizer.muon", "dmuon.stateful.checkpoint.transfer",
            "dmuon.stateful.checkpoint.optimizer_state_dict"} <= set(mods)
    assert [m for m in mods if m == "dmuon.checkpoint" or m.startswith("dmuon.checkpoint.")] == []
    mods = _fresh_modules("import dmuon\nassert dmuon.save_sharded.__module__ == "
                          "'dmuon.checkpoint.sharded'")
    assert "dmuon.checkpoint.sharded" in mods


@pytest.mark.parametrize("limit", [600])
def test_no_file_over_the_limit(limit):
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit}
    assert long == {}
