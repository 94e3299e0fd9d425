"""PyTorch entry points: ``chunk_gdn2`` (path-selecting) and ``recurrent_gdn2`` (token by token).

The chunk path is a ``torch.autograd.Function`` whose forward is the chunked WY form and whose
backward is the analytic chunked adjoint (both from ``gdn2/algorithm.py``); the reference path is
the recurrence in torch ops under autograd; the kernel path is Triton (``gdn2/torch/triton/``).
Validation, path choice and fallback are ``gdn2.paths``.
"""

from __future__ import annotations

import torch

from .. import algorithm, paths
from ..packing import SequenceOffsets
from ..paths import Framework, KernelBackend, PathChoice
from .xp import torch_ops

__all__ = ["chunk_gdn2", "recurrent_gdn2", "which_path"]


class ChunkGDN2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, b, w, initial_state, scale: float, chunk_size: int, sequences):
        ctx.set_materialize_grads(False)
        dtype = torch_ops.compute_dtype(q)
        inputs = [x.to(dtype) for x in (q, k, v, g, b, w)]
        state = None if initial_state is None else initial_state.to(dtype)
        o, final_state, states = algorithm.forward(torch_ops, *inputs, scale, state, chunk_size, sequences)
        ctx.save_for_backward(q, k, v, g, b, w, states)
        ctx.scale, ctx.chunk_size, ctx.sequences = scale, chunk_size, sequences
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
            torch_ops, *inputs, ctx.scale, states, d_o.to(dtype), d_final, ctx.chunk_size, ctx.sequences
        )
        grads = [grad.to(x.dtype) for grad, x in zip(grads, (q, k, v, g, b, w))]
        d_initial = None if ctx.initial_dtype is None else d_initial.to(ctx.initial_dtype)
        return (*grads, d_initial, None, None, None)


def _chunk(q, k, v, g, b, w, *, scale, initial_state, chunk_size, sequences):
    return ChunkGDN2.apply(q, k, v, g, b, w, initial_state, scale, chunk_size, sequences)


def _off_cuda(q) -> str | None:
    if q.device.type == "cuda":
        return None
    return f"tensors on {q.device.type} (the Triton interpreter runs only when forced)"


def _triton_backend() -> KernelBackend:
    from . import triton

    return KernelBackend(
        name="Triton kernel",
        unsupported_reason=triton.unsupported_reason,
        call=triton.triton_gdn2,
        failures=triton.KERNEL_FAILURES,
        automatic_reason=_off_cuda,
    )


TORCH = Framework(name="torch", ops=torch_ops, kernel_name="Triton kernel", load_kernel=_triton_backend, chunk=_chunk)


def which_path(q, k, v, g, b, w, initial_state=None, chunk_size: int = 64, path: str | None = None) -> PathChoice:
    """The path ``chunk_gdn2`` takes for these arguments, and why."""
    return paths.which_path(TORCH, q, k, v, g, b, w, initial_state, chunk_size, path)


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
    cu_seqlens: torch.Tensor | SequenceOffsets | None = None,
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
            q's device, or those offsets already parsed (``gdn2.spec.parse_cu_seqlens``); the
            state restarts at each sequence, and the states have N rows.

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in the dtype of q; final_state ``[B, H, K, V]``
        float32 (float64 for float64 inputs), or None unless ``output_final_state``.
    """
    return paths.run(
        TORCH, q, k, v, g, b, w, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        chunk_size=chunk_size, path=path, cu_seqlens=cu_seqlens,
    )


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
    cu_seqlens: torch.Tensor | SequenceOffsets | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token GDN-2 (same arguments and shapes as ``chunk_gdn2``; ``chunk_size`` unused).

    With ``T == 1`` and a state this is the decode step. Differentiated by autograd.
    """
    return paths.run_recurrent(
        TORCH, q, k, v, g, b, w, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens,
    )
