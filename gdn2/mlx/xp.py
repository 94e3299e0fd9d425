"""The ``gdn2.xp`` shim for MLX."""

from __future__ import annotations

import math

import mlx.core as mx

from ..xp import Ops


class MlxOps(Ops):
    float32, float64 = mx.float32, mx.float64  # float64 runs on MLX's CPU stream

    def exp(self, x):
        if x.dtype == mx.float64:
            # MLX's float64 exp is only float32-accurate (relative error ~2e-6, MLX 0.32); pow is exact.
            return mx.power(mx.array(math.e, dtype=mx.float64), x)
        return mx.exp(x)

    def cumsum(self, x, axis, reverse=False):
        return mx.cumsum(x, axis=axis, reverse=reverse)

    def transpose(self, x, axes):
        return mx.transpose(x, axes)

    def where(self, condition, x, y):
        return mx.where(condition, x, y)

    def isfinite(self, x):
        return mx.isfinite(x)

    def any(self, x, axis, keepdims=False):
        return mx.any(x, axis=axis, keepdims=keepdims)

    def stack(self, xs, axis):
        return mx.stack(xs, axis=axis)

    def concat(self, xs, axis):
        return mx.concatenate(xs, axis=axis)

    def zeros(self, shape, like):
        return mx.zeros(shape, dtype=like.dtype)

    def take(self, x, index, axis):
        return mx.take(x, mx.array(index), axis=axis)

    def pad_time(self, x, extra):
        return mx.pad(x, [(0, 0), (0, extra), (0, 0), (0, 0)])

    def tril(self, n, strict, like):
        return mx.tril(mx.ones((n, n), dtype=like.dtype), k=-1 if strict else 0)

    def unit_lower_inverse(self, A):
        if mx.default_device() == mx.cpu:
            # MLX's triangular solve runs on the CPU stream only; on the GPU the shim's forward
            # substitution (plain matmuls) is used instead.
            eye = mx.eye(A.shape[-1], dtype=A.dtype)
            return mx.linalg.solve_triangular(eye + A, mx.broadcast_to(eye, A.shape), upper=False, stream=mx.cpu)
        return super().unit_lower_inverse(A)


mlx_ops = MlxOps()
