"""Triton kernels of the layer's gates, each a PyTorch custom operator (the decay's result float32:
the operator's cumulative sums of ``g`` need it; the sigmoid's in a dtype of the caller's) and its fake (shape-only) and autograd
implementations registered (``gdn2::decay_gate_forward``, ``gdn2::sigmoid_gate_forward`` and
their backwards), so that torch.compile traces through them without a graph break:

* ``decay_gate(f, A_log, dt_bias)``: ``g = -exp(A_log[h]) * softplus(f + dt_bias)`` per channel
  of ``[..., H * K]`` (head ``h`` = channel // K); softplus as ``torch.nn.functional.softplus``
  (the identity above 20).
* ``sigmoid_gate(x, scale, out_dtype)``: ``scale * sigmoid(x)`` (the erase gate, ``scale`` 2 with negative
  eigenvalues allowed, and the write gate).

The decay's backward sums the gradients of ``A_log`` and ``dt_bias`` over the rows in registers
(a fixed number of programs, each walking several row blocks) and adds the programs' partial sums
with one ``torch.sum``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LAYER_INSTEAD, refuse_higher_order

# Tiles of 1024 elements at one warp: 64-144 registers on sm_90a (Triton 3.6), no spills.
WARPS = 1  # measured: layer fwd+bwd on the H200 13.65 -> 13.23 ms against 4 warps (bench/RESULTS.md)
ROW_BLOCK = 8
CHANNEL_BLOCK = 128
ELEMENT_BLOCK = 1024  # elements per tile of the sigmoid
BACKWARD_PROGRAMS = 1024


@triton.jit
def _softplus(x):
    """``log(1 + e^x)``, accurate for very negative x (``log1p`` by Goldberg's correction)."""
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    exact = w == 1.0  # u below half an ulp of 1: log1p(u) = u
    log1p = tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _decay_forward_kernel(f, A_log, dt_bias, g, R, D, K, BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    col_ok = cols < D
    ok = (rows < R)[:, None] & col_ok[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    rate = tl.exp(tl.load(A_log + cols // K, mask=col_ok, other=0.0).to(tl.float32))
    shift = tl.load(dt_bias + cols, mask=col_ok, other=0.0).to(tl.float32)
    x = tl.load(f + offsets, mask=ok, other=0.0).to(tl.float32) + shift[None, :]
    tl.store(g + offsets, -rate[None, :] * _softplus(x), mask=ok)


@triton.jit
def _decay_backward_kernel(
    f, A_log, dt_bias, dg, df, d_shift_parts, d_rate_parts,  # [R, D] x4 and [P, D] float32 x2
    R, D, K, P, row_blocks, BR: tl.constexpr, BD: tl.constexpr,
):
    i_p = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    col_ok = cols < D
    rate = tl.exp(tl.load(A_log + cols // K, mask=col_ok, other=0.0).to(tl.float32))
    shift = tl.load(dt_bias + cols, mask=col_ok, other=0.0).to(tl.float32)
    d_shift = tl.zeros((BD,), dtype=tl.float32)
    d_rate = tl.zeros((BD,), dtype=tl.float32)  # sum of dg * g: the gradient of A_log, per channel
    for block in range(i_p, row_blocks, P):
        rows = (block * BR + tl.arange(0, BR)).to(tl.int64)
        ok = (rows < R)[:, None] & col_ok[None, :]
        offsets = rows[:, None] * D + cols[None, :]
        x = tl.load(f + offsets, mask=ok, other=0.0).to(tl.float32) + shift[None, :]
        d_g = tl.load(dg + offsets, mask=ok, other=0.0).to(tl.float32)
        slope = tl.where(x > 20.0, 1.0, tl.sigmoid(x))  # softplus'
        d_x = -rate[None, :] * slope * d_g
        tl.store(df + offsets, d_x.to(df.dtype.element_ty), mask=ok)
        d_shift += tl.sum(d_x, 0)
        d_rate += tl.sum(tl.where(ok, d_g * (-rate[None, :] * _softplus(x)), 0.0), 0)
    tl.store(d_shift_parts + i_p * D + cols, d_shift, mask=col_ok)
    tl.store(d_rate_parts + i_p * D + cols, d_rate, mask=col_ok)


# The operators take their inputs with any strides and make them fit the kernels themselves:
# autograd and the compiler hand back saved inputs with the strides they were given.


@torch.library.custom_op("gdn2::decay_gate_forward", mutates_args=())
def _decay_forward(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    f, A_log, dt_bias = f.contiguous(), A_log.contiguous(), dt_bias.contiguous()
    D = f.shape[-1]
    R, K = f.numel() // D, D // A_log.shape[0]
    g = torch.empty(f.shape, dtype=torch.float32, device=f.device)
    BD = min(CHANNEL_BLOCK, triton.next_power_of_2(D))
    _decay_forward_kernel[(triton.cdiv(R, ROW_BLOCK), triton.cdiv(D, BD))](
        f, A_log, dt_bias, g, R, D, K, BR=ROW_BLOCK, BD=BD, num_warps=WARPS
    )
    return g


@_decay_forward.register_fake
def _decay_forward_shapes(f, A_log, dt_bias):
    return f.new_empty(f.shape, dtype=torch.float32)


@torch.library.custom_op("gdn2::decay_gate_backward", mutates_args=())
def _decay_backward(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, dg: torch.Tensor) -> list[torch.Tensor]:
    """``[df, d_A_log, d_dt_bias]`` in the shapes and dtypes of f, A_log and dt_bias, contiguous."""
    f, A_log, dt_bias = f.contiguous(), A_log.contiguous(), dt_bias.contiguous()
    D = f.shape[-1]
    H = A_log.shape[0]
    R, K = f.numel() // D, D // H
    BD = min(CHANNEL_BLOCK, triton.next_power_of_2(D))
    channel_programs = triton.cdiv(D, BD)
    row_blocks = triton.cdiv(R, ROW_BLOCK)
    P = max(1, min(row_blocks, BACKWARD_PROGRAMS // channel_programs))
    df = torch.empty(f.shape, dtype=f.dtype, device=f.device)
    d_shift_parts, d_rate_parts = (torch.empty(P, D, dtype=torch.float32, device=f.device) for _ in range(2))
    _decay_backward_kernel[(P, channel_programs)](
        f, A_log, dt_bias, dg.contiguous(), df, d_shift_parts, d_rate_parts, R, D, K, P, row_blocks,
        BR=ROW_BLOCK, BD=BD, num_warps=WARPS,
    )
    d_A_log = d_rate_parts.sum(0).view(H, K).sum(1).to(A_log.dtype)
    return [df, d_A_log, d_shift_parts.sum(0).to(dt_bias.dtype)]


@_decay_backward.register_fake
def _decay_backward_shapes(f, A_log, dt_bias, dg):
    return [t.new_empty(t.shape) for t in (f, A_log, dt_bias)]


def _decay_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _decay_differentiate(ctx, dg):
    refuse_higher_order("GatedDeltaNet2's fused decay gate kernel", LAYER_INSTEAD)
    return tuple(_decay_backward(*ctx.saved_tensors, dg))


_decay_forward.register_autograd(_decay_differentiate, setup_context=_decay_setup_context)


def decay_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """``-exp(A_log[h]) * softplus(f + dt_bias)``, float32, f's shape.

    Args: f ``[..., H * K]`` (any float dtype); A_log ``[H]``; dt_bias ``[H * K]``. Differentiable
    in all three.
    """
    for name, value in (("f", f), ("A_log", A_log), ("dt_bias", dt_bias)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, received {type(value).__name__}")
    D = f.shape[-1]
    if tuple(dt_bias.shape) != (D,):
        raise ValueError(f"dt_bias: expected shape [{D}] (f's last dimension), received {list(dt_bias.shape)}")
    if A_log.ndim != 1 or A_log.shape[0] < 1 or D % A_log.shape[0]:
        raise ValueError(f"A_log: expected shape [H] with H dividing {D}, received {list(A_log.shape)}")
    return _decay_forward(f, A_log, dt_bias)


@triton.jit
def _sigmoid_forward_kernel(x, y, R, D, stride_x, scale, BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = (rows < R)[:, None] & (cols < D)[None, :]
    value = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(y + rows[:, None] * D + cols[None, :], (scale * tl.sigmoid(value)).to(y.dtype.element_ty), mask=ok)


@triton.jit
def _sigmoid_backward_kernel(x, dy, dx, R, D, stride_x, scale, BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = (rows < R)[:, None] & (cols < D)[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    opening = tl.sigmoid(tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32))
    d_out = tl.load(dy + offsets, mask=ok, other=0.0).to(tl.float32)
    tl.store(dx + offsets, (d_out * scale * opening * (1.0 - opening)).to(dx.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last dimension]`` with contiguous rows (a view of a channel slice of a
    wider tensor where possible, else a copy)."""
    rows = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    return rows if rows.shape[1] <= 1 or rows.stride(1) == 1 else rows.contiguous()


def _sigmoid_grid(R: int, D: int):
    BD = min(CHANNEL_BLOCK, triton.next_power_of_2(D))
    BR = max(1, ELEMENT_BLOCK // BD)
    return (triton.cdiv(R, BR), triton.cdiv(D, BD)), BR, BD


@torch.library.custom_op("gdn2::sigmoid_gate_forward", mutates_args=())
def _sigmoid_forward(x: torch.Tensor, scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    rows = _rows(x)
    R, D = rows.shape
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    grid, BR, BD = _sigmoid_grid(R, D)
    _sigmoid_forward_kernel[grid](rows, y, R, D, rows.stride(0), scale, BR=BR, BD=BD, num_warps=WARPS)
    return y


@_sigmoid_forward.register_fake
def _sigmoid_forward_shapes(x, scale, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("gdn2::sigmoid_gate_backward", mutates_args=())
def _sigmoid_backward(x: torch.Tensor, dy: torch.Tensor, scale: float) -> torch.Tensor:
    rows = _rows(x)
    R, D = rows.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid, BR, BD = _sigmoid_grid(R, D)
    _sigmoid_backward_kernel[grid](rows, dy.contiguous(), dx, R, D, rows.stride(0), scale, BR=BR, BD=BD, num_warps=WARPS)
    return dx


@_sigmoid_backward.register_fake
def _sigmoid_backward_shapes(x, dy, scale):
    return x.new_empty(x.shape)


def _sigmoid_setup_context(ctx, inputs, output):
    x, scale, _ = inputs
    ctx.save_for_backward(x)
    ctx.scale = scale


def _sigmoid_differentiate(ctx, dy):
    refuse_higher_order("GatedDeltaNet2's fused sigmoid gate kernel", LAYER_INSTEAD)
    (x,) = ctx.saved_tensors
    return _sigmoid_backward(x, dy, ctx.scale), None, None


_sigmoid_forward.register_autograd(_sigmoid_differentiate, setup_context=_sigmoid_setup_context)


def sigmoid_gate(x: torch.Tensor, scale: float = 1.0, *, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scale * sigmoid(x)``, in ``out_dtype`` (computed in float32), x's shape; differentiable in
    x. A channel slice of a wider tensor (rows evenly spaced) is read in place."""
    if not isinstance(x, torch.Tensor) or x.ndim < 1:
        raise ValueError(f"x: expected a torch.Tensor with at least one dimension, received {type(x).__name__}")
    return _sigmoid_forward(x, float(scale), out_dtype)
