"""dmuon's Triton kernels, checked on CPU in Triton's interpreter (``tests/interp_kernels_check.py``).

The GPU tests (``tests/test_ns_gpu.py``) cover the same kernels compiled on a GPU; CI has none, so
this runs their index, mask, mirror and epilogue logic through the interpreter: the pointer and
TMA triangle kernels (exact symmetry, bf16 tolerance vs fp64) and the scale-and-cast kernel.
Skipped where Triton is not installed or is outside the lines the interpreter shims are checked on
(3.6: torch 2.11 / 2.13 CPU; 3.9: torch 2.13 CPU and 2.15, the triton a CUDA torch 2.15 pins).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


_LINE = tuple(int(x) for x in triton.__version__.split(".")[:2])


@pytest.mark.skipif(not (3, 6) <= _LINE <= (3, 9),
                    reason=f"interpreter shims checked on Triton 3.6 - 3.9, found {triton.__version__}")
def test_kernels_in_triton_interpreter():
    script = Path(__file__).with_name("interp_kernels_check.py")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 failed" in proc.stdout
