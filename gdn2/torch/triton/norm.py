"""Triton kernels of the layer's normalisations, each a PyTorch custom operator with its fake
(shape-only) and autograd implementations registered (``gdn2::l2_normalize_forward``,
``gdn2::gated_rms_norm_forward`` and their backwards), so that torch.compile traces through them
without a graph break:

* ``l2_normalize(x, head_dim, silu)``: ``y = a / sqrt(sum(a^2) + eps)`` per head of ``head_dim``
  channels, ``a = silu(x)`` or ``x`` (the layer without short convolutions; with them the
  normalisation is fused into ``conv.short_convolution``).
* ``gated_rms_norm(x, gate, weight)``: ``x / sqrt(mean(x^2) + eps) * weight * sigmoid(gate)`` over
  the last dimension (the layer's output norm, fla's ``FusedRMSNormGated``), its result written
  straight in the dtype the output projection reads.

Rows are independent: one program per block of rows, statistics in float32. The backward
recomputes the statistics from the inputs; the weight gradient is summed in registers by a fixed
number of programs, each walking several row blocks, and their partial sums by one ``torch.sum``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LAYER_INSTEAD, refuse_higher_order

WARPS = 1  # measured: layer fwd+bwd on the H200 13.65 -> 12.78 ms against 4 warps (bench/RESULTS.md)
TILE_ELEMENTS = 1024  # rows per block: this many elements per tile (63-138 registers on sm_90a at one warp, no spills)
BACKWARD_PROGRAMS = 1024


@triton.jit
def _l2_forward_kernel(x, y, R, K: tl.constexpr, eps, BR: tl.constexpr, BK: tl.constexpr, SILU: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    ok = (rows < R)[:, None] & (cols < K)[None, :]
    offsets = rows[:, None] * K + cols[None, :]
    a = tl.load(x + offsets, mask=ok, other=0.0).to(tl.float32)
    if SILU:
        a = a * tl.sigmoid(a)
    a = a * tl.rsqrt(tl.sum(a * a, 1) + eps)[:, None]
    tl.store(y + offsets, a.to(y.dtype.element_ty), mask=ok)


@triton.jit
def _l2_backward_kernel(x, dy, dx, R, K: tl.constexpr, eps, BR: tl.constexpr, BK: tl.constexpr, SILU: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    ok = (rows < R)[:, None] & (cols < K)[None, :]
    offsets = rows[:, None] * K + cols[None, :]
    z = tl.load(x + offsets, mask=ok, other=0.0).to(tl.float32)
    d_out = tl.load(dy + offsets, mask=ok, other=0.0).to(tl.float32)
    if SILU:
        sig = tl.sigmoid(z)
        a = z * sig
    else:
        a = z
    inv_norm = tl.rsqrt(tl.sum(a * a, 1) + eps)
    normed = a * inv_norm[:, None]
    grad = inv_norm[:, None] * (d_out - normed * tl.sum(d_out * normed, 1)[:, None])
    if SILU:
        grad = grad * sig * (1.0 + z * (1.0 - sig))
    tl.store(dx + offsets, grad.to(dx.dtype.element_ty), mask=ok)


def _row_block(width: int) -> tuple[int, int]:
    block = triton.next_power_of_2(width)
    return max(1, TILE_ELEMENTS // block), block


# The operators take their inputs with any strides and make them contiguous themselves: autograd
# and the compiler hand back saved inputs with the strides they were given.


@torch.library.custom_op("gdn2::l2_normalize_forward", mutates_args=())
def _l2_forward(x: torch.Tensor, head_dim: int, silu: bool, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    R = x.numel() // head_dim
    BR, BK = _row_block(head_dim)
    _l2_forward_kernel[(triton.cdiv(R, BR),)](x, y, R, head_dim, eps, BR=BR, BK=BK, SILU=silu, num_warps=WARPS)
    return y


@_l2_forward.register_fake
def _l2_forward_shapes(x, head_dim, silu, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("gdn2::l2_normalize_backward", mutates_args=())
def _l2_backward(x: torch.Tensor, dy: torch.Tensor, head_dim: int, silu: bool, eps: float) -> torch.Tensor:
    x = x.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    R = x.numel() // head_dim
    BR, BK = _row_block(head_dim)
    _l2_backward_kernel[(triton.cdiv(R, BR),)](
        x, dy.contiguous(), dx, R, head_dim, eps, BR=BR, BK=BK, SILU=silu, num_warps=WARPS
    )
    return dx


@_l2_backward.register_fake
def _l2_backward_shapes(x, dy, head_dim, silu, eps):
    return x.new_empty(x.shape)


def _l2_setup_context(ctx, inputs, output):
    x, head_dim, silu, eps, _ = inputs
    ctx.save_for_backward(x)
    ctx.head_dim, ctx.silu, ctx.eps = head_dim, silu, eps


def _l2_differentiate(ctx, dy):
    refuse_higher_order("GatedDeltaNet2's fused L2 normalisation kernel", LAYER_INSTEAD)
    (x,) = ctx.saved_tensors
    return _l2_backward(x, dy, ctx.head_dim, ctx.silu, ctx.eps), None, None, None, None


_l2_forward.register_autograd(_l2_differentiate, setup_context=_l2_setup_context)


def l2_normalize(x: torch.Tensor, head_dim: int, *, silu: bool = False, eps: float = 1e-6,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a / sqrt(sum(a^2) + eps)`` over each group of ``head_dim`` consecutive channels of the
    last dimension, ``a = silu(x)`` when ``silu`` else ``x``; result in ``out_dtype`` (default
    x's), same shape as x."""
    if not isinstance(x, torch.Tensor) or x.ndim < 1:
        raise ValueError(f"x: expected a torch.Tensor with at least one dimension, received {type(x).__name__}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1 or x.shape[-1] % head_dim:
        raise ValueError(f"head_dim: expected a divisor of x's last dimension {x.shape[-1]}, received {head_dim!r}")
    return _l2_forward(x, head_dim, bool(silu), float(eps), out_dtype or x.dtype)


@triton.jit
def _gated_rms_forward_kernel(x, gate, weight, y, R, V: tl.constexpr, eps, BR: tl.constexpr, BV: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BV)
    col_ok = cols < V
    ok = (rows < R)[:, None] & col_ok[None, :]
    offsets = rows[:, None] * V + cols[None, :]
    values = tl.load(x + offsets, mask=ok, other=0.0).to(tl.float32)
    scale = tl.load(weight + cols, mask=col_ok, other=0.0).to(tl.float32)
    opening = tl.sigmoid(tl.load(gate + offsets, mask=ok, other=0.0).to(tl.float32))
    inv_rms = tl.rsqrt(tl.sum(values * values, 1) / V + eps)
    out = values * inv_rms[:, None] * scale[None, :] * opening
    tl.store(y + offsets, out.to(y.dtype.element_ty), mask=ok)


@triton.jit
def _gated_rms_backward_kernel(
    x, gate, weight, dy, dx, d_gate, d_weight_parts,  # [R, V] x6 and [P, V] float32
    R, V: tl.constexpr, eps, P, row_blocks, BR: tl.constexpr, BV: tl.constexpr,
):
    i_p = tl.program_id(0)
    cols = tl.arange(0, BV)
    col_ok = cols < V
    scale = tl.load(weight + cols, mask=col_ok, other=0.0).to(tl.float32)
    d_scale = tl.zeros((BV,), dtype=tl.float32)
    for block in range(i_p, row_blocks, P):
        rows = (block * BR + tl.arange(0, BR)).to(tl.int64)
        ok = (rows < R)[:, None] & col_ok[None, :]
        offsets = rows[:, None] * V + cols[None, :]
        values = tl.load(x + offsets, mask=ok, other=0.0).to(tl.float32)
        opening = tl.sigmoid(tl.load(gate + offsets, mask=ok, other=0.0).to(tl.float32))
        d_out = tl.load(dy + offsets, mask=ok, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(values * values, 1) / V + eps)
        normed = values * inv_rms[:, None]
        d_normed_scaled = d_out * opening  # gradient of (normed * scale)
        d_scale += tl.sum(d_normed_scaled * normed, 0)
        tl.store(d_gate + offsets, (d_out * normed * scale[None, :] * opening * (1.0 - opening)).to(d_gate.dtype.element_ty),
                 mask=ok)
        d_normed = d_normed_scaled * scale[None, :]
        grad = inv_rms[:, None] * (d_normed - normed * (tl.sum(d_normed * normed, 1) / V)[:, None])
        tl.store(dx + offsets, grad.to(dx.dtype.element_ty), mask=ok)
    tl.store(d_weight_parts + i_p * V + cols, d_scale, mask=col_ok)


@torch.library.custom_op("gdn2::gated_rms_norm_forward", mutates_args=())
def _gated_rms_forward(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    x, gate, weight = x.contiguous(), gate.contiguous(), weight.contiguous()
    V = weight.shape[0]
    R = x.numel() // V
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    BR, BV = _row_block(V)
    _gated_rms_forward_kernel[(triton.cdiv(R, BR),)](x, gate, weight, y, R, V, eps, BR=BR, BV=BV, num_warps=WARPS)
    return y


@_gated_rms_forward.register_fake
def _gated_rms_forward_shapes(x, gate, weight, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("gdn2::gated_rms_norm_backward", mutates_args=())
def _gated_rms_backward(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float
) -> list[torch.Tensor]:
    """``[dx, d_gate, d_weight]`` in the shapes and dtypes of x, gate and weight, contiguous."""
    x, gate, weight = x.contiguous(), gate.contiguous(), weight.contiguous()
    V = weight.shape[0]
    R = x.numel() // V
    BR, BV = _row_block(V)
    row_blocks = triton.cdiv(R, BR)
    P = max(1, min(row_blocks, BACKWARD_PROGRAMS))
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_weight_parts = torch.empty(P, V, dtype=torch.float32, device=x.device)
    _gated_rms_backward_kernel[(P,)](
        x, gate, weight, dy.contiguous(), dx, d_gate, d_weight_parts, R, V, eps, P, row_blocks,
        BR=BR, BV=BV, num_warps=WARPS,
    )
    return [dx, d_gate, d_weight_parts.sum(0).to(weight.dtype)]


@_gated_rms_backward.register_fake
def _gated_rms_backward_shapes(x, gate, weight, dy, eps):
    return [x.new_empty(x.shape), gate.new_empty(gate.shape), weight.new_empty(weight.shape)]


def _gated_rms_setup_context(ctx, inputs, output):
    x, gate, weight, eps, _ = inputs
    ctx.save_for_backward(x, gate, weight)
    ctx.eps = eps


def _gated_rms_differentiate(ctx, dy):
    refuse_higher_order("GatedDeltaNet2's fused gated RMSNorm kernel", LAYER_INSTEAD)
    x, gate, weight = ctx.saved_tensors
    dx, d_gate, d_weight = _gated_rms_backward(x, gate, weight, dy, ctx.eps)
    return dx, d_gate, d_weight, None, None


_gated_rms_forward.register_autograd(_gated_rms_differentiate, setup_context=_gated_rms_setup_context)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-5,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight * sigmoid(gate)`` over groups of ``V = len(weight)``
    consecutive elements of the last dimension.

    Args: x and gate with the same number of elements, a multiple of V; the result has x's shape,
    in ``out_dtype`` (default x's). Differentiable in x, gate and weight.
    """
    for name, value in (("x", x), ("gate", gate), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, received {type(value).__name__}")
    if weight.ndim != 1:
        raise ValueError(f"weight: expected one dimension [V], received shape {list(weight.shape)}")
    V = weight.shape[0]
    if x.shape[-1] % V or gate.numel() != x.numel():
        raise ValueError(f"gate: expected {x.numel()} elements (x's) in groups of V = {V}, received shape "
                         f"{list(gate.shape)} for x of shape {list(x.shape)}")
    if gate.shape[-1] % V:
        raise ValueError(f"gate: expected a last dimension that is a multiple of V = {V}, received {list(gate.shape)}")
    return _gated_rms_forward(x, gate, weight, float(eps), out_dtype or x.dtype)
