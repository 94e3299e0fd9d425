"""Corrections to Triton's CPU interpreter (``TRITON_INTERPRET=1``), which the tests run the kernels on.

The interpreter keeps bfloat16 tensors as their raw 16-bit patterns (``uint16``), and two of its
bfloat16 operations differ from the GPU's (Triton 3.9):

- its ``tl.dot`` multiplies those patterns as integers (the product of two bfloat16 tiles comes
  out near 1e10). On the GPU the same dot multiplies the bfloat16 values exactly and accumulates
  in float32; widening each bfloat16 operand to float32 before the interpreter's product gives
  exactly that;
- its float32 -> bfloat16 conversion (a cast, or a store into a bfloat16 buffer) truncates the
  mantissa; the GPU rounds to nearest even. Truncation doubles the rounding error (a mean of
  2.8e-3 relative against 1.4e-3 on normal values), so every bfloat16 result the tests measured
  under the interpreter looked up to twice as rounded as the GPU's.

The kernels keep saved buffers in bfloat16 and multiply them as they are, and the layer's kernels
write bfloat16 outputs, so without these corrections the interpreter would test neither as the GPU
runs them.

Its scans with a combination of their own (``tl.associative_scan``, which ``_exclusive_suffix``
uses) call the combination once per element from Python; ``scan_by_slices`` calls it once per
position along the scan axis on whole slices, in the same order (the same results, each
combination elementwise): the test suite took 1,119 s with the element loop and 954 s by slices,
the same day on the same two cores.
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


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even; NaN stays NaN), as uint16 patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    quiet_nan = ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)  # the sign kept, a quiet NaN
    return np.where(np.isnan(values), quiet_nan, rounded)


def correct_bfloat16() -> None:
    """Make the interpreter's ``tl.dot`` multiply bfloat16 operands by value, and its float32 to
    bfloat16 conversions round to nearest even, as the GPU does (idempotent)."""
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    if getattr(InterpreterBuilder.create_dot, "corrected", False):
        return
    create_dot, cast_impl, create_fp_to_fp = (
        InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl, InterpreterBuilder.create_fp_to_fp)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, _widened(a), _widened(b), d, input_precision, max_num_imprecise_acc)

    def rounded(src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(bfloat16_bits(np.asarray(src.data)), tl.bfloat16)
        return None

    def cast(self, src, dst_type):  # every cast but an explicitly rounded one
        result = rounded(src, dst_type)
        return cast_impl(self, src, dst_type) if result is None else result

    def fp_to_fp(self, src, dst_type, rounding_mode):
        result = rounded(src, dst_type) if rounding_mode == ir.ROUNDING_MODE.RTNE else None
        return create_fp_to_fp(self, src, dst_type, rounding_mode) if result is None else result

    dot.corrected = True
    InterpreterBuilder.create_dot = dot
    InterpreterBuilder.cast_impl = cast
    InterpreterBuilder.create_fp_to_fp = fp_to_fp


def correct_interpreter() -> None:
    """Every correction of this module (idempotent): bfloat16 products and rounding as on the GPU,
    and scans by slices."""
    correct_bfloat16()
    scan_by_slices()


def scan_by_slices() -> None:
    """Make the interpreter's scans with a combination of their own combine slices across the scan
    axis instead of single elements (idempotent): the running value after position i is
    ``combine(running value after i - 1, slice i)``, as the element-by-element loop computes it."""
    from triton.runtime.interpreter import ScanOps

    if getattr(ScanOps.generic_scan, "by_slices", False):
        return

    def generic_scan(self, input):
        arrays = [np.asarray(arg.handle.data) for arg in input]
        outputs = [np.empty_like(array) for array in arrays]
        running = None
        for i in range(arrays[0].shape[self.axis]):
            current = tuple(self.to_tensor(np.take(array, [i], axis=self.axis), arg.dtype)
                            for array, arg in zip(arrays, input))
            if running is None:
                running = current
            else:
                combined = self.combine_fn.fn(*running, *current)
                running = combined if isinstance(combined, tuple) else (combined,)
            for output, value in zip(outputs, running):
                index = [slice(None)] * output.ndim
                index[self.axis] = slice(i, i + 1)
                output[tuple(index)] = np.asarray(value.handle.data)
        return [self.to_tensor(output, arg.dtype) for output, arg in zip(outputs, input)]

    generic_scan.by_slices = True
    generic_scan.element_by_element = ScanOps.generic_scan  # the interpreter's own, for the tests
    ScanOps.generic_scan = generic_scan
