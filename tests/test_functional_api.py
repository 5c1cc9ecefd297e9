"""``dmuon.functional.__all__`` is exactly the documented functional API (issue 48): the names of
the reference page ``docs/reference/functional.md`` (one ``::: path`` directive per exported name,
generated from that object's docstring), both ways, and every directive's path is the object the
package exports under that name. Every name the README or a docs page imports from
``dmuon.functional`` (or spells ``dmuon.functional.<name>``) is exported and resolves."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import dmuon.functional as F

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "functional.md"


def directives(text: str) -> dict[str, str]:
    """``{exported name: path}`` of the page's ``::: path`` lines (the name: the path's last
    component)."""
    paths = re.findall(r"^:::\s+([\w.]+)\s*$", text, flags=re.M)
    out: dict[str, str] = {}
    for path in paths:
        name = path.rsplit(".", 1)[-1]
        assert name not in out, f"{PAGE.name} documents {name!r} twice ({out[name]}, {path})"
        out[name] = path
    return out


def resolve(path: str):
    """The object at dotted ``path``: a module, or an attribute of the longest module prefix."""
    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for attr in parts[k:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def test_the_page_documents_exactly_all():
    documented = directives(PAGE.read_text())
    assert len(documented) > 20, "the parse found too few directives"
    missing = sorted(set(F.__all__) - set(documented))
    extra = sorted(set(documented) - set(F.__all__))
    assert not missing, (f"dmuon.functional exports {missing}, which {PAGE.name} does not "
                         "document: add a '::: <defining module>.<name>' line")
    assert not extra, (f"{PAGE.name} documents {extra}, which dmuon.functional.__all__ does not "
                       "export: add them to __all__ and _EXPORTS, or drop them from the page")


def test_every_exported_name_resolves_to_what_the_page_documents():
    for name, path in directives(PAGE.read_text()).items():
        assert getattr(F, name) is resolve(path), (name, path)
    for name in F.__all__:
        assert getattr(F, name) is not None


def test_a_submodule_import_does_not_rebind_an_exported_name():
    """``simulate`` is the function, though ``dmuon.functional.simulate`` is also a module: the
    import system's binding of the submodule (a ``setattr`` on the package, made by whichever
    import loads it first) leaves the export alone. Before: ``from dmuon.functional import
    simulate`` gave the module after ``import dmuon.functional.step``, the function otherwise."""
    import types

    fn = F.simulate
    assert callable(fn) and not isinstance(fn, types.ModuleType)
    setattr(F, "simulate", importlib.import_module("dmuon.functional.simulate"))
    try:
        assert F.simulate is fn
    finally:
        F.__dict__["simulate"] = fn


def _imported(text: str) -> set[str]:
    """Names of ``from dmuon.functional import a, b as c`` lines (``a``, ``b``), and of
    ``dmuon.functional.<name>`` spellings whose name is not a submodule path."""
    out = set()
    for names in re.findall(r"^\s*from dmuon\.functional import \(?([\w ,]+)\)?$", text,
                            flags=re.M):
        out |= {part.split(" as ")[0].strip() for part in names.split(",") if part.strip()}
    return out


def test_names_the_readme_and_docs_import_are_exported():
    texts = {"README.md": (ROOT / "README.md").read_text()}
    texts.update({str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "docs").rglob("*.md")})
    for where, text in texts.items():
        missing = sorted(_imported(text) - set(F.__all__))
        assert not missing, (f"{where} imports {missing} from dmuon.functional, which "
                             "dmuon.functional.__all__ does not export")


def test_the_step_api_is_on_the_page():
    """The parse is not vacuous: the phases and the step's modules are among the documented."""
    assert {"phases", "step", "owner_step", "packing", "replicated", "order_check",
            "memory_model", "muon", "plan_owners", "step_program"} <= set(
                directives(PAGE.read_text()))
