"""The dmuon demo: ``python -m dmuon.demo`` (console script ``dmuon-demo``).

Trains a small Llama-shaped model (:mod:`dmuon.demo.model`) on N ranks with dmuon and, for
comparison, with FSDP2 + AdamW, on next-token prediction over a fixed random Markov source whose
entropy rate is the loss floor (:mod:`dmuon.demo.markov`), then writes a loss-curve PNG
(:mod:`dmuon.demo.plot`) and a JSON summary. See ``python -m dmuon.demo --help``.
"""
from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo (same as ``python -m dmuon.demo``); returns the exit code."""
    from dmuon.demo.__main__ import main as _main  # lazy: keeps ``python -m dmuon.demo`` clean
    return _main(argv)
