"""The ``gdn2.xp`` shim for PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..xp import Ops


class TorchOps(Ops):
    float32, float64 = torch.float32, torch.float64

    def astype(self, x, dtype):
        return x.to(dtype)

    def exp(self, x):
        return torch.exp(x)

    def cumsum(self, x, axis, reverse=False):
        if reverse:
            return torch.flip(torch.cumsum(torch.flip(x, (axis,)), axis), (axis,))
        return torch.cumsum(x, axis)

    def transpose(self, x, axes):
        return x.permute(*axes).contiguous()

    def where(self, condition, x, y):
        return torch.where(condition, x, y)

    def isfinite(self, x):
        return torch.isfinite(x)

    def any(self, x, axis, keepdims=False):
        return torch.any(x, dim=axis, keepdim=keepdims)

    def stack(self, xs, axis):
        return torch.stack(xs, axis)

    def concat(self, xs, axis):
        return torch.cat(xs, axis)

    def zeros(self, shape, like):
        return torch.zeros(shape, dtype=like.dtype, device=like.device)

    def take(self, x, index, axis):
        return torch.index_select(x, axis, torch.as_tensor(index, device=x.device))

    def pad_time(self, x, extra):
        return F.pad(x, (0, 0, 0, 0, 0, extra))

    def tril(self, n, strict, like):
        return torch.ones(n, n, dtype=like.dtype, device=like.device).tril(-1 if strict else 0)

    def unit_lower_inverse(self, A):
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        return torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)


torch_ops = TorchOps()
