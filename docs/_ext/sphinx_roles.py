"""A griffe extension for the docs site: dmuon's docstrings cross-reference with Sphinx roles
(``:class:`X```, ``:func:`~a.b```, ``:mod:`m```), which the Google-style parser would read as
``name: description`` pairs and Markdown would print with their colons. Each role becomes the
inline code it names (the tilde form keeps the last dotted part, as Sphinx shows it)."""
from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def _code(m: re.Match) -> str:
    target = m.group(2)
    return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring to inline code before it is parsed."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
