"""A griffe extension for the docs site: dmuon's docstrings cross-reference with Sphinx roles
(``:class:`X```, ``:func:`~a.b```, ``:mod:`m```), which the Google-style parser would read as
``name: description`` pairs and Markdown would print with their colons. Each role becomes the
inline code it names (the tilde form keeps the last dotted part, as Sphinx shows it). A line that
ends in reStructuredText's literal-block marker ``::`` ends in one colon instead (the indented block
after it is already a Markdown code block); a line that is only ``::`` goes."""
from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")
LITERAL_MARKER = re.compile(r"^([^\n]*?)::[ \t]*$", re.MULTILINE)


def _colon(m: re.Match) -> str:
    return f"{m.group(1)}:" if m.group(1).strip() else ""


def _code(m: re.Match) -> str:
    target = m.group(2)
    return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles to inline code and ``::`` markers to colons in every docstring
    before it is parsed."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = LITERAL_MARKER.sub(_colon, ROLE.sub(_code, obj.docstring.value))
