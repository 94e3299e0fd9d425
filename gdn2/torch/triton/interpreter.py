"""A correction to Triton's CPU interpreter (``TRITON_INTERPRET=1``), which the tests run the kernels on.

The interpreter keeps bfloat16 tensors as their raw 16-bit patterns (``uint16``) and its ``tl.dot``
multiplies those patterns as integers (Triton 3.9: the product of two bfloat16 tiles comes out
near 1e10). On the GPU the same dot multiplies the bfloat16 values exactly and accumulates in
float32; widening each bfloat16 operand to float32 before the interpreter's product gives exactly
that. The kernels keep some saved buffers in bfloat16 and multiply them as they are, so without
this the interpreter would test nothing of those products.
"""

from __future__ import annotations

import numpy as np


def _widened(handle):
    """A bfloat16 tensor handle as float32 (exact: bfloat16 is the top half of a float32)."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if handle.dtype.scalar != tl.bfloat16:
        return handle
    bits = np.asarray(handle.data).astype(np.uint32) << np.uint32(16)
    return TensorHandle(bits.view(np.float32), tl.float32)


def correct_bfloat16_dot() -> None:
    """Make the interpreter's ``tl.dot`` multiply bfloat16 operands by value (idempotent)."""
    from triton.runtime.interpreter import InterpreterBuilder

    original = InterpreterBuilder.create_dot
    if getattr(original, "widens_bfloat16", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, _widened(a), _widened(b), d, input_precision, max_num_imprecise_acc)

    create_dot.widens_bfloat16 = True
    InterpreterBuilder.create_dot = create_dot
