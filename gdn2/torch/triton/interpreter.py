"""Corrections to Triton's CPU interpreter (``TRITON_INTERPRET=1``), which the tests run the kernels on.

The interpreter keeps bfloat16 tensors as their raw 16-bit patterns (``uint16``), and three kinds
of its bfloat16 operations differ from the GPU's (Triton 3.9):

- its ``tl.dot`` multiplies those patterns as integers (the product of two bfloat16 tiles comes
  out near 1e10). On the GPU the same dot multiplies the bfloat16 values exactly and accumulates
  in float32; widening each bfloat16 operand to float32 before the interpreter's product gives
  exactly that;
- its float32 -> bfloat16 conversion (a cast, or a store into a bfloat16 buffer) truncates the
  mantissa; the GPU rounds to nearest even. Truncation doubles the rounding error (a mean of
  2.8e-3 relative against 1.4e-3 on normal values), so every bfloat16 result the tests measured
  under the interpreter looked up to twice as rounded as the GPU's;
- its elementwise arithmetic and comparisons on bfloat16 operands (``a * b``, ``a < b``), and its
  sums and cumulative sums of bfloat16 tensors, work on the patterns as integers: 1.5 * 2 came
  out 0, -1 < -2 true. The GPU computes on the values and rounds a bfloat16 result to nearest
  even; widening the operands to float32 and rounding the result gives that for one operation
  (a sum or scan is rounded once here, at each combination on the GPU).

The kernels keep saved buffers in bfloat16 and multiply them as they are, and the layer's kernels
write bfloat16 outputs, so without these corrections the interpreter would test neither as the GPU
runs them. gdn2's kernels widen bfloat16 values before any elementwise work; other kernels run under
the interpreter beside them (flash-linear-attention's, for a comparison on the CPU) do not.

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
    """Make the interpreter's ``tl.dot`` multiply bfloat16 operands by value, its float32 to
    bfloat16 conversions round to nearest even, and its elementwise operations on bfloat16 work on
    the values, as the GPU does (idempotent)."""
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import InterpreterBuilder, ReduceOps, ScanOps, TensorHandle

    if getattr(InterpreterBuilder.create_dot, "corrected", False):
        return
    create_dot, cast_impl, create_fp_to_fp = (
        InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl, InterpreterBuilder.create_fp_to_fp)
    binary_op, unary_op, create_fma = (
        InterpreterBuilder.binary_op, InterpreterBuilder.unary_op, InterpreterBuilder.create_fma)

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

    def by_value(result):
        """A result on widened operands rounded back to bfloat16 (if float32)."""
        back = rounded(result, tl.bfloat16)
        return result if back is None else back

    def is_bfloat16(*handles):
        return any(h.dtype.scalar == tl.bfloat16 for h in handles)

    def binary(self, lhs, rhs, op):
        if not is_bfloat16(lhs, rhs):
            return binary_op(self, lhs, rhs, op)
        if op(np.float32(1), np.float32(2)).dtype == np.bool_:  # a comparison
            return binary_op(self, _widened(lhs), _widened(rhs), op)
        return by_value(binary_op(self, _widened(lhs), _widened(rhs), op))

    def unary(self, arg, op):
        if not is_bfloat16(arg):
            return unary_op(self, arg, op)
        return by_value(unary_op(self, _widened(arg), op))

    def fma(self, x, y, z):
        if not is_bfloat16(x, y, z):
            return create_fma(self, x, y, z)
        return by_value(create_fma(self, _widened(x), _widened(y), _widened(z)))

    def with_element(tensor, handle, dtype):
        return tl.core.tensor(handle, tensor.type.with_element_ty(dtype) if tensor.type.is_block() else dtype)

    def over_values(apply_impl):
        """A reduction's or scan's ``apply_impl`` on the values of bfloat16 inputs (widened to
        float32), their results rounded back to bfloat16 once: the GPU rounds each combination,
        so a long bfloat16 sum can differ from it in the last bits."""
        def apply(self, input):
            bfloat16 = [arg.dtype.scalar == tl.bfloat16 for arg in input]
            if not any(bfloat16):
                return apply_impl(self, input)
            widened = tuple(with_element(a, _widened(a.handle), tl.float32) if b else a for a, b in zip(input, bfloat16))
            result = apply_impl(self, widened)
            single = not isinstance(result, (list, tuple))
            result = [result] if single else list(result)
            for i, r in enumerate(result):  # results by the position of their input (an arg-reduction's index after)
                if i < len(bfloat16) and bfloat16[i] and r.dtype.scalar == tl.float32:
                    result[i] = with_element(r, by_value(r.handle), tl.bfloat16)
            return result[0] if single else result
        return apply

    dot.corrected = True
    ReduceOps.apply_impl = over_values(ReduceOps.apply_impl)
    ScanOps.apply_impl = over_values(ScanOps.apply_impl)
    InterpreterBuilder.create_dot = dot
    InterpreterBuilder.cast_impl = cast
    InterpreterBuilder.create_fp_to_fp = fp_to_fp
    InterpreterBuilder.binary_op = binary
    InterpreterBuilder.unary_op = unary
    InterpreterBuilder.create_fma = fma


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
