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
       Widen bf16 dot operands first (exact).
    3. ``tl.dot`` of 16-bit operands is computed in fp64 and rounded once to the accumulator's
       dtype. The interpreter's own ``np.matmul`` in fp32 goes through NumPy's BLAS, whose
       summation order for element ``(r, c)`` need not match the one for ``(c, r)``: with
       ``OPENBLAS_CORETYPE=Haswell`` (set on the CI machines) 2 of 131 072 entries of a diagonal
       tile ``a_i a_i^T`` differed by one fp32 ulp, so the triangle kernels' exact-symmetry check
       failed there although the kernel is right. A GPU's MMA forms both entries from the same
       exact products; in fp64 the products of 16-bit values are exact too and a tile's sums (K
       <= 256 terms of 16-bit-mantissa products) are exact for the operands these checks use, so
       the result no longer depends on the BLAS's order: symmetric inputs give symmetric tiles
       on every BLAS kernel, as on the GPU.
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
        """A 16-bit float operand as fp64 (exact); anything else unchanged."""
        if h.dtype == tl.bfloat16:
            return (h.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if h.dtype == tl.float16:
            return h.data.astype(np.float64)
        return None

    def create_dot(self, a, b, d, *args):
        wa, wb = widen(a), widen(b)
        if wa is None or wb is None:
            return orig_dot(self, a, b, d, *args)
        prod = np.matmul(wa, wb).astype(d.data.dtype)  # one rounding, BLAS-order independent
        return interp.TensorHandle(prod + d.data, d.dtype.scalar)

    interp.InterpreterBuilder.create_dot = create_dot
