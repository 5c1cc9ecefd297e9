"""Packaging as users install it (issue 48): ``python -m build`` makes a wheel and an sdist; the wheel
holds every subpackage of :mod:`dmuon` and its ``py.typed`` marker, installs, and runs the console
scripts and the demo outside the source tree; the sdist holds what builds the wheel and runs the
tests (they read ``examples/``, ``benchmarks/``, ``docs/``, ``.ci/`` and the README). The version
is written once, in ``dmuon/__init__.py``; ``pyproject.toml`` reads it from there and
``CHANGELOG.md``'s newest entry names it.

The default tier reads the packaging settings only (no build, well under a second); the slow tier
builds both archives, checks their contents and installs the wheel (``.ci/run`` does the same
before the default tier, in its bare venv).
"""
from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")

import dmuon  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dmuon"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
#: a final release of PEP 440 (N.N.N), the only kind this project tags
RELEASE = re.compile(r"\d+\.\d+\.\d+")


def _source_version() -> str:
    """``__version__`` as written in ``dmuon/__init__.py`` (read as setuptools reads it: the AST)."""
    tree = ast.parse((PKG / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("dmuon/__init__.py assigns no literal __version__")


def _changelog_versions() -> list[str]:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return re.findall(r"^## (\S+)", text, flags=re.MULTILINE)


def _package_dirs() -> list[Path]:
    """Every folder of the package that holds Python files (what the wheel must carry)."""
    return sorted({p.parent for p in PKG.rglob("*.py") if "__pycache__" not in p.parts})


# ------------------------------------------------------------------------- default tier: settings
def test_the_version_is_written_once_and_the_changelog_names_it():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project.get("dynamic", []), (
        "pyproject.toml must read the version from dmuon/__init__.py (dynamic), not repeat it")
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dmuon.__version__"}
    assert dmuon.__version__ == _source_version()
    assert RELEASE.fullmatch(dmuon.__version__) and dmuon.__version__.startswith("0."), (
        f"{dmuon.__version__!r}: a 0.x release N.N.N")
    versions = _changelog_versions()
    assert versions and versions[0] == dmuon.__version__, (
        f"CHANGELOG.md's newest entry is {versions[:1]}, the package says {dmuon.__version__}: "
        "add an entry for the new version at the top")
    assert len(set(versions)) == len(versions), f"CHANGELOG.md repeats a version: {versions}"


def test_installed_metadata_says_the_same_version():
    """Where the ``dmuon`` distribution that pip installed is this tree (``pip install -e .`` of
    this checkout, or a wheel whose files are the ones imported), its metadata's version is
    ``dmuon.__version__``."""
    try:
        dist = importlib.metadata.distribution("dmuon")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("dmuon is imported from the source tree, not installed")
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    editable_here = (direct.get("dir_info", {}).get("editable")
                     and direct.get("url", "").removeprefix("file://").rstrip("/") == str(ROOT))
    files_here = Path(dist.locate_file("dmuon/__init__.py")).resolve() == Path(dmuon.__file__).resolve()
    if not (editable_here or files_here):
        pytest.skip(f"the installed dmuon ({direct.get('url') or dist.locate_file('')}) is not "
                    f"this tree ({ROOT})")
    assert dist.version == dmuon.__version__, (
        f"the installed metadata ({dist.locate_file('')}) says {dist.version}, dmuon.__version__ "
        f"{dmuon.__version__}: reinstall (pip install -e .) after changing the version, or delete "
        "a stale dmuon.egg-info left by an older build")


def test_the_license_pyproject_names_is_in_the_tree():
    """pyproject.toml says Apache-2.0; the text itself must ship (wheel and sdist: setuptools
    takes ``LICENSE`` by default; the slow build test checks both archives)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_py_typed_ships_as_package_data():
    assert (PKG / "py.typed").is_file(), "dmuon/py.typed (PEP 561) is missing"
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["dmuon"]


def test_every_folder_of_the_package_is_a_package():
    """The wheel takes what ``[tool.setuptools.packages.find]`` finds: folders with an
    ``__init__.py``; a folder of modules without one would be left out of the wheel silently."""
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["dmuon*"]
    missing = [str(d.relative_to(ROOT)) for d in _package_dirs() if not (d / "__init__.py").is_file()]
    assert not missing, f"folders without __init__.py (not in the wheel): {missing}"


def test_the_sdist_takes_what_the_tests_read():
    lines = (ROOT / "MANIFEST.in").read_text(encoding="utf-8").splitlines()
    for folder in ("tests", "examples", "benchmarks", "docs", ".ci"):
        assert f"graft {folder}" in lines, f"MANIFEST.in: no 'graft {folder}'"
    assert any(ln.startswith("include ") and "CHANGELOG.md" in ln.split() for ln in lines)


# --------------------------------------------------------------------------- slow tier: the build
def _tracked_files() -> list[str] | None:
    """The files git tracks in this checkout (None outside a git checkout, e.g. an unpacked sdist)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [f for f in out.stdout.decode().split("\0") if f and (ROOT / f).is_file()]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_build_makes_a_wheel_and_an_sdist_that_install_and_run(tmp_path):
    pytest.importorskip("build", reason="python -m build: the test extra installs it")
    dist = tmp_path / "dist"
    # --no-isolation: the build-system requirement (setuptools) of this interpreter, as .ci/run
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)])
    version = dmuon.__version__
    wheel, sdist = dist / f"dmuon-{version}-py3-none-any.whl", dist / f"dmuon-{version}.tar.gz"
    assert sorted(p.name for p in dist.iterdir()) == sorted([wheel.name, sdist.name])

    # the wheel: every module of every subpackage, py.typed, the version, the console scripts
    names = set(zipfile.ZipFile(wheel).namelist())
    info = f"dmuon-{version}.dist-info/"
    modules = {p.relative_to(ROOT).as_posix() for p in PKG.rglob("*.py") if "__pycache__" not in p.parts}
    assert not modules - names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert {f"{d.relative_to(ROOT).as_posix()}/__init__.py" for d in _package_dirs()} <= names
    assert "dmuon/py.typed" in names
    assert any(n.startswith(info) and n.endswith("/LICENSE") for n in names), \
        f"the license text is missing from the wheel's {info}"
    assert all(n.startswith(("dmuon/", info)) for n in names), sorted(
        n for n in names if not n.startswith(("dmuon/", info)))
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(info + "METADATA").decode()
        scripts = z.read(info + "entry_points.txt").decode()
    assert f"\nVersion: {version}\n" in meta
    assert "dmuon = dmuon.__main__:main" in scripts and "dmuon-demo = dmuon.demo.__main__:main" in scripts

    # the sdist: everything the repository tracks (the tests read examples/, benchmarks/, docs/,
    # .ci/ and the README), no bytecode
    top = f"dmuon-{version}/"
    with tarfile.open(sdist) as t:
        members = {m.name.removeprefix(top) for m in t.getmembers() if m.isfile()}
        t.extractall(tmp_path / "sdist", filter="data")
    for need in ("pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "MANIFEST.in", "PKG-INFO",
                 "dmuon/py.typed", "tests/conftest.py", "tests/dist_utils.py"):
        assert need in members, f"{need} missing from the sdist"
    tracked = _tracked_files()
    if tracked is not None:
        missing = sorted(set(tracked) - members - {".gitignore"})
        assert not missing, f"tracked files missing from the sdist: {missing[:20]}"
    assert not [m for m in members if m.endswith((".pyc", ".pyo")) or "__pycache__" in m]

    # the wheel installed as a user installs it (this interpreter has its dependencies), used
    # outside the source tree: it imports from the install, and its console scripts run
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)])
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = _run([sys.executable, "-c", "import dmuon, importlib.metadata as m; "
                "print(dmuon.__file__); print(dmuon.__version__, m.version('dmuon'))"],
               cwd=tmp_path, env=env).stdout.split("\n")
    assert Path(out[0]).resolve().is_relative_to(site.resolve()), out[0]
    assert out[1] == f"{version} {version}"
    for script in ("dmuon", "dmuon-demo"):
        assert "usage" in _run([str(site / "bin" / script), "--help"], cwd=tmp_path, env=env).stdout
    _run([str(site / "bin" / "dmuon-demo"), "--fast", "--no-progress", "--out-dir", "demo"],
         cwd=tmp_path, env=env)
    assert json.loads((tmp_path / "demo" / "summary.json").read_text())["dmuon_version"] == version

    # the sdist runs the tests: this file's default-tier checks, from the unpacked sdist
    unpacked = tmp_path / "sdist" / top
    _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_packaging.py"],
         cwd=unpacked, env={**os.environ, "PYTHONPATH": str(unpacked)})
