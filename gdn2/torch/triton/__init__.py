"""The Triton kernel path of ``gdn2.torch.chunk_gdn2``.

``unsupported_reason`` says whether the kernels can run a call; ``triton_gdn2`` runs it through a
``torch.autograd.Function`` built from these launches:

    forward:  intra_forward (parallel over chunks) -> state_forward (sequential over chunks)
              -> output (parallel)
    backward: state_backward (sequential, reverse) -> in-chunk backward (parallel): contractions
              (chunks x key blocks) -> values (chunks) -> keys (chunks x key blocks)

``docs/triton.md`` has the design, the numerics and what was measured. The kernels use chunks of 64 tokens; another ``chunk_size`` is a reason they cannot run the call.

Matrix products run in float32 accumulation. On a GPU, the large products use TF32 by default
(``GDN2_TRITON_DOT=tf32``); ``tf32x3`` or ``ieee`` trade speed for float32-exact products. The
16x16 products that build the inverse of ``I + A`` are always exact float32. Under the Triton
interpreter (``TRITON_INTERPRET=1``, CPU tensors) every product is exact float32.
"""

from __future__ import annotations

import os

import torch
from triton.errors import TritonError

from .backward import intra_backward_contract, intra_backward_keys, intra_backward_values, state_backward
from .forward import CHUNK, intra_forward, output, state_forward

# What a kernel failure raises: TritonError covers compilation (CompilationError), shared memory
# or registers (OutOfResources), ptxas (PTXASError) and the interpreter (InterpreterError); a CUDA
# launch failure ("Triton Error [CUDA]: ...") and torch.cuda.OutOfMemoryError are RuntimeErrors.
KERNEL_FAILURES = (TritonError, RuntimeError)

MAX_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _dot_precision(device: torch.device) -> str:
    if device.type != "cuda":
        return "ieee"
    choice = os.environ.get("GDN2_TRITON_DOT", "tf32").strip().lower()
    if choice not in ("tf32", "tf32x3", "ieee"):
        raise ValueError(f"GDN2_TRITON_DOT: expected tf32, tf32x3 or ieee, received {choice!r}")
    return choice


def unsupported_reason(q, k, v, g, b, w, initial_state=None, chunk_size: int = 64) -> str | None:
    """None when the Triton kernels can run these (already validated) arguments, else why not.

    Shapes: q, k, g, b ``[B, T, H, K]``; v, w ``[B, T, H, V]``; initial_state ``[B, H, K, V]`` or None.
    """
    tensors = (q, k, v, g, b, w) + (() if initial_state is None else (initial_state,))
    device = q.device
    if any(x.device != device for x in tensors):
        return "tensors on different devices"
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        return f"tensors on {device.type}; Triton needs CUDA or TRITON_INTERPRET=1"
    if q.dtype not in _DTYPES:
        return f"dtype {str(q.dtype).rsplit('.', 1)[-1]} not supported by the Triton kernels (float16, bfloat16, float32)"
    if initial_state is not None and initial_state.dtype != torch.float32:
        return f"initial_state dtype {str(initial_state.dtype).rsplit('.', 1)[-1]}; the kernels keep the state in float32"
    if chunk_size != CHUNK:
        return f"chunk_size={chunk_size}; the Triton kernels use chunks of {CHUNK}"
    K, V = q.shape[-1], v.shape[-1]
    if K > MAX_DIM:
        return f"K={K} > {MAX_DIM}"
    if V > MAX_DIM:
        return f"V={V} > {MAX_DIM}"
    return None


class TritonGDN2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, b, w, initial_state, scale: float, output_final_state: bool):
        ctx.set_materialize_grads(False)
        q, k, v, g, b, w = (x.contiguous() for x in (q, k, v, g, b, w))
        B, T, H, K = q.shape
        V = v.shape[-1]
        N = -(-T // CHUNK)
        device = q.device
        f32 = dict(dtype=torch.float32, device=device)
        precision = _dot_precision(device)
        G, qd, kd, Wk = (torch.empty(B, H, N * CHUNK, K, **f32) for _ in range(4))
        Uw = torch.empty(B, H, N * CHUNK, V, **f32)
        gamma = torch.empty(B, H, N, K, **f32)
        P = torch.empty(B, H, N, CHUNK, CHUNK, **f32)
        inverse = torch.empty(B, H, N, CHUNK, CHUNK, **f32)
        intra_forward(q, k, v, g, b, w, G, qd, kd, Wk, Uw, gamma, P, inverse, precision)

        initial = None if initial_state is None else initial_state.contiguous()
        states = torch.empty(B, H, N, K, V, **f32)
        U = torch.empty(B, H, N * CHUNK, V, **f32)
        final_state = torch.empty(B, H, K, V, **f32)
        state_forward(Wk, kd, Uw, gamma, initial, states, U, final_state, precision)
        o = torch.empty(B, T, H, V, dtype=q.dtype, device=device)
        output(qd, P, states, U, o, scale, precision)

        ctx.save_for_backward(q, k, v, g, b, w, G, qd, kd, gamma, Wk, Uw, P, inverse, states, U)
        ctx.scale = scale
        ctx.has_initial = initial_state is not None
        ctx.precision = precision
        if not output_final_state:
            ctx.mark_non_differentiable(final_state)
        return o, final_state

    @staticmethod
    def backward(ctx, d_o, d_final_state):
        if torch.is_grad_enabled():  # create_graph=True: the kernels' gradients would be constants to autograd
            from ..ops import FIRST_ORDER_ONLY

            raise RuntimeError(FIRST_ORDER_ONLY.format(path='chunk_gdn2(path="kernel")'))
        q, k, v, g, b, w, G, qd, kd, gamma, Wk, Uw, P, inverse, states, U = ctx.saved_tensors
        B, T, H, K = q.shape
        V = v.shape[-1]
        device = q.device
        f32 = dict(dtype=torch.float32, device=device)
        if d_o is None:
            d_o = torch.zeros_like(v)
        d_o = d_o.contiguous()
        d_final = None if d_final_state is None else d_final_state.to(torch.float32).contiguous()
        d_leaving = torch.empty_like(states)
        d_U = torch.empty_like(U)
        d_initial = torch.empty(B, H, K, V, **f32) if ctx.has_initial else None
        state_backward(qd, kd, Wk, gamma, P, d_o, d_final, d_leaving, d_U, d_initial, ctx.scale, ctx.precision)

        # Each buffer is dropped once its last reader ran, so that the gradients reuse its memory.
        contractions = intra_backward_contract(states, U, d_o, d_leaving, d_U, inverse, ctx.scale, ctx.precision)
        del d_leaving
        dv, dw, d_A, d_P = intra_backward_values(v, w, Wk, Uw, inverse, U, d_o, d_U, contractions[2], ctx.scale,
                                                 ctx.precision)
        del d_U
        dq, dk, dg, db = intra_backward_keys(q, k, g, b, G, *contractions, d_A, d_P, V, ctx.scale, ctx.precision)
        return dq, dk, dv, dg, db, dw, d_initial, None, None


def triton_gdn2(q, k, v, g, b, w, *, scale: float, initial_state, output_final_state: bool):
    """GDN-2 through the Triton kernels.

    Args: q, k, g, b ``[B, T, H, K]`` and v, w ``[B, T, H, V]`` (float16, bfloat16 or float32, one
    dtype); ``scale`` resolved; ``initial_state`` ``[B, H, K, V]`` float32 or None (zeros, no
    gradient).

    Returns ``(o [B, T, H, V] in q's dtype, final_state [B, H, K, V] float32 or None)``;
    differentiable in q, k, v, g, b, w and initial_state, including through final_state.
    """
    o, final_state = TritonGDN2.apply(q, k, v, g, b, w, initial_state, float(scale), bool(output_final_state))
    return o, (final_state if output_final_state else None)
