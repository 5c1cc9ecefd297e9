"""The package layout's dependency rules, read from the code itself (static imports) and from a
fresh interpreter's ``sys.modules``.

* the pure core (:mod:`dmuon.functional`, :mod:`dmuon.newton_schulz`) never imports
  ``torch.distributed``, the acting layer (:mod:`dmuon.stateful`), torch compatibility
  (:mod:`dmuon.compat`), the device kernels (:mod:`dmuon.kernels`) or the offline tools
  (:mod:`dmuon.tools`);
* nothing the training path imports (:mod:`dmuon.stateful`, :mod:`dmuon.compat`,
  :mod:`dmuon.kernels`, :mod:`dmuon.integrations`) imports the offline tools;
* ``import dmuon.functional`` loads no module of :mod:`dmuon.stateful` or :mod:`dmuon.tools`;
  ``import dmuon`` still installs the ``fully_shard`` patch (the seeds' contract);
* no file of the package is longer than 500 lines.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dmuon"


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports (top level and inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
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


@pytest.mark.parametrize("limit", [500])
def test_no_file_over_the_limit(limit):
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit}
    assert long == {}
