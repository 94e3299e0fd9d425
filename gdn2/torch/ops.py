"""PyTorch entry points: ``chunk_gdn2`` (path-selecting) and ``recurrent_gdn2`` (token by token).

The chunk path is a ``torch.autograd.Function`` whose forward is the chunked WY form and whose
backward is the analytic chunked adjoint (both from ``gdn2/algorithm.py``); the reference path is
the recurrence in torch ops under autograd; the kernel path is Triton (``gdn2/torch/triton/``).
Validation, path choice and fallback are ``gdn2.paths``.

Higher-order gradients: the reference and chunk paths give exact ones (the chunk path's backward
is written in differentiable torch ops and, when a graph of it is recorded, recomputes the chunk
states from the inputs); the kernel path raises (``gdn2.torch.triton.refuse_higher_order``). ``torch.func`` transforms
(``grad``, ``vjp``, ``jacrev``, ``vmap``) run the chunk path; forward-mode ones (``jvp``,
``jacfwd``, ``hessian``) need ``path="reference"``.
"""

from __future__ import annotations

import threading

import torch

from .. import algorithm, paths
from ..packing import SequenceOffsets
from ..paths import Framework, KernelBackend, PathChoice
from .xp import torch_ops

__all__ = ["chunk_gdn2", "recurrent_gdn2", "which_path"]



class ChunkGDN2(torch.autograd.Function):
    """The chunk path. ``forward`` and ``setup_context`` are separate (as ``torch.func`` requires);
    the third output, the state entering each chunk, is kept for the backward only."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, g, b, w, initial_state, scale: float, chunk_size: int, sequences):
        dtype = torch_ops.compute_dtype(q)
        inputs = [x.to(dtype) for x in (q, k, v, g, b, w)]
        state = None if initial_state is None else initial_state.to(dtype)
        o, final_state, states = algorithm.forward(torch_ops, *inputs, scale, state, chunk_size, sequences)
        return o.to(q.dtype), final_state, states

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, g, b, w, initial_state, scale, chunk_size, sequences = inputs
        states = output[2]
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(states)
        ctx.save_for_backward(q, k, v, g, b, w, initial_state, states)
        ctx.scale, ctx.chunk_size, ctx.sequences = scale, chunk_size, sequences

    @staticmethod
    def backward(ctx, d_o, d_final_state, _):
        q, k, v, g, b, w, initial_state, states = ctx.saved_tensors
        dtype = states.dtype
        inputs = [x.to(dtype) for x in (q, k, v, g, b, w)]
        if torch.is_grad_enabled():
            # A graph of this backward is being recorded (create_graph=True, torch.func): the saved
            # states are constants to autograd, so recompute them from the inputs.
            state = None if initial_state is None else initial_state.to(dtype)
            _, _, states = algorithm.forward(torch_ops, *inputs, ctx.scale, state, ctx.chunk_size, ctx.sequences)
        if d_o is None:
            d_o = torch.zeros(v.shape, dtype=dtype, device=v.device)
        d_final = None if d_final_state is None else d_final_state.to(dtype)
        *grads, d_initial = algorithm.backward(
            torch_ops, *inputs, ctx.scale, states, d_o.to(dtype), d_final, ctx.chunk_size, ctx.sequences
        )
        grads = [grad.to(x.dtype) for grad, x in zip(grads, (q, k, v, g, b, w))]
        d_initial = None if initial_state is None else d_initial.to(initial_state.dtype)
        return (*grads, d_initial, None, None, None)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(
            "chunk_gdn2(path=\"chunk\"): forward-mode derivatives (torch.func.jvp, jacfwd, hessian, "
            "torch.autograd.forward_ad) are not implemented on this path; use path=\"reference\""
        )


def _chunk(q, k, v, g, b, w, *, scale, initial_state, chunk_size, sequences):
    o, final_state, _ = ChunkGDN2.apply(q, k, v, g, b, w, initial_state, scale, chunk_size, sequences)
    return o, final_state


def check_not_inference(arrays: dict) -> None:
    """Inference tensors (made under ``torch.inference_mode()``) cannot be saved for a backward
    pass: with gradients recorded for another input, name the argument (torch's own error does not)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return  # torch.compile cannot trace the inference-mode queries (a graph break), nor needs them
    given = {name: x for name, x in arrays.items() if isinstance(x, torch.Tensor)}
    learning = [name for name, x in given.items() if x.requires_grad]
    if not learning:
        return
    for name, x in given.items():
        if x.is_inference():
            raise ValueError(
                f"{name}: expected a normal tensor, since gradients are recorded ({learning[0]} requires grad), "
                f"received an inference tensor (made under torch.inference_mode()); pass {name}.clone() made "
                "outside inference mode, or call under torch.inference_mode() or torch.no_grad()"
            )


def _off_cuda(q) -> str | None:
    if q.device.type == "cuda":
        return None
    return f"tensors on {q.device.type} (the Triton interpreter runs only when forced)"


# The interpreter's verdict, probed once per process: None (it runs the kernels) or why not.
_interpreter_probe: list[str | None] = []


def interpreter_problem() -> str | None:
    """Whether the Triton interpreter can run the kernels here: None, or why not.

    It fails with some Triton and numpy versions (Triton 3.6 with numpy 2.4: "only 0-dimensional
    arrays can be converted to Python scalars"); Triton >= 3.9 works. Probed once per process by
    running the kernels forward and backward on one token, in a thread of its own (so that the
    caller's no_grad, inference mode or torch.func transforms do not apply to it).
    """
    if not _interpreter_probe:
        result: list[str | None] = []
        thread = threading.Thread(target=lambda: result.append(_probe_interpreter()), daemon=True)
        thread.start()
        thread.join()
        _interpreter_probe.append(result[0] if result else "the Triton interpreter probe did not finish")
    return _interpreter_probe[0]


def _probe_interpreter() -> str | None:
    import numpy
    import triton as triton_package

    from . import triton

    try:
        x = [torch.full((1, 1, 1, 16), 0.5, requires_grad=True) for _ in range(6)]
        o, _ = triton.triton_gdn2(*x, scale=0.25, initial_state=None, output_final_state=False)
        torch.autograd.grad(o.sum(), x)
    except Exception as error:  # any failure means the kernels cannot run here
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return (
            f"the Triton interpreter fails here (triton {triton_package.__version__}, numpy {numpy.__version__}: "
            f"{type(error).__name__}: {message}); it needs triton>=3.9 (pip install 'gdn2[interpreter]')"
        )
    return None


def _triton_unsupported_reason(q, k, v, g, b, w, initial_state=None, chunk_size: int = 64) -> str | None:
    """The kernels' own reasons, then (CPU tensors: the interpreter) whether it runs here at all."""
    from . import triton

    reason = triton.unsupported_reason(q, k, v, g, b, w, initial_state, chunk_size)
    if reason is None and q.device.type != "cuda":
        reason = interpreter_problem()
    return reason


def _triton_backend() -> KernelBackend:
    from . import triton

    return KernelBackend(
        name="Triton kernel",
        unsupported_reason=_triton_unsupported_reason,
        call=triton.triton_gdn2,
        failures=triton.KERNEL_FAILURES,
        automatic_reason=_off_cuda,
        packed=True,
    )


TORCH = Framework(name="torch", ops=torch_ops, kernel_name="Triton kernel", load_kernel=_triton_backend, chunk=_chunk,
                  tracing=torch.compiler.is_compiling)


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
        g: ``[B, T, H, K]`` per-channel log decay (natural log, ``<= 0``); q's dtype, or float32
            beside bfloat16 or float16 inputs.
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
    check_not_inference(dict(q=q, k=k, v=v, g=g, b=b, w=w, initial_state=initial_state))
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
    check_not_inference(dict(q=q, k=k, v=v, g=g, b=b, w=w, initial_state=initial_state))
    return paths.run_recurrent(
        TORCH, q, k, v, g, b, w, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens,
    )
