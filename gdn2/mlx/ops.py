"""MLX entry points: ``chunk_gdn2`` (path-selecting) and ``recurrent_gdn2`` (token by token).

The chunk path is an ``mx.custom_function`` whose forward is the chunked WY form and whose ``vjp``
is the analytic chunked adjoint (both from ``gdn2/algorithm.py``); the reference path is the recurrence
in MLX ops under MLX autodiff; the kernel path is Metal (``gdn2/mlx/metal/``).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from .. import algorithm
from ..paths import PathChoice, announce, choose, run_kernel
from ..spec import default_scale, validate
from .xp import mlx_ops

__all__ = ["chunk_gdn2", "recurrent_gdn2", "which_path"]

# Steps between the states the Metal scan keeps for its backward (its memory/recompute trade-off;
# not the chunk_size of the chunked form).
CHECKPOINT_INTERVAL = 64


def _compute_dtype(x: mx.array) -> mx.Dtype:
    """float64 stays float64 (MLX runs it on the CPU); everything else is computed in float32."""
    return mx.float64 if x.dtype == mx.float64 else mx.float32


@lru_cache(maxsize=64)
def _chunk_function(scale: float, chunk_size: int, offsets: tuple[int, ...] | None, has_state: bool):
    """One ``mx.custom_function`` per (scale, chunk_size, packed offsets, with or without an
    initial state): arrays are its only arguments, ``(q, k, v, g, b, w[, initial_state])``.

    It returns ``(o, final_state, states)``; ``states`` (the state entering each chunk) is an
    output only so that the vjp receives it, and callers drop it (its cotangent is zero).
    """

    packing = None if offsets is None else algorithm.Packing.build(np.array(offsets), chunk_size)

    @mx.custom_function
    def chunk(*arrays):
        q = arrays[0]
        dtype = _compute_dtype(q)
        inputs = [x.astype(dtype) for x in arrays[:6]]
        initial_state = arrays[6].astype(dtype) if has_state else None
        o, final_state, states = algorithm.forward(mlx_ops, *inputs, scale, initial_state, chunk_size, packing)
        return o.astype(q.dtype), final_state, states

    @chunk.vjp
    def chunk_vjp(primals, cotangents, outputs):
        d_o, d_final_state, _ = cotangents
        states = outputs[2]
        dtype = states.dtype
        inputs = [x.astype(dtype) for x in primals[:6]]
        *grads, d_initial = algorithm.backward(
            mlx_ops, *inputs, scale, states, d_o.astype(dtype), d_final_state.astype(dtype), chunk_size, packing
        )
        grads = [grad.astype(x.dtype) for grad, x in zip(grads, primals)]
        return (*grads, d_initial.astype(primals[6].dtype)) if has_state else tuple(grads)

    return chunk


def _metal_module():
    try:
        from . import metal
    except Exception as error:  # the kernel module failed to import
        return None, f"Metal kernels unavailable ({type(error).__name__}: {error})"
    return metal, None


def _metal_call(metal, scale, initial_state, output_final_state):
    return lambda *x: metal.metal_gdn2(
        *x, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        checkpoint_interval=CHECKPOINT_INTERVAL,
    )


def which_path(q, k, v, g, b, w, initial_state=None, chunk_size: int = 64, path: str | None = None) -> PathChoice:
    """The path ``chunk_gdn2`` takes for these arguments, and why."""
    metal, problem = _metal_module()
    if problem is None:
        problem = metal.unsupported_reason(q, k, v, g, b, w, initial_state, chunk_size)
    return choose(path, problem, "Metal kernel")


def chunk_gdn2(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    b: mx.array,
    w: mx.array,
    scale: float | None = None,
    initial_state: mx.array | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    path: str | None = None,
    cu_seqlens=None,
) -> tuple[mx.array, mx.array | None]:
    """Gated DeltaNet-2 over a sequence, differentiable in every input (MLX).

    Same arguments, shapes and results as ``gdn2.torch.chunk_gdn2``:
    q, k, g, b ``[B, T, H, K]``; v, w ``[B, T, H, V]``; initial_state ``[B, H, K, V]`` float32
    (float64 with float64 inputs) or None. Returns ``(o [B, T, H, V], final_state or None)``.
    Works under ``mx.grad``, ``mx.value_and_grad`` and ``mx.compile``. ``cu_seqlens``: ``[N + 1]``
    integer offsets of N sequences packed along T (B = 1), as an mx or numpy array (numpy under
    ``mx.compile``, where array values cannot be read); the state restarts at each sequence.
    """
    dims = validate(q, k, v, g, b, w, scale, initial_state, chunk_size, cu_seqlens)
    scale = default_scale(dims.K, scale)
    choice = which_path(q, k, v, g, b, w, initial_state, chunk_size, path)
    announce("mlx", choice)
    if choice.path == "kernel":
        metal, _ = _metal_module()
        result = run_kernel(
            "mlx", "Metal kernel", _metal_call(metal, scale, initial_state, output_final_state), mlx_ops,
            (q, k, v, g, b, w), cu_seqlens,
        )
        if result is not None:
            return result
    if choice.path == "reference":
        return _reference(q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens)
    offsets = None if cu_seqlens is None else tuple(int(x) for x in cu_seqlens.tolist())
    arrays = (q, k, v, g, b, w) if initial_state is None else (q, k, v, g, b, w, initial_state)
    o, final_state, _ = _chunk_function(scale, chunk_size, offsets, initial_state is not None)(*arrays)
    return o, (final_state if output_final_state else None)


def recurrent_gdn2(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    b: mx.array,
    w: mx.array,
    scale: float | None = None,
    initial_state: mx.array | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens=None,
) -> tuple[mx.array, mx.array | None]:
    """Token-by-token GDN-2 (same arguments and shapes as ``chunk_gdn2``; ``chunk_size`` unused).

    With ``T == 1`` and a state this is the decode step. The Metal kernel is itself a per-step scan:
    where it can run (an Apple GPU), this runs it; elsewhere, the recurrence in MLX ops under MLX
    autodiff.
    """
    dims = validate(q, k, v, g, b, w, scale, initial_state, chunk_size, cu_seqlens)
    scale = default_scale(dims.K, scale)
    metal, problem = _metal_module()
    if problem is None and metal.unsupported_reason(q, k, v, g, b, w, initial_state, chunk_size) is None:
        result = run_kernel(
            "mlx", "Metal kernel", _metal_call(metal, scale, initial_state, output_final_state), mlx_ops,
            (q, k, v, g, b, w), cu_seqlens, fallback="reference",
        )
        if result is not None:
            return result
    return _reference(q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens)


def _reference(q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens=None):
    dtype = _compute_dtype(q)
    inputs = [x.astype(dtype) for x in (q, k, v, g, b, w)]
    state = None if initial_state is None else initial_state.astype(dtype)
    o, final_state = algorithm.recurrent(mlx_ops, *inputs, scale, state, cu_seqlens)
    return o.astype(q.dtype), (final_state if output_final_state else None)
