"""PyTorch entry points: ``chunk_gdn2`` (path-selecting) and ``recurrent_gdn2`` (token by token).

The chunk path is a ``torch.autograd.Function`` whose forward is the chunked WY form and whose
backward is the analytic chunked adjoint (both from ``gdn2/algorithm.py``); the reference path is the
recurrence in torch ops under autograd; the kernel path is Triton (``gdn2/torch/triton/``).
"""

from __future__ import annotations

import torch

from .. import algorithm
from ..paths import PathChoice, announce, choose, run_kernel
from ..spec import default_scale, validate
from .xp import torch_ops

__all__ = ["chunk_gdn2", "recurrent_gdn2", "which_path"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; float32, bfloat16 and float16 are computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class ChunkGDN2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, b, w, initial_state, scale: float, chunk_size: int, packing):
        ctx.set_materialize_grads(False)
        dtype = _compute_dtype(q)
        inputs = [x.to(dtype) for x in (q, k, v, g, b, w)]
        state = None if initial_state is None else initial_state.to(dtype)
        o, final_state, states = algorithm.forward(torch_ops, *inputs, scale, state, chunk_size, packing)
        ctx.save_for_backward(q, k, v, g, b, w, states)
        ctx.scale, ctx.chunk_size, ctx.packing = scale, chunk_size, packing
        ctx.initial_dtype = None if initial_state is None else initial_state.dtype
        return o.to(q.dtype), final_state

    @staticmethod
    def backward(ctx, d_o, d_final_state):
        q, k, v, g, b, w, states = ctx.saved_tensors
        dtype = states.dtype
        inputs = [x.to(dtype) for x in (q, k, v, g, b, w)]
        if d_o is None:
            d_o = torch.zeros(v.shape, dtype=dtype, device=v.device)
        d_final = None if d_final_state is None else d_final_state.to(dtype)
        *grads, d_initial = algorithm.backward(
            torch_ops, *inputs, ctx.scale, states, d_o.to(dtype), d_final, ctx.chunk_size, ctx.packing
        )
        grads = [grad.to(x.dtype) for grad, x in zip(grads, (q, k, v, g, b, w))]
        d_initial = None if ctx.initial_dtype is None else d_initial.to(ctx.initial_dtype)
        return (*grads, d_initial, None, None, None)


def _kernel_module():
    try:
        from . import triton as kernel
    except Exception as error:  # Triton missing or the kernels failed to import
        return None, f"Triton kernels unavailable ({type(error).__name__}: {error})"
    return kernel, None


def which_path(q, k, v, g, b, w, initial_state=None, chunk_size: int = 64, path: str | None = None) -> PathChoice:
    """The path ``chunk_gdn2`` takes for these arguments, and why."""
    kernel, problem = _kernel_module()
    if problem is None:
        problem = kernel.unsupported_reason(q, k, v, g, b, w, initial_state, chunk_size)
    on_cpu = None if q.device.type == "cuda" else f"tensors on {q.device.type} (the Triton interpreter runs only when forced)"
    return choose(path, problem, "Triton kernel", on_cpu)


def chunk_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    path: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet-2 over a sequence, differentiable in every input.

    Args:
        q, k: ``[B, T, H, K]`` query and key.
        v: ``[B, T, H, V]`` value.
        g: ``[B, T, H, K]`` per-channel log decay (natural log, ``<= 0``).
        b: ``[B, T, H, K]`` erase gate; w: ``[B, T, H, V]`` write gate.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` float32 (float64 with float64 inputs), or None for zeros.
        output_final_state: also return the state after the last step.
        chunk_size: tokens per chunk of the chunked form.
        path: ``"reference"``, ``"chunk"``, ``"kernel"`` or None (``GDN2_PATH``, else automatic).
        cu_seqlens: ``[N + 1]`` integer offsets of N sequences packed along T (B must be 1), on
            q's device; the state restarts at each sequence, and the states have N rows.

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in the dtype of q; final_state ``[B, H, K, V]``
        float32 (float64 for float64 inputs), or None unless ``output_final_state``.
    """
    dims = _validate(q, k, v, g, b, w, scale, initial_state, chunk_size, cu_seqlens)
    scale = default_scale(dims.K, scale)
    choice = which_path(q, k, v, g, b, w, initial_state, chunk_size, path)
    announce("torch", choice)
    if choice.path == "kernel":
        kernel, _ = _kernel_module()
        result = run_kernel(
            "torch", "Triton kernel",
            lambda *x: kernel.triton_gdn2(*x, scale=scale, initial_state=initial_state, output_final_state=output_final_state),
            torch_ops, (q, k, v, g, b, w), cu_seqlens,
        )
        if result is not None:
            return result
    if choice.path == "reference":
        return _reference(q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens)
    packing = None if cu_seqlens is None else algorithm.Packing.build(cu_seqlens, chunk_size)
    o, final_state = ChunkGDN2.apply(q, k, v, g, b, w, initial_state, scale, chunk_size, packing)
    return o, (final_state if output_final_state else None)


def recurrent_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token GDN-2 (same arguments and shapes as ``chunk_gdn2``; ``chunk_size`` unused).

    With ``T == 1`` and a state this is the decode step. Differentiated by autograd.
    """
    dims = _validate(q, k, v, g, b, w, scale, initial_state, chunk_size, cu_seqlens)
    return _reference(q, k, v, g, b, w, default_scale(dims.K, scale), initial_state, output_final_state, cu_seqlens)


def _validate(q, k, v, g, b, w, scale, initial_state, chunk_size, cu_seqlens):
    if cu_seqlens is not None and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens: expected a tensor on {q.device} (the device of q), received one on {cu_seqlens.device}")
    return validate(q, k, v, g, b, w, scale, initial_state, chunk_size, cu_seqlens)


def _reference(q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens=None):
    dtype = _compute_dtype(q)
    inputs = [x.to(dtype) for x in (q, k, v, g, b, w)]
    state = None if initial_state is None else initial_state.to(dtype)
    o, final_state = algorithm.recurrent(torch_ops, *inputs, scale, state, cu_seqlens)
    return o.to(q.dtype), (final_state if output_final_state else None)
