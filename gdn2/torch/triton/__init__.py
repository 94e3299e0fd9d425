"""The Triton kernel path of ``gdn2.torch.chunk_gdn2``.

``unsupported_reason`` says whether the kernels can run a call; ``triton_gdn2`` runs it through two
PyTorch custom operators (with their autograd) built from these launches:

    forward:  intra_forward (parallel: diagonal tiles, the rest of P and the inverse X, decays
              and WY products) -> state_forward (sequential over chunks) -> output (parallel)
    backward: state_backward (sequential, reverse) -> in-chunk backward (parallel): contractions
              (chunks x key blocks) -> values (chunks) -> keys (sub-blocks x key blocks, then
              dg's sums over each chunk)

``docs/triton.md`` has the design, the numerics and what was measured. The kernels use chunks of
64 tokens; another ``chunk_size`` is a reason they cannot run the call.

Matrix products run in float32 accumulation. On a GPU, the large products use TF32 by default
(``GDN2_TRITON_DOT=tf32``); ``tf32x3`` or ``ieee`` trade speed for float32-exact products. The
inverse of ``I + A`` is made of 16x16 products in that precision too (its diagonal tiles by
recursive doubling, the others by the blocked formula). Under the Triton
interpreter (``TRITON_INTERPRET=1``, CPU tensors) every product is exact float32. With bfloat16
inputs, the saved buffers named in ``SAVED_IN_BFLOAT16`` (by default the chunk states, the decayed
queries and keys, Wk and U) are kept in bfloat16, and so is the backward's gradient of the chunk
states (``GRADIENTS_IN_BFLOAT16``).
"""

from __future__ import annotations

import functools
import os

import torch
from triton.errors import TritonError

from .backward import intra_backward_contract, intra_backward_keys, intra_backward_values, state_backward
from ...packing import SequenceOffsets
from .forward import CHUNK, TILES, intra_forward, output, state_forward
from .interpreter import correct_interpreter

# What a kernel failure raises: TritonError covers compilation (CompilationError), shared memory
# or registers (OutOfResources), ptxas (PTXASError) and the interpreter (InterpreterError); a CUDA
# launch failure ("Triton Error [CUDA]: ...") and torch.cuda.OutOfMemoryError are RuntimeErrors.
KERNEL_FAILURES = (TritonError, RuntimeError)

MAX_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if _interpreting():  # the layer's kernels (conv, norm, gates) run as the GPU would, too
    correct_interpreter()


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
    T, H = q.shape[1], q.shape[2]
    if T * H * max(K, V) >= 2 ** 31:  # offsets inside a batch row (or a packed batch) are int32 in the kernels
        return f"T*H*max(K, V) = {T}*{H}*{max(K, V)} >= 2^31: the kernels address a batch row with 32-bit offsets"
    return None


# The kernels run inside PyTorch custom operators (``gdn2::triton_forward``,
# ``gdn2::triton_backward``) with their autograd and fake (shape-only) implementations registered,
# so that torch.compile sees two opaque operators instead of breaking its graph at each launch.
SAVED = ("qd", "kd", "gamma", "Wk", "Uw", "Uw_scale", "P", "inverse", "states", "U")
# Saved buffers kept in bfloat16 when the inputs are bfloat16 (half the bytes written and read);
# the others stay float32. Any of SAVED but gamma and Uw_scale may be named here: the kernels
# compute in float32 and round on the store; a product whose operands are both bfloat16 as saved
# runs on them as they are (exact), the others widen what they read to float32. Measured against
# the float64 spec on bfloat16 inputs, the same draws for every choice (bench/saved_precision.py,
# bench/RESULTS.md):
# the chunk states, qd, kd and Wk (and the inverse) change no error visibly; U raises o's own
# error 1.3x (o against the spec on the unrounded inputs 3.64e-3 -> 3.99e-3, flash-linear-attention's
# 4.40e-3) and leaves the states and gradients as they were (the state pass updates the state on
# U before its rounding); it took the forward from 2.054 / 2.302 / 2.149 ms to 2.005 / 2.269 /
# 2.081 at the three shapes of bench/triton_h200.py (H200). Uw raises the worst gradient's error
# (5.0e-3 -> 6.1e-3, db; over 18 draws beside fla, the largest 9.60e-3 against fla's 8.99e-3).
# P raises o's error about 1.06x (the paired study's first shape, four seeds: 3.94-4.03e-3 ->
# 4.24-4.28e-3; fla's 4.40e-3 at the GPU check's draws) and leaves every gradient as it was (the
# reverse pass rounds P for its product anyway); the output and the reverse pass read half its
# bytes: H100, B=8 T=4096 H=16 K=V=128, the output launch 0.278 -> 0.246 ms, the forward 2.01 ->
# 1.96 (bench/RESULTS.md). The inverse X, with b k exp(G) in Wk's buffer (forward.py's
# DECAYED_ERASE_KEYS_IN_WK): the WY products on both as stored, forward 1.96 -> 1.87 ms, errors
# over 18 CPU draws as before.
# float16 inputs keep every buffer in float32 (a state entry may pass float16's 65504).
SAVED_IN_BFLOAT16 = ("states", "qd", "kd", "Wk", "U", "P", "inverse")
# With bfloat16 inputs and Uw not named above, Uw saved in float16 over its largest magnitude per
# chunk and value column (``Uw_scale``, float32; 1 where Uw is not float16): half the bytes of
# float32 whatever Uw's range, rounded to 2^-11 of each value (of the column's largest below 2^-14
# of it, float16's subnormals) where bfloat16 rounds to 2^-8. Over 18 draws against the spec, each
# draw's worst error 0.93-1.02x float32's (bench/RESULTS.md); on an H100 the forward 2.074 -> 2.025
# ms and forward+backward 8.334 -> 8.247 at B=8 T=4096 H=16 K=V=128.
UW_IN_FLOAT16 = True


# The backward's own buffers kept in bfloat16 when the inputs are bfloat16: "d_leaving" (the
# state's gradient leaving each chunk, [B, H, N, K, V]: the largest buffer of the backward) and
# "d_U" (the gradient of U), as flash-linear-attention keeps both. The reverse pass holds both in
# float32 and rounds them on the store only, so the rounding does not feed back through the
# chunks. Under the interpreter (bench/RESULTS.md, 18 draws beside fla): d_leaving moves only dk's
# and dg's errors (1.14x and 1.09x the float32 buffer's, median; each draw's worst error within
# the spread it had, the largest unchanged, below fla's), d_U db's up to 1.9x. d_leaving alone was
# no faster on the H200 (8.551 against 8.547 ms forward+backward); with the contraction's products
# on it as stored (INTRA_BACKWARD_BFLOAT16_PRODUCTS in backward.py) forward+backward went from
# 8.327 to 8.027 ms at B=8 T=4096 H=16 K=V=128 and from 7.952 to 7.720 at B=16 T=2048 H=32 K=V=64.
# d_U too: 7.862 -> 7.707 and 7.715 -> 7.599 on an H100 (2026-12-06, repeatable since the
# contraction's mend, contract_stages in backward.py), db's error as above (each draw's worst
# error at or below fla's at 12 of 18 draws, against 15 with d_U in float32): not the default.
GRADIENTS_IN_BFLOAT16: tuple[str, ...] = ("d_leaving",)


def _gradient_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the backward buffer ``name`` ("d_leaving" or "d_U") for inputs of ``dtype``."""
    if not set(GRADIENTS_IN_BFLOAT16) <= {"d_leaving", "d_U"}:
        raise ValueError(f"GRADIENTS_IN_BFLOAT16: expected names among 'd_leaving' and 'd_U', received "
                         f"{GRADIENTS_IN_BFLOAT16!r}")
    return torch.bfloat16 if dtype == torch.bfloat16 and name in GRADIENTS_IN_BFLOAT16 else torch.float32


def _saved_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    """The dtype of each saved buffer (order of ``SAVED``) for inputs of ``dtype``."""

    def saved_dtype(name):
        if dtype != torch.bfloat16:
            return torch.float32
        if name in SAVED_IN_BFLOAT16:
            return torch.bfloat16
        return torch.float16 if name == "Uw" and UW_IN_FLOAT16 else torch.float32

    return [saved_dtype(name) for name in SAVED]


def _saved_shapes(B: int, N: int, H: int, K: int, V: int) -> list[tuple[int, ...]]:
    """Shapes of the forward's saved buffers for N chunks per batch row, in the order of ``SAVED``
    (padded chunks)."""
    rows = N * CHUNK
    return [(B, H, rows, K)] * 2 + [(B, H, N, K), (B, H, rows, K), (B, H, rows, V), (B, H, N, V)] + [
        (B, H, N, TILES, 16, 16)] * 2 + [(B, H, N, K, V), (B, H, rows, V)]


def _chunks_and_rows(q, chunk_table, sequence_chunks) -> tuple[int, int]:
    """Chunks per batch row and rows of the recurrent state: with packed sequences, the chunk
    table's length and the number of sequences (the tokens are one batch row)."""
    if chunk_table is None:
        return -(-q.shape[1] // CHUNK), q.shape[0]
    return chunk_table.shape[0], sequence_chunks.shape[0] - 1


@torch.library.custom_op("gdn2::triton_forward", mutates_args=())
def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
    initial_state: torch.Tensor | None, scale: float, chunk_table: torch.Tensor | None,
    sequence_chunks: torch.Tensor | None,
) -> list[torch.Tensor]:
    """``[o, final_state, *saved]``: the output, the final state and the buffers the backward reads.
    Packed sequences: ``chunk_table`` ``[chunks, 2]`` int32 (first token, length) and
    ``sequence_chunks`` ``[sequences + 1]`` int32 (each sequence's first chunk), or both None."""
    q, k, v, g, b, w = (x.contiguous() for x in (q, k, v, g, b, w))
    B, T, H, K = q.shape
    V = v.shape[-1]
    N, rows = _chunks_and_rows(q, chunk_table, sequence_chunks)
    precision = _dot_precision(q.device)
    if q.device.type == "cpu":
        correct_interpreter()
    qd, kd, gamma, Wk, Uw, Uw_scale, P, inverse, states, U = (
        torch.empty(shape, dtype=dtype, device=q.device)
        for shape, dtype in zip(_saved_shapes(B, N, H, K, V), _saved_dtypes(q.dtype))
    )
    first_bad = torch.empty(B, H, N, V, dtype=torch.int32, device=q.device)
    intra_forward(q, k, v, g, b, w, qd, kd, Wk, Uw, Uw_scale, gamma, P, inverse, first_bad, precision, chunk_table)
    initial = None if initial_state is None else initial_state.contiguous()
    final_state = torch.empty(rows, H, K, V, dtype=torch.float32, device=q.device)
    state_forward(Wk, kd, Uw, Uw_scale, gamma, first_bad, initial, states, U, final_state, precision,
                  sequence_chunks)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    output(qd, P, states, U, first_bad, o, scale, precision, chunk_table)
    return [o, final_state, qd, kd, gamma, Wk, Uw, Uw_scale, P, inverse, states, U]


@_forward.register_fake
def _forward_shapes(q, k, v, g, b, w, initial_state, scale, chunk_table, sequence_chunks):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N, rows = _chunks_and_rows(q, chunk_table, sequence_chunks)
    o = q.new_empty(B, T, H, V)
    final_state = q.new_empty(rows, H, K, V, dtype=torch.float32)
    return [o, final_state] + [
        q.new_empty(shape, dtype=dtype) for shape, dtype in zip(_saved_shapes(B, N, H, K, V), _saved_dtypes(q.dtype))]


@torch.library.custom_op("gdn2::triton_backward", mutates_args=())
def _backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
    saved: list[torch.Tensor], d_o: torch.Tensor, d_final: torch.Tensor | None, scale: float, has_initial: bool,
    chunk_table: torch.Tensor | None, sequence_chunks: torch.Tensor | None,
) -> list[torch.Tensor]:
    """``[dq, dk, dv, dg, db, dw, d_initial]`` (d_initial empty without an initial state)."""
    qd, kd, gamma, Wk, Uw, Uw_scale, P, inverse, states, U = saved
    # The kernels index inputs and gradients as contiguous [B, T, H, D]; autograd hands back the
    # inputs as they were given (a transposed or sliced view is not contiguous).
    q, k, v, g, b, w = (x.contiguous() for x in (q, k, v, g, b, w))
    B, T, H, K = q.shape
    V = v.shape[-1]
    precision = _dot_precision(q.device)
    if q.device.type == "cpu":
        correct_interpreter()
    d_o = d_o.contiguous()
    d_final = None if d_final is None else d_final.to(torch.float32).contiguous()
    d_leaving, d_U = (torch.empty(x.shape, device=q.device, dtype=_gradient_dtype(name, q.dtype))
                      for name, x in (("d_leaving", states), ("d_U", U)))
    _, rows = _chunks_and_rows(q, chunk_table, sequence_chunks)
    d_initial = torch.empty(rows, H, K, V, dtype=torch.float32, device=q.device) if has_initial else q.new_empty(0)
    state_backward(qd, kd, Wk, gamma, P, d_o, d_final, d_leaving, d_U, d_initial if has_initial else None, scale,
                   precision, chunk_table, sequence_chunks)
    # Each buffer is dropped once its last reader ran, so that the gradients reuse its memory.
    contractions = intra_backward_contract(states, U, d_o, d_leaving, d_U, inverse, scale, precision, chunk_table)
    del d_leaving
    dv, dw, d_A, d_P = intra_backward_values(v, w, Wk, Uw, Uw_scale, inverse, U, d_o, d_U, contractions[2], scale,
                                             precision, chunk_table)
    del d_U
    dq, dk, dg, db = intra_backward_keys(q, k, g, b, *contractions, d_A, d_P, gamma, precision, chunk_table)
    return [dq, dk, dv, dg, db, dw, d_initial]


@_backward.register_fake
def _backward_shapes(q, k, v, g, b, w, saved, d_o, d_final, scale, has_initial, chunk_table, sequence_chunks):
    B, T, H, K = q.shape
    V = v.shape[-1]
    _, rows = _chunks_and_rows(q, chunk_table, sequence_chunks)
    d_initial = q.new_empty(rows, H, K, V, dtype=torch.float32) if has_initial else q.new_empty(0)
    return [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, g, b, w)] + [d_initial]


def _setup_context(ctx, inputs, output):
    q, k, v, g, b, w, initial_state, scale, chunk_table, sequence_chunks = inputs
    # The saved buffers are outputs nobody differentiates: without this, autograd would fill a
    # zero gradient for each of them (their full size in memory and time).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, b, w, chunk_table, sequence_chunks, *output[2:])
    ctx.scale = scale
    ctx.has_initial = initial_state is not None


LAYER_INSTEAD = "use GatedDeltaNet2(use_kernels=False) or GDN2_LAYER_KERNELS=0 for them"


def refuse_higher_order(what: str, instead: str) -> None:
    """Raise in a kernel's backward when that backward is itself being differentiated
    (``create_graph=True``): the kernels' gradients would be constants to autograd."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what}: higher-order gradients (a graph of the backward, create_graph=True) are not "
                           f"supported on this path; {instead}")


def _differentiate(ctx, grads):
    refuse_higher_order('chunk_gdn2(path="kernel")', 'use path="reference" (or path="chunk") for them')
    d_o, d_final = grads[0], grads[1]
    q, k, v, g, b, w, chunk_table, sequence_chunks, *saved = ctx.saved_tensors
    if d_o is None:
        d_o = torch.zeros_like(v)
    dq, dk, dv, dg, db, dw, d_initial = _backward(q, k, v, g, b, w, saved, d_o, d_final, ctx.scale, ctx.has_initial,
                                                  chunk_table, sequence_chunks)
    return dq, dk, dv, dg, db, dw, (d_initial if ctx.has_initial else None), None, None, None


_forward.register_autograd(_differentiate, setup_context=_setup_context)


def triton_gdn2(q, k, v, g, b, w, *, scale: float, initial_state, output_final_state: bool,
                sequences: SequenceOffsets | None = None):
    """GDN-2 through the Triton kernels.

    Args: q, k, g, b ``[B, T, H, K]`` and v, w ``[B, T, H, V]`` (float16, bfloat16 or float32, one
    dtype); ``scale`` resolved; ``initial_state`` ``[B, H, K, V]`` float32 or None (zeros, no
    gradient). ``sequences``: packed sequences along T (B is 1), run natively: every sequence
    starts a chunk of its own, the state restarts there, and ``initial_state`` and the final state
    have one row per sequence.

    Returns ``(o [B, T, H, V] in q's dtype, final_state [B, H, K, V] float32 or None)``;
    differentiable in q, k, v, g, b, w and initial_state, including through final_state.
    """
    chunk_table = sequence_chunks = None
    if sequences is not None:
        chunk_table, sequence_chunks = _packed_tables(sequences, q.device)  # built once per offsets and device
    o, final_state, *_ = _forward(q, k, v, g, b, w, initial_state, float(scale), chunk_table, sequence_chunks)
    return o, (final_state if output_final_state else None)


@functools.lru_cache(maxsize=64)
def _packed_tables(sequences: SequenceOffsets, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk table (first token, length per chunk) and each sequence's first chunk, int32 on
    ``device``; kept, so that the layers of a model share one copy per step (read-only)."""
    table = sequences.chunk_table(CHUNK)
    ranges = sequences.chunk_layout(CHUNK).chunk_ranges
    first_chunks = [first for first, _ in ranges] + [ranges[-1][1] if ranges else 0]
    return (torch.as_tensor(table, dtype=torch.int32).reshape(-1, 2).to(device),
            torch.tensor(first_chunks, dtype=torch.int32).to(device))
