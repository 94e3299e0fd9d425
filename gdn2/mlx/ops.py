"""MLX entry points: ``chunk_gdn2`` (path-selecting) and ``recurrent_gdn2`` (token by token).

The chunk path is an ``mx.custom_function`` whose forward is the chunked WY form and whose ``vjp``
is the analytic chunked adjoint (both from ``gdn2/algorithm.py``); the reference path is the
recurrence in MLX ops under MLX autodiff; the kernel path is Metal (``gdn2/mlx/metal/``).
Validation, path choice and fallback are ``gdn2.paths``.
"""

from __future__ import annotations

from functools import lru_cache, partial

import mlx.core as mx

from .. import algorithm, paths
from ..packing import SequenceOffsets
from ..paths import Framework, KernelBackend, PathChoice
from .xp import mlx_ops

__all__ = ["chunk_gdn2", "recurrent_gdn2", "which_path"]

# Steps between the states the Metal scan keeps for its backward (its memory/recompute trade-off;
# not the chunk_size of the chunked form; the chunked Metal kernels keep one per chunk of 32).
CHECKPOINT_INTERVAL = 64


@lru_cache(maxsize=64)
def _chunk_function(scale: float, chunk_size: int, sequences: SequenceOffsets | None, has_state: bool):
    """One ``mx.custom_function`` per (scale, chunk_size, packed offsets, with or without an
    initial state): arrays are its only arguments, ``(q, k, v, g, b, w[, initial_state])``.

    It returns ``(o, final_state, states)``; ``states`` (the state entering each chunk) is an
    output only so that the vjp receives it, and callers drop it (its cotangent is zero).
    """

    @mx.custom_function
    def chunk(*arrays):
        q = arrays[0]
        dtype = mlx_ops.compute_dtype(q)
        inputs = [x.astype(dtype) for x in arrays[:6]]
        initial_state = arrays[6].astype(dtype) if has_state else None
        o, final_state, states = algorithm.forward(mlx_ops, *inputs, scale, initial_state, chunk_size, sequences)
        return o.astype(q.dtype), final_state, states

    @chunk.vjp
    def chunk_vjp(primals, cotangents, outputs):
        d_o, d_final_state, _ = cotangents
        states = outputs[2]
        dtype = states.dtype
        inputs = [x.astype(dtype) for x in primals[:6]]
        *grads, d_initial = algorithm.backward(
            mlx_ops, *inputs, scale, states, d_o.astype(dtype), d_final_state.astype(dtype), chunk_size, sequences
        )
        grads = [grad.astype(x.dtype) for grad, x in zip(grads, primals)]
        return (*grads, d_initial.astype(primals[6].dtype)) if has_state else tuple(grads)

    return chunk


def _chunk(q, k, v, g, b, w, *, scale, initial_state, chunk_size, sequences):
    arrays = (q, k, v, g, b, w) if initial_state is None else (q, k, v, g, b, w, initial_state)
    o, final_state, _ = _chunk_function(scale, chunk_size, sequences, initial_state is not None)(*arrays)
    return o, final_state


def _metal_backend() -> KernelBackend:
    from . import metal

    return KernelBackend(
        name="Metal kernel",
        unsupported_reason=metal.unsupported_reason,
        call=partial(metal.metal_gdn2, checkpoint_interval=CHECKPOINT_INTERVAL),
        failures=metal.KERNEL_FAILURES,
        describe=partial(metal.describe, checkpoint_interval=CHECKPOINT_INTERVAL),
    )


MLX = Framework(
    name="mlx", ops=mlx_ops, kernel_name="Metal kernel", load_kernel=_metal_backend, chunk=_chunk,
    kernel_runs_recurrent=True,
)


def which_path(q, k, v, g, b, w, initial_state=None, chunk_size: int = 64, path: str | None = None) -> PathChoice:
    """The path ``chunk_gdn2`` takes for these arguments, and why."""
    return paths.which_path(MLX, q, k, v, g, b, w, initial_state, chunk_size, path)


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
    integer offsets of N sequences packed along T (B = 1), or those offsets already parsed
    (``gdn2.spec.parse_cu_seqlens``); the state restarts at each sequence.
    """
    return paths.run(
        MLX, q, k, v, g, b, w, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        chunk_size=chunk_size, path=path, cu_seqlens=cu_seqlens,
    )


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

    With ``T == 1`` and a state this is the decode step. Where the Metal kernels can run (an Apple
    GPU), this runs them (the per-step scan at ``T == 1``); elsewhere, the recurrence in MLX ops
    under MLX autodiff.
    """
    return paths.run_recurrent(
        MLX, q, k, v, g, b, w, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens,
    )
