"""Triton's CPU interpreter made usable for checking dmuon's kernels without a GPU.

With ``TRITON_INTERPRET=1`` set before Triton is imported, ``@triton.jit`` kernels run on CPU
tensors through NumPy. Triton 3.6's interpreter needs two shims for that here (numpy >= 2.4 and
bf16 dots, see :func:`install_interpreter_shims`). Used by ``benchmarks/syrk_bench.py
--interpret-check`` and ``tests/interp_kernels_check.py`` (CI runs the latter in a subprocess).
Development support only: nothing in the library's GPU or CPU paths imports this module.
"""
from __future__ import annotations

__all__ = ["install_interpreter_shims"]


def install_interpreter_shims() -> None:
    """Make Triton 3.6's interpreter usable here (CPU check only; no effect on compiled kernels).

    1. With numpy >= 2.4, ``int()`` of a 1-element array raises; the interpreter keeps scalars as
       1-element arrays, so ``range()`` over a program id fails. Index via the element instead.
    2. The interpreter feeds bf16 (stored as uint16) straight to ``np.matmul``: integer products.
       Widen bf16 dot operands to fp32 first (exact).
    """
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    orig_patch = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch_lang_tensor
    orig_dot = interp.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, *args):
        return orig_dot(self, widen(a), widen(b), d, *args)

    interp.InterpreterBuilder.create_dot = create_dot
