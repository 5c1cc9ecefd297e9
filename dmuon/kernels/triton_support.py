"""Triton as an optional dependency: one import for every kernel module.

``triton`` / ``tl`` are the modules, or ``None`` where Triton does not import (CPU-only installs,
some platforms); ``TRITON_IMPORT_ERROR`` says why. Kernel modules define their ``@triton.jit``
functions under ``if triton is not None`` and fall back to torch when :func:`triton_available`
is false.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["triton", "tl", "TRITON_IMPORT_ERROR", "triton_available", "interpreting", "wrote"]

try:  # Triton is optional: CPU machines and some installs lack it.
    import triton
    import triton.language as tl
    TRITON_IMPORT_ERROR: Optional[BaseException] = None
except Exception as e:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    # without its traceback: the traceback's frames (and their callers', through f_back) would
    # keep whatever the importing code held alive for the life of the process (a first model)
    TRITON_IMPORT_ERROR = e.with_traceback(None)
    TRITON_IMPORT_ERROR.__context__ = TRITON_IMPORT_ERROR.__cause__ = None


def triton_available() -> bool:
    """True when Triton imports and a CUDA device is present (the Triton path can run)."""
    return triton is not None and torch.cuda.is_available()


def interpreting() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``; CI runs the kernels so)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def wrote(*tensors: Optional[torch.Tensor]) -> None:
    """Tell autograd's version counters that a Triton kernel wrote ``tensors`` in place (it writes
    through raw pointers, so nothing else does; torch's own in-place ops bump them): a step that
    failed part-way is then seen as changed (``Muon.step``'s retry check), as with foreach."""
    for t in tensors:
        if t is not None and not t.is_inference():
            torch.autograd.graph.increment_version(t)
