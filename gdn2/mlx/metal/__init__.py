"""Metal kernels for GDN-2 on Apple GPUs: a per-value-column scan with chunk checkpoints.

Design
------
Per (batch, head) the operator is a scan over T steps of a ``[K, V]`` state in which every value
column ``S[:, j]`` evolves independently given the key-side vectors of the step::

    erased_j = sum_k b_k k_k a_k S_kj      a = exp(g_t)
    u_j      = w_j v_j - erased_j
    S_kj    <- a_k S_kj + k_k u_j
    o_j      = scale * sum_k q_k S_kj

so the kernels run one threadgroup per (batch*head, value tile), one simdgroup per state column
(key channels spread over the 32 lanes, sums over K by ``simd_sum``), and stage the key-side
vectors of a block of steps once per threadgroup in threadgroup memory.

Counted per token and head (K = V = 128, 2-byte inputs; a multiply-add is 2 FLOP):

* forward: 3 multiply-adds over the [K, V] state (erase read, update, output read) = 6KV = 98
  kFLOP; bytes moved: inputs 4K + 2V elements and the output V, (4K + 3V) * 2 = 1.8 kB:
  about 55 FLOP/byte, above the ridge point of every Apple GPU (M1..M4: 2.6-28 TFLOP/s fp32 over
  68-800 GB/s, i.e. 25-40 FLOP/byte), so the scan is compute bound and keeping the state in
  registers (K*V*4 = 64 kB per head, spread over the simdgroups of the groups) is what matters.
  The chunked WY form spends about 6KV + 4CK + 4CV FLOP (1.7x at C = 64) to turn the work into
  matrix products; simdgroup_matrix on Apple GPUs gains well under that over scalar FMA for
  these small tiles, so the exact scan is a fair first design. It also has no exp(G_i - G_j)
  factorisation at all: every exponent is one step's g <= 0, so any g in [-20, 0] is exact, and
  decode (T == 1) is the same kernel with one step and no checkpoints.
* backward: the vjp reruns the forward writing the state entering every chunk of C steps
  (checkpoints, ``B*H*ceil(T/C)*K*V*4`` bytes, what the chunk path keeps too; 6KV FLOP); the
  backward kernel walks the chunks in reverse, replays each from its checkpoint (4KV) into a
  per-group scratch (``B*H*C*K*V*4`` bytes; each element written and read back by the same
  lane, so no barrier) and applies the adjoint of every step (about 20KV: recompute D, u, S_t;
  dq, dS, du, dk, d(bk), dD, dg, the decay). forward+backward is about 36KV FLOP per token and
  head. The scratch costs 8KV bytes per token (128 kB here), about 4 FLOP/byte if it spills to
  DRAM: the backward is bandwidth bound unless the scratch of a group (C*K*tile*4 bytes) stays
  in the GPU caches, so small C is faster here (C = 16: 384 kB per group). Holding sub-chunk
  states in registers is the known next step.
  Key-side gradients (dq, dk, dg, db) are sums over value columns: lanes sum their columns,
  the group sums its simdgroups in threadgroup memory, and the (few) value tiles are summed by
  MLX (``key_partials`` [4, tiles, B, T, H, K]); no atomics, so results are deterministic.

Limits: K, V <= 256 (K is spread over 32 lanes, at most 8 channels each); float32, float16 and
bfloat16 inputs, float32 state and float32 arithmetic; float64 goes to the chunk path.

Testing without Apple hardware: every launch goes through ``launcher`` (a function of a
``KernelLaunch``); ``use_launcher`` swaps it, and ``tests/metal_harness`` provides one that
compiles the exact source MLX generates with g++ against a shim header and runs it on the CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterator

import mlx.core as mx

from .scan_source import (
    BACKWARD_INPUTS,
    BACKWARD_OUTPUTS,
    BACKWARD_SOURCE,
    FORWARD_INPUTS,
    FORWARD_OUTPUTS,
    FORWARD_SOURCE,
)

__all__ = ["unsupported_reason", "metal_gdn2", "KernelLaunch", "use_launcher", "Geometry", "use_geometry"]

# What a kernel failure raises: MLX reports a Metal library that fails to build or a launch that
# fails as RuntimeError, and ``metal_gdn2`` raises any failure of ``probe`` as RuntimeError.
KERNEL_FAILURES = (RuntimeError,)

MAX_KEY_DIM = 256
MAX_VALUE_DIM = 256
SIMD_WIDTH = 32
_THREADGROUP_FLOATS = 7168  # 28 kB of the 32 kB of threadgroup memory


@dataclass(frozen=True)
class Geometry:
    """Threadgroup shape: ``simdgroups`` per group, each owning ``columns`` value columns."""

    simdgroups: int
    columns: int

    @property
    def tile(self) -> int:
        return self.simdgroups * self.columns


def forward_geometry(K: int, V: int) -> Geometry:
    """4 simdgroups x 2 columns: small tiles keep many groups in flight, also for decode."""
    return Geometry(4, 2)


def backward_geometry(K: int, V: int) -> Geometry:
    """Wide tiles (few partial sums to add); the reduction buffer must fit threadgroup memory."""
    simdgroups = max(1, min(8, (_THREADGROUP_FLOATS - 4 * K) // (4 * K)))
    return Geometry(simdgroups, min(8, -(-V // simdgroups)))


_geometry_override: dict[str, Geometry] = {}


@contextlib.contextmanager
def use_geometry(forward: Geometry | None = None, backward: Geometry | None = None) -> Iterator[None]:
    """Force threadgroup shapes (tests use small ones so that several value tiles appear)."""
    saved = dict(_geometry_override)
    if forward is not None:
        _geometry_override["forward"] = forward
    if backward is not None:
        _geometry_override["backward"] = backward
    try:
        yield
    finally:
        _geometry_override.clear()
        _geometry_override.update(saved)


@dataclass
class KernelLaunch:
    """Everything one ``mx.fast.metal_kernel`` call needs; a launcher turns it into outputs."""

    name: str
    source: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    inputs: list
    template: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list
    output_dtypes: list
    kernel: object = field(default=None, repr=False)

    def call(self, verbose: bool = False) -> list:
        """Launch through MLX (on a Mac: compile the Metal library and dispatch)."""
        return self.kernel(
            inputs=self.inputs,
            template=self.template,
            grid=self.grid,
            threadgroup=self.threadgroup,
            output_shapes=self.output_shapes,
            output_dtypes=self.output_dtypes,
            verbose=verbose,
        )


def _launch_with_mlx(launch: KernelLaunch) -> list:
    return launch.call()


launcher: Callable[[KernelLaunch], list] = _launch_with_mlx


@contextlib.contextmanager
def use_launcher(run: Callable[[KernelLaunch], list]) -> Iterator[None]:
    """Route every kernel launch of this module through ``run`` (the CPU harness in tests)."""
    global launcher
    saved = launcher
    launcher = run
    try:
        yield
    finally:
        launcher = saved


@lru_cache(maxsize=None)
def metal_kernel(name: str, source: str, input_names: tuple[str, ...], output_names: tuple[str, ...]):
    return mx.fast.metal_kernel(
        name=name, input_names=list(input_names), output_names=list(output_names), source=source
    )


def unsupported_reason(q, k, v, g, b, w, initial_state=None, chunk_size: int = 64) -> str | None:
    """None when the Metal kernels can run these arguments, else a short reason."""
    try:
        available = mx.metal.is_available()
    except Exception:  # an MLX build without the metal module
        available = False
    if not available:
        return "Metal is not available on this machine"
    K, V = q.shape[-1], v.shape[-1]
    if K > MAX_KEY_DIM:
        return f"K={K} > {MAX_KEY_DIM}"
    if V > MAX_VALUE_DIM:
        return f"V={V} > {MAX_VALUE_DIM}"
    if q.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        return f"{q.dtype} inputs (the Metal kernels take float32, float16 and bfloat16)"
    return None


def _template(dtype, H: int, K: int, V: int, geometry: Geometry, checkpoint: int, block: int, save: bool) -> list:
    return [
        ("InT", dtype),
        ("H", H),
        ("K", K),
        ("V", V),
        ("KPL", -(-K // SIMD_WIDTH)),
        ("NS", geometry.simdgroups),
        ("CPS", geometry.columns),
        ("C", checkpoint),
        ("L", block),
        ("SAVE", save),
    ]


def forward_launch(q, k, v, g, b, w, state0, scale: float, chunk_size: int, save: bool,
                   source: str = FORWARD_SOURCE, name: str = "gdn2_forward") -> KernelLaunch:
    """The forward launch: o [B,T,H,V] (q's dtype), final state and checkpoints (float32).

    ``checkpoints`` is ``[B, H, ceil(T / C), K, V]`` (the state entering each chunk of C steps)
    when ``save``, else a 1-element placeholder.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    geometry = _geometry_override.get("forward") or forward_geometry(K, V)
    checkpoint = max(1, min(chunk_size, T))
    block = max(1, min(16, 1024 // K))
    tiles = -(-V // geometry.tile)
    meta = mx.array([T, B, tiles], dtype=mx.int32)
    scale_array = mx.array([scale], dtype=mx.float32)
    checkpoints_shape = (B, H, -(-T // checkpoint), K, V) if save else (1,)
    threads = SIMD_WIDTH * geometry.simdgroups
    return KernelLaunch(
        name=name,
        source=source,
        input_names=FORWARD_INPUTS,
        output_names=FORWARD_OUTPUTS,
        inputs=[q, k, v, g, b, w, state0, meta, scale_array],
        template=_template(q.dtype, H, K, V, geometry, checkpoint, block, save),
        grid=(threads, tiles, B * H),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, H, V), (B, H, K, V), checkpoints_shape],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
        kernel=metal_kernel(name, source, FORWARD_INPUTS, FORWARD_OUTPUTS),
    )


def backward_launch(q, k, v, g, b, w, d_o, d_final, checkpoints, scale: float, chunk_size: int,
                    source: str = BACKWARD_SOURCE, name: str = "gdn2_backward") -> KernelLaunch:
    """The backward launch; outputs (all float32): key_partials [4, tiles, B, T, H, K]
    (dq, sum_j dS*u, dg, d(b*k) per value tile), d_v, d_w [B, T, H, V], d_state0 [B, H, K, V]
    and the replay scratch [B, H, C, K, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    geometry = _geometry_override.get("backward") or backward_geometry(K, V)
    checkpoint = max(1, min(chunk_size, T))
    tiles = -(-V // geometry.tile)
    meta = mx.array([T, B, tiles], dtype=mx.int32)
    scale_array = mx.array([scale], dtype=mx.float32)
    threads = SIMD_WIDTH * geometry.simdgroups
    return KernelLaunch(
        name=name,
        source=source,
        input_names=BACKWARD_INPUTS,
        output_names=BACKWARD_OUTPUTS,
        inputs=[q, k, v, g, b, w, d_o, d_final, checkpoints, meta, scale_array],
        template=_template(q.dtype, H, K, V, geometry, checkpoint, 1, False),
        grid=(threads, tiles, B * H),
        threadgroup=(threads, 1, 1),
        output_shapes=[(4, tiles, B, T, H, K), (B, T, H, V), (B, T, H, V), (B, H, K, V), (B, H, checkpoint, K, V)],
        output_dtypes=[mx.float32] * 5,
        kernel=metal_kernel(name, source, BACKWARD_INPUTS, BACKWARD_OUTPUTS),
    )


@lru_cache(maxsize=None)
def _kernel_function(scale: float, chunk_size: int):
    """One ``mx.custom_function`` per (scale, chunk_size): (o, final_state) of the 7 arrays."""

    @mx.custom_function
    def gdn2_metal(q, k, v, g, b, w, state0):
        o, final_state, _ = launcher(forward_launch(q, k, v, g, b, w, state0, scale, chunk_size, save=False))
        return o, final_state

    @gdn2_metal.vjp
    def gdn2_metal_vjp(primals, cotangents, outputs):
        q, k, v, g, b, w, state0 = primals
        d_o, d_final = cotangents
        if d_o is None:
            d_o = mx.zeros(v.shape, dtype=q.dtype)
        if d_final is None:
            d_final = mx.zeros(state0.shape, dtype=mx.float32)
        _, _, checkpoints = launcher(forward_launch(q, k, v, g, b, w, state0, scale, chunk_size, save=True))
        key_partials, d_v, d_w, d_state0, _ = launcher(
            backward_launch(q, k, v, g, b, w, d_o.astype(q.dtype), d_final.astype(mx.float32), checkpoints,
                            scale, chunk_size)
        )
        parts = key_partials.sum(axis=1)
        b32, k32 = b.astype(mx.float32), k.astype(mx.float32)
        d_q, d_k, d_g, d_b = parts[0], parts[1] + parts[3] * b32, parts[2], parts[3] * k32
        grads = [grad.astype(x.dtype) for grad, x in zip((d_q, d_k, d_v, d_g, d_b, d_w), (q, k, v, g, b, w))]
        return (*grads, d_state0.astype(state0.dtype))

    return gdn2_metal


_probed: dict[tuple, str | None] = {}


def probe(dtype, H: int, K: int, V: int, T: int, chunk_size: int) -> str | None:
    """Compile and launch both kernels once, eagerly, for this configuration; None if they ran.

    MLX builds a Metal library at evaluation time, long after ``chunk_gdn2`` returned a lazy
    graph, so a compile or launch failure would surface in the caller's ``mx.eval``. Launching
    the very same instantiations (every template argument equal) on one tiny (B=1, T=C) problem
    here turns that failure into an exception the path selection can catch. Cached per
    configuration and launcher.
    """
    checkpoint = max(1, min(chunk_size, T))
    key = (str(dtype), H, K, V, checkpoint, launcher, tuple(sorted(_geometry_override.items())))
    if key not in _probed:
        try:
            ones = mx.full((1, checkpoint, H, K), 0.5, dtype=dtype)
            values = mx.full((1, checkpoint, H, V), 0.5, dtype=dtype)
            state = mx.zeros((1, H, K, V), dtype=mx.float32)
            outputs = launcher(forward_launch(ones, ones, values, -ones, ones, values, state, 1.0, chunk_size, True))
            outputs += launcher(backward_launch(ones, ones, values, -ones, ones, values, values, state, outputs[2],
                                                1.0, chunk_size))
            mx.eval(outputs)
            _probed[key] = None
        except Exception as error:
            _probed[key] = f"{type(error).__name__}: {error}"
    return _probed[key]


def metal_gdn2(q, k, v, g, b, w, *, scale: float, initial_state, output_final_state: bool, checkpoint_interval: int = 64):
    """GDN-2 on the Metal kernels.

    q, k, g, b ``[B, T, H, K]``; v, w ``[B, T, H, V]`` (float32, float16 or bfloat16, already
    validated); ``initial_state`` float32 ``[B, H, K, V]`` or None (zeros). ``checkpoint_interval``:
    steps between the states the backward replays from (the scan has no chunks; this is not the
    ``chunk_size`` of the chunked form). Returns ``(o [B, T, H, V] in q's dtype, final_state
    float32 [B, H, K, V] or None)``; differentiable in every input and in ``initial_state``
    through ``mx.custom_function``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    failure = probe(q.dtype, H, K, V, T, checkpoint_interval)
    if failure is not None:
        raise RuntimeError(f"Metal kernel failed to compile or launch: {failure}")
    state0 = mx.zeros((B, H, K, V), dtype=mx.float32) if initial_state is None else initial_state.astype(mx.float32)
    o, final_state = _kernel_function(float(scale), int(checkpoint_interval))(q, k, v, g, b, w, state0)
    return o, (final_state if output_final_state else None)
