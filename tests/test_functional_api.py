"""``dmuon.functional.__all__`` is exactly what the docs document as the functional API, both
ways, so the two cannot drift: every name the docs page "The functional core"
(docs/functional/index.md, the README's former section) shows as part of ``dmuon.functional``
(imported from it, a bullet's head name, or spelled ``dmuon.functional.<name>``) and every name any
README or docs block imports from ``dmuon.functional`` is exported and resolves; every exported
name appears on that page."""
from __future__ import annotations

import re
from pathlib import Path

import dmuon.functional as F

ROOT = Path(__file__).resolve().parents[1]
#: the README and every docs page (blocks anywhere may import from dmuon.functional)
README = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
SECTION = (ROOT / "docs" / "functional" / "index.md").read_text()


def _imported(text: str) -> set[str]:
    """Names of ``from dmuon.functional import a, b as c`` lines (``a``, ``b``)."""
    out = set()
    for names in re.findall(r"^\s*from dmuon\.functional import ([\w ,]+)$", text, flags=re.M):
        out |= {part.split(" as ")[0].strip() for part in names.split(",") if part.strip()}
    return out


def documented() -> set[str]:
    """The names the README documents as ``dmuon.functional``'s (module docstring)."""
    names = _imported(README)
    names |= set(re.findall(r"^- `(\w+)", SECTION, flags=re.M))          # bullet heads
    names |= set(re.findall(r"`dmuon\.functional\.([A-Za-z]\w*)", SECTION))  # dmuon.functional.X
    return names


def test_readme_names_are_exported():
    missing = sorted(documented() - set(F.__all__))
    assert not missing, (f"the README documents {missing} as dmuon.functional's; add them to "
                         "dmuon.functional.__all__ (and _EXPORTS)")
    for name in F.__all__:
        assert getattr(F, name) is not None


def test_exported_names_are_documented():
    undocumented = [n for n in F.__all__
                    if not re.search(rf"`(?:dmuon\.functional\.)?{n}\b", SECTION)]
    assert not undocumented, (f"dmuon.functional exports {undocumented}, which the README's "
                              "functional section does not show")


def test_the_parse_sees_the_step_api():
    """The parse is not vacuous: the phases and the step's modules are among the documented."""
    assert {"phases", "step", "owner_step", "packing", "replicated", "order_check",
            "memory_model", "muon", "plan_owners", "step_program"} <= documented()
