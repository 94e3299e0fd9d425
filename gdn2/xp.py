"""A small array-namespace shim, so the chunked algorithm is written once for numpy, torch and MLX.

The algorithm in ``gdn2/algorithm.py`` uses only ``@``, broadcasting arithmetic, slicing, ``.reshape``
and the methods below. Each framework supplies one subclass (``gdn2/torch/xp.py``,
``gdn2/mlx/xp.py``); this module holds the numpy one, which the tests run in float64.
"""

from __future__ import annotations

import numpy as np


class Ops:
    """What the chunked algorithm needs beyond ``@`` and arithmetic. Subclasses fill in the rest."""

    float32 = float64 = None  # the framework's dtype objects

    def compute_dtype(self, x):
        """The dtype the algorithm runs in for inputs like ``x``: float64 stays float64, float32,
        bfloat16 and float16 are computed in float32."""
        return self.float64 if x.dtype == self.float64 else self.float32

    def astype(self, x, dtype):
        return x.astype(dtype)

    def exp(self, x):
        raise NotImplementedError

    def cumsum(self, x, axis: int, reverse: bool = False):
        raise NotImplementedError

    def sum(self, x, axis: int, keepdims: bool = False):
        return x.sum(axis=axis, keepdims=keepdims)

    def transpose(self, x, axes):
        raise NotImplementedError

    def where(self, condition, x, y):
        """``x`` where the boolean ``condition`` holds, else ``y`` (arrays or Python scalars,
        broadcast). Masks are applied this way, never by multiplication: ``-inf * 0`` and
        ``NaN * 0`` are NaN."""
        raise NotImplementedError

    def isfinite(self, x):
        raise NotImplementedError

    def any(self, x, axis: int, keepdims: bool = False):
        return x.any(axis=axis, keepdims=keepdims)

    def stack(self, xs, axis: int):
        raise NotImplementedError

    def zeros(self, shape, like):
        raise NotImplementedError

    def pad_time(self, x, extra: int):
        """Append ``extra`` zero steps along axis 1 of ``[B, T, H, D]``."""
        raise NotImplementedError

    def tril(self, n: int, strict: bool, like):
        """``[n, n]`` lower-triangular 0/1 mask in the dtype of ``like``."""
        raise NotImplementedError

    def unit_lower_inverse(self, A):
        """``(I + A)^{-1}`` for strictly lower-triangular ``A`` of shape ``[..., C, C]``.

        Forward substitution, one row at a time: row ``i`` of the inverse is ``e_i - A[i, :i] X[:i]``.
        Framework subclasses may replace it with a native triangular solve.
        """
        C = A.shape[-1]
        eye = self.eye(C, A)
        rows = [eye[0:1] + 0 * A[..., 0:1, :]]
        for i in range(1, C):
            previous = self.concat(rows, axis=-2)  # [..., i, C]
            rows.append(eye[i : i + 1] - A[..., i : i + 1, :i] @ previous)
        return self.concat(rows, axis=-2)

    def lower(self, n: int, strict: bool, like):
        """``[n, n]`` lower-triangular boolean mask (for ``where``)."""
        return self.tril(n, strict, like) > 0

    def eye(self, n: int, like):
        return self.tril(n, False, like) - self.tril(n, True, like)

    def concat(self, xs, axis: int):
        raise NotImplementedError

    def take(self, x, index, axis: int):
        """``x`` indexed along ``axis`` by the integer numpy array ``index``."""
        raise NotImplementedError


class NumpyOps(Ops):
    float32, float64 = np.dtype(np.float32), np.dtype(np.float64)

    def exp(self, x):
        return np.exp(x)

    def cumsum(self, x, axis, reverse=False):
        if reverse:
            return np.flip(np.cumsum(np.flip(x, axis), axis), axis)
        return np.cumsum(x, axis)

    def transpose(self, x, axes):
        return np.transpose(x, axes)

    def where(self, condition, x, y):
        return np.where(condition, x, y)

    def isfinite(self, x):
        return np.isfinite(x)

    def stack(self, xs, axis):
        return np.stack(xs, axis)

    def concat(self, xs, axis):
        return np.concatenate(xs, axis)

    def zeros(self, shape, like):
        return np.zeros(shape, dtype=like.dtype)

    def take(self, x, index, axis):
        return np.take(x, index, axis)

    def pad_time(self, x, extra):
        return np.pad(x, [(0, 0), (0, extra), (0, 0), (0, 0)])

    def tril(self, n, strict, like):
        return np.tril(np.ones((n, n), dtype=like.dtype), -1 if strict else 0)

    def unit_lower_inverse(self, A):
        eye = np.eye(A.shape[-1], dtype=A.dtype)
        return np.linalg.solve(eye + A, np.broadcast_to(eye, A.shape))


numpy_ops = NumpyOps()
