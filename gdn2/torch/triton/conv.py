"""Triton kernels of the layer's causal short convolution: depthwise over time, then SiLU, and
optionally the L2 normalisation of each head (the query and key convolutions feed the operator
normalised, so the normalisation costs no extra pass over memory).

``x`` ``[B, T, D]`` (a projection's output, ``D = heads * head_dim``, the operator's
``[B, T, H, K]`` layout seen flat), weight ``[D, 1, W]`` (``nn.Conv1d``'s), optional bias
``[D]``; per channel ``d`` and step ``t``::

    z[t] = sum_j weight[d, j] * x[t - (W - 1 - j)] + bias[d]        x[s < 0] from the state
    y[t] = silu(z[t])            (then y / sqrt(sum over the head of y^2 + eps) per head)

Options, as in ``gdn2.torch.layer.ShortConvolution``:

* ``state`` ``[B, W - 1, D]``: the inputs before step 0 (the decode cache), oldest first;
  None: zeros. Its gradient is computed.
* ``positions`` ``[B, T]`` integer: each token's index inside its packed sequence; a tap that
  would reach back past the start of the token's sequence is left out (no leak across packed
  sequences).
* ``mask`` ``[B, T]`` bool: padding steps (False) read as zero input.

Launches: forward (one program per block of steps, block of channels and batch row); backward
in two, each one program per block of steps: the pre-activation gradient ``dz``, written to a
float32 buffer, then the input gradient, each row reading the ``dz`` of the W steps that read it,
and the block's partial sums of the weight and bias gradients (added by one ``torch.sum``). The
backward recomputes the pre-activations from the inputs (W taps per step, read from cache), so
the forward saves nothing but its inputs. Recomputing ``dz`` at each of the W shifts inside one
launch instead took 3.9 ms for the layer's three convolutions on the H200 (docs/triton.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LAYER_INSTEAD, refuse_higher_order

# Launch settings: tiles of about 1024 elements (steps x channels); ``python bench/layer.py
# --resources`` prints each launch's registers and spills.
FORWARD_WARPS = 4
BACKWARD_WARPS = 8
TILE_ELEMENTS = 1024
BACKWARD_TILE_ELEMENTS = 1024  # the pre-activation gradient launch's tiles
INPUT_GRAD_TILE_ELEMENTS = 1024  # the input gradient launch's tiles (its weight sums: one part per tile)
INPUT_GRAD_WARPS = 1  # measured: layer fwd+bwd on the H200 15.35 -> 12.72 ms against 4 warps (bench/RESULTS.md)
MAX_STEP_BLOCK = 32
CHANNEL_BLOCK = 64  # channels per program without normalisation


@triton.jit
def _inputs(x, state, mask, i_b, s, T, D, stride_x, cols, col_ok, W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_MASK: tl.constexpr):
    """Rows ``s`` of the convolution input as a float32 tile: ``x`` for ``0 <= s < T`` (zero at
    padding; rows ``stride_x`` elements apart), the state's row ``W - 1 + s`` for
    ``-(W - 1) <= s < 0``, zero elsewhere."""
    in_x = (s >= 0) & (s < T)
    tile = tl.load(x + (i_b * T + s)[:, None] * stride_x + cols[None, :], mask=in_x[:, None] & col_ok[None, :], other=0.0)
    tile = tile.to(tl.float32)
    if HAS_MASK:
        keep = tl.load(mask + i_b * T + s, mask=in_x, other=0) != 0
        tile = tl.where(keep[:, None], tile, 0.0)  # a select: padding that holds inf/NaN stays out
    if HAS_STATE:
        in_state = (s < 0) & (s >= 1 - W)
        old = tl.load(state + (i_b * (W - 1) + W - 1 + s)[:, None] * D + cols[None, :],
                      mask=in_state[:, None] & col_ok[None, :], other=0.0)
        tile += old.to(tl.float32)
    return tile


@triton.jit
def _pre_activation(
    x, weight, bias, state, positions, mask, i_b, t, T, D, stride_x, cols, col_ok,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """``z`` at steps ``t`` ([BT, BD] float32)."""
    z = tl.zeros((BT, BD), dtype=tl.float32)
    if HAS_POSITIONS:
        position = tl.load(positions + i_b * T + t, mask=(t >= 0) & (t < T), other=0)
    for j in tl.static_range(W):
        back = W - 1 - j
        tile = _inputs(x, state, mask, i_b, t - back, T, D, stride_x, cols, col_ok, W, HAS_STATE, HAS_MASK)
        if HAS_POSITIONS:
            tile = tl.where((position >= back)[:, None], tile, 0.0)
        tap = tl.load(weight + cols * W + j, mask=col_ok, other=0.0).to(tl.float32)
        z += tile * tap[None, :]
    if HAS_BIAS:
        z += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return z


@triton.jit
def _conv_forward_kernel(
    x, weight, bias, state, positions, mask, y,  # [B, T, D], [D, W], [D], [B, W - 1, D], [B, T], [B, T], [B, T, D]
    T, D, stride_x, eps,
    W: tl.constexpr, CH: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_MASK: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_c = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    t = i_t * BT + tl.arange(0, BT)
    lane = tl.arange(0, BD)
    cols = i_c * CH + lane
    col_ok = (lane < CH) & (cols < D)
    z = _pre_activation(x, weight, bias, state, positions, mask, i_b, t, T, D, stride_x, cols, col_ok,
                        W, BT, BD, HAS_BIAS, HAS_STATE, HAS_POSITIONS, HAS_MASK)
    out = z * tl.sigmoid(z)  # channels outside the block have z = 0, out = 0
    if NORMALIZE:
        out = out * tl.rsqrt(tl.sum(out * out, 1) + eps)[:, None]
    tl.store(y + (i_b * T + t)[:, None] * D + cols[None, :], out.to(y.dtype.element_ty),
             mask=(t < T)[:, None] & col_ok[None, :])


@triton.jit
def _pre_activation_grad(
    x, weight, bias, state, positions, mask, dy, i_b, t, T, D, stride_x, cols, col_ok, eps,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_MASK: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    """The gradient of ``z`` at steps ``t`` (zero at steps outside ``[0, T)``), ``z`` recomputed."""
    z = _pre_activation(x, weight, bias, state, positions, mask, i_b, t, T, D, stride_x, cols, col_ok,
                        W, BT, BD, HAS_BIAS, HAS_STATE, HAS_POSITIONS, HAS_MASK)
    row_ok = (t >= 0) & (t < T)
    d_out = tl.load(dy + (i_b * T + t)[:, None] * D + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    d_out = d_out.to(tl.float32)
    sig = tl.sigmoid(z)
    if NORMALIZE:
        act = z * sig
        inv_norm = tl.rsqrt(tl.sum(act * act, 1) + eps)
        normed = act * inv_norm[:, None]
        d_out = inv_norm[:, None] * (d_out - normed * tl.sum(d_out * normed, 1)[:, None])
    dz = d_out * sig * (1.0 + z * (1.0 - sig))
    return tl.where(row_ok[:, None], dz, 0.0)


@triton.jit
def _shifted_pre_grad(d_pre, positions, i_b, s, m: tl.constexpr, T, D, cols, col_ok, rows_ok,
                      HAS_POSITIONS: tl.constexpr):
    """``dz[s + m]``: the pre-activation gradient of the step that reads row ``s`` through its
    ``m``-th tap back (zero outside ``[0, T)`` and where ``rows_ok`` is False; with packed
    sequences a step reaches back ``m`` rows only inside its own sequence)."""
    t = s + m
    row_ok = (t >= 0) & (t < T) & rows_ok
    dz = tl.load(d_pre + (i_b * T + t)[:, None] * D + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if HAS_POSITIONS and m > 0:
        position = tl.load(positions + i_b * T + t, mask=row_ok, other=0)
        dz = tl.where((position >= m)[:, None], dz, 0.0)
    return dz


@triton.jit
def _conv_backward_kernel(
    x, weight, bias, state, positions, mask, dy,  # as the forward; dy [B, T, D]
    d_pre,  # [B, T, D] float32: the pre-activation gradient
    T, D, stride_x, eps,
    W: tl.constexpr, CH: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_MASK: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    """The pre-activation gradient ``dz`` of one block of steps (to ``d_pre``, for the input launch)."""
    i_t = tl.program_id(0)
    i_c = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    lane = tl.arange(0, BD)
    cols = i_c * CH + lane
    col_ok = (lane < CH) & (cols < D)
    s = i_t * BT + tl.arange(0, BT)
    dz = _pre_activation_grad(x, weight, bias, state, positions, mask, dy, i_b, s, T, D, stride_x, cols, col_ok, eps,
                              W, BT, BD, HAS_BIAS, HAS_STATE, HAS_POSITIONS, HAS_MASK, NORMALIZE)
    tl.store(d_pre + (i_b * T + s)[:, None] * D + cols[None, :], dz, mask=(s < T)[:, None] & col_ok[None, :])


@triton.jit
def _conv_input_grad_kernel(
    d_pre, weight, positions, mask,  # [B, T, D] f32 from _conv_backward_kernel, [D, W], [B, T], [B, T]
    x, state,  # the forward's inputs (for the weight gradient)
    dx, d_state, d_weight_parts, d_bias_parts,  # [B, T, D], [B, W - 1, D], [B * blocks, D, W] f32, [B * blocks, D] f32
    T, D, stride_x,
    W: tl.constexpr, CH: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """dx of one block of steps, ``sum_m weight[W - 1 - m] dz[s + m]`` over the taps that read
    row s (``dz`` read from memory), and the block's partial sums of the weight and bias
    gradients (one part per block): tap ``W - 1 - m``'s is ``sum_s dz[s + m] x[s]``, stored as it
    is made (a [channels] vector per tap: no [channels, taps] tile, whose layout the compiler
    would impose on the loads). The first block also takes the state's rows (steps -(W - 1) ..
    -1): their gradient, and their share of the weight sums."""
    i_t = tl.program_id(0)
    i_c = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    lane = tl.arange(0, BD)
    cols = i_c * CH + lane
    col_ok = (lane < CH) & (cols < D)
    s = i_t * BT + tl.arange(0, BT)
    x_tile = _inputs(x, state, mask, i_b, s, T, D, stride_x, cols, col_ok, W, HAS_STATE, HAS_MASK)
    grad = tl.zeros((BT, BD), dtype=tl.float32)
    if HAS_STATE:  # the state's rows, in the first block only (elsewhere every load is masked off)
        r = tl.arange(0, BS) - (W - 1)
        r_ok = (r < 0) & (i_t + 0 * r == 0)  # vectors: the interpreter needs them
        first_cols = col_ok & (i_t + 0 * cols == 0)
        r_tile = _inputs(x, state, mask, i_b, r, T, D, stride_x, cols, first_cols, W, HAS_STATE, HAS_MASK)
        r_tile = tl.where((r < 0)[:, None], r_tile, 0.0)  # rows from 0 on are the block's own
        grad_r = tl.zeros((BS, BD), dtype=tl.float32)
    part = i_b * tl.num_programs(0) + i_t
    for m in tl.static_range(W):
        tap = tl.load(weight + cols * W + (W - 1 - m), mask=col_ok, other=0.0).to(tl.float32)
        dz = _shifted_pre_grad(d_pre, positions, i_b, s, m, T, D, cols, col_ok, s >= 0, HAS_POSITIONS)
        grad += dz * tap[None, :]
        tap_sum = tl.sum(dz * x_tile, 0)
        if m == 0 and HAS_BIAS:
            tl.store(d_bias_parts + part * D + cols, tl.sum(dz, 0), mask=col_ok)
        if HAS_STATE:
            dz_r = _shifted_pre_grad(d_pre, positions, i_b, r, m, T, D, cols, col_ok, r_ok, HAS_POSITIONS)
            grad_r += dz_r * tap[None, :]
            tap_sum += tl.sum(dz_r * r_tile, 0)
        tl.store(d_weight_parts + (part * D + cols) * W + (W - 1 - m), tap_sum, mask=col_ok)
    if HAS_MASK:  # padding steps read zero input: no gradient reaches them
        keep = tl.load(mask + i_b * T + s, mask=s < T, other=0) != 0
        grad = tl.where(keep[:, None], grad, 0.0)
    tl.store(dx + (i_b * T + s)[:, None] * D + cols[None, :], grad.to(dx.dtype.element_ty),
             mask=(s < T)[:, None] & col_ok[None, :])
    if HAS_STATE:
        tl.store(d_state + (i_b * (W - 1) + W - 1 + r)[:, None] * D + cols[None, :],
                 grad_r.to(d_state.dtype.element_ty), mask=r_ok[:, None] & col_ok[None, :])


def row_stride(x: torch.Tensor) -> int | None:
    """The distance between consecutive rows (b, t) of ``x [B, T, D]`` in elements, None when they
    are not evenly spaced or a row is not contiguous. Contiguous tensors and channel slices of a
    wider projection output (``torch.split`` along the last dimension) have one."""
    B, T, D = x.shape
    if D > 1 and x.stride(2) != 1:
        return None
    stride = x.stride(0) if T == 1 else x.stride(1)
    if B > 1 and T > 1 and x.stride(0) != T * stride:
        return None
    return stride


def step_block(BD: int, elements: int | None = None) -> int:
    """Steps per tile of about ``elements`` (default ``TILE_ELEMENTS``) for a block of ``BD``
    channels."""
    return min(MAX_STEP_BLOCK, max(2, (elements or TILE_ELEMENTS) // BD))


def _channel_blocks(D: int, head_dim: int | None) -> tuple[int, int, int]:
    """(channels per program, their power-of-two block, number of programs over D)."""
    if head_dim is not None:
        return head_dim, triton.next_power_of_2(head_dim), D // head_dim
    block = min(CHANNEL_BLOCK, triton.next_power_of_2(D))
    return block, block, triton.cdiv(D, block)


def _flags(bias, state, positions, mask, head_dim) -> dict:
    return dict(HAS_BIAS=bias is not None, HAS_STATE=state is not None, HAS_POSITIONS=positions is not None,
                HAS_MASK=mask is not None, NORMALIZE=head_dim is not None)


def conv_forward(x, weight, bias, state, positions, mask, y, head_dim: int | None, eps: float) -> None:
    """Launch the forward: writes ``y`` ``[B, T, D]`` (rows of x ``row_stride(x)`` apart, the
    other tensors contiguous; weight ``[D, W]``)."""
    B, T, D = x.shape
    W = weight.shape[1]
    CH, BD, channel_programs = _channel_blocks(D, head_dim)
    BT = step_block(BD)
    _conv_forward_kernel[(triton.cdiv(T, BT), channel_programs, B)](
        x, weight, x if bias is None else bias, x if state is None else state,
        x if positions is None else positions, x if mask is None else mask, y,
        T, D, row_stride(x), eps, W=W, CH=CH, BT=BT, BD=BD, **_flags(bias, state, positions, mask, head_dim),
        num_warps=FORWARD_WARPS,
    )


def conv_backward(x, weight, bias, state, positions, mask, dy, head_dim: int | None, eps: float):
    """Launch the backward; returns ``(dx, d_weight [D, W] float32, d_bias [D] float32 or None,
    d_state or None)``."""
    B, T, D = x.shape
    W = weight.shape[1]
    CH, BD, channel_programs = _channel_blocks(D, head_dim)
    flags = _flags(bias, state, positions, mask, head_dim)
    f32 = dict(dtype=torch.float32, device=x.device)
    d_pre = torch.empty(B, T, D, **f32)
    BT = step_block(BD, BACKWARD_TILE_ELEMENTS)
    _conv_backward_kernel[(triton.cdiv(T, BT), channel_programs, B)](
        x, weight, x if bias is None else bias, x if state is None else state,
        x if positions is None else positions, x if mask is None else mask, dy, d_pre,
        T, D, row_stride(x), eps, W=W, CH=CH, BT=BT, BD=BD, **flags, num_warps=BACKWARD_WARPS,
    )
    BT_input = step_block(BD, INPUT_GRAD_TILE_ELEMENTS)
    input_blocks = triton.cdiv(T, BT_input)
    d_weight_parts = torch.empty(B * input_blocks, D, W, **f32)
    d_bias_parts = torch.empty(B * input_blocks, D, **f32) if bias is not None else d_weight_parts
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, whatever x's strides
    d_state = None if state is None else torch.empty_like(state)
    _conv_input_grad_kernel[(input_blocks, channel_programs, B)](
        d_pre, weight, x if positions is None else positions, x if mask is None else mask,
        x, x if state is None else state,
        dx, dx if d_state is None else d_state, d_weight_parts, d_bias_parts, T, D, row_stride(x),
        W=W, CH=CH, BT=BT_input, BD=BD, BS=max(2, triton.next_power_of_2(W - 1)),
        **{key: value for key, value in flags.items() if key != "NORMALIZE"}, num_warps=INPUT_GRAD_WARPS,
    )
    d_bias = d_bias_parts.sum(0) if bias is not None else None
    return dx, d_weight_parts.sum(0), d_bias, d_state


# The launches run inside PyTorch custom operators with fake (shape-only) and autograd
# implementations registered, so that torch.compile traces through them without a graph break.
# The operators take their inputs with any strides and make them fit the kernels themselves:
# autograd and the compiler hand back saved inputs with the strides they were given.


def _kernel_inputs(x, weight, bias, state, positions, mask):
    """The arguments as the kernels read them: x's rows evenly spaced (a channel slice of a wider
    tensor stays in place), weight ``[D, W]``, the others contiguous, the mask as bytes."""
    if row_stride(x) is None:
        x = x.contiguous()
    weight = weight.reshape(weight.shape[0], weight.shape[-1]).contiguous()
    bias, state, positions = (None if t is None else t.contiguous() for t in (bias, state, positions))
    mask = None if mask is None else mask.contiguous().view(torch.uint8)
    return x, weight, bias, state, positions, mask


@torch.library.custom_op("gdn2::short_conv_forward", mutates_args=())
def _forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor | None,
    positions: torch.Tensor | None, mask: torch.Tensor | None, head_dim: int | None, eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    x, weight, bias, state, positions, mask = _kernel_inputs(x, weight, bias, state, positions, mask)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    conv_forward(x, weight, bias, state, positions, mask, y, head_dim, eps)
    return y


@_forward.register_fake
def _forward_shapes(x, weight, bias, state, positions, mask, head_dim, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("gdn2::short_conv_backward", mutates_args=())
def _backward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor | None,
    positions: torch.Tensor | None, mask: torch.Tensor | None, dy: torch.Tensor, head_dim: int | None, eps: float,
) -> list[torch.Tensor]:
    """``[dx, d_weight, d_bias, d_state]`` in the dtypes and shapes of their inputs (d_bias and
    d_state empty where bias and state are None), all contiguous."""
    dx, d_weight, d_bias, d_state = conv_backward(
        *_kernel_inputs(x, weight, bias, state, positions, mask), dy.contiguous(), head_dim, eps
    )
    return [
        dx,
        d_weight.reshape(weight.shape).to(weight.dtype),
        x.new_empty(0) if d_bias is None else d_bias.to(bias.dtype),
        x.new_empty(0) if d_state is None else d_state,
    ]


@_backward.register_fake
def _backward_shapes(x, weight, bias, state, positions, mask, dy, head_dim, eps):
    return [x.new_empty(x.shape), weight.new_empty(weight.shape)] + [
        x.new_empty(0) if t is None else t.new_empty(t.shape) for t in (bias, state)
    ]


def _setup_context(ctx, inputs, output):
    x, weight, bias, state, positions, mask, head_dim, eps, _ = inputs
    ctx.save_for_backward(x, weight, bias, state, positions, mask)
    ctx.head_dim, ctx.eps = head_dim, eps


def _differentiate(ctx, dy):
    refuse_higher_order("GatedDeltaNet2's fused short convolution kernel", LAYER_INSTEAD)
    x, weight, bias, state, positions, mask = ctx.saved_tensors
    dx, d_weight, d_bias, d_state = _backward(x, weight, bias, state, positions, mask, dy, ctx.head_dim, ctx.eps)
    return (dx, d_weight, None if bias is None else d_bias, None if state is None else d_state,
            None, None, None, None, None)


_forward.register_autograd(_differentiate, setup_context=_setup_context)


def _tensor(name: str, value, ndim: int, device) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, received {type(value).__name__}")
    if value.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, received shape {list(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, received one on {value.device}")


def short_convolution(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    head_dim: int | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``silu(causal depthwise conv(x))`` (then L2-normalised per head of ``head_dim`` channels).

    Args: x ``[B, T, D]``; weight ``[D, 1, W]``; bias ``[D]`` or None; state ``[B, W - 1, D]`` or
    None (zeros); positions ``[B, T]`` integer or None; mask ``[B, T]`` bool or None;
    ``head_dim``: normalise each group of ``head_dim`` channels (None: no normalisation, ``D``
    must be a multiple); ``out_dtype``: of the result (default x's).

    Returns ``y`` ``[B, T, D]``, differentiable in x, weight, bias and state. The new decode
    state is not computed here: it is the last ``W - 1`` rows of ``cat(state, x)``.
    """
    _tensor("x", x, 3, x.device)
    B, T, D = x.shape
    _tensor("weight", weight, 3, x.device)
    if weight.shape[0] != D or weight.shape[1] != 1:
        raise ValueError(f"weight: expected shape [{D}, 1, W], received {list(weight.shape)}")
    W = weight.shape[2]
    if bias is not None:
        _tensor("bias", bias, 1, x.device)
        if bias.shape[0] != D:
            raise ValueError(f"bias: expected shape [{D}], received {list(bias.shape)}")
    if state is not None:
        _tensor("state", state, 3, x.device)
        if tuple(state.shape) != (B, W - 1, D):
            raise ValueError(f"state: expected shape {[B, W - 1, D]}, received {list(state.shape)}")
        state = state if W > 1 else None
    if positions is not None:
        _tensor("positions", positions, 2, x.device)
        if tuple(positions.shape) != (B, T) or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions: expected an int32/int64 tensor of shape {[B, T]}, received "
                             f"{str(positions.dtype).rsplit('.', 1)[-1]} {list(positions.shape)}")
    if mask is not None:
        _tensor("mask", mask, 2, x.device)
        if tuple(mask.shape) != (B, T) or mask.dtype != torch.bool:
            raise ValueError(f"mask: expected a bool tensor of shape {[B, T]}, received "
                             f"{str(mask.dtype).rsplit('.', 1)[-1]} {list(mask.shape)}")
    if head_dim is not None and (head_dim < 1 or D % head_dim):
        raise ValueError(f"head_dim: expected a divisor of the {D} channels, received {head_dim}")
    head_dim = None if head_dim is None else int(head_dim)
    return _forward(x, weight, bias, state, positions, mask, head_dim, float(eps), out_dtype or x.dtype)
