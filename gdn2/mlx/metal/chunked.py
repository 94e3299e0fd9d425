"""Chunked (WY) GDN-2 on Metal: launchers and the two passes (``dispatch.py`` makes them one
differentiable function).

The kernels (``chunked_source.py``) follow ``gdn2/algorithm.py`` with chunks of ``C = 32`` steps
and 8x8 ``simdgroup_matrix`` tiles:

    forward    INTRA (P, (I + A)^-1 per chunk, parallel) -> FORWARD (sequential over chunks per
               value tile: o, final state)
    backward   INTRA -> FORWARD saving the state entering each chunk and U -> STATE_BACKWARD
               (reverse over chunks per value tile: dS per chunk, Z = (I + A)^-T dU, dv, dw, the
               initial state's gradient) -> BACKWARD (parallel over chunks: dq, dk, dg, db)

Counted cost (``cost.chunked_cost``; ESTIMATES, nothing here was measured: no Mac was available).
Per token and head at K = V = 128, bf16 inputs, C = 32, a multiply-add counted as 2 FLOP, bytes
of device memory (re-reads by other threadgroups assumed to hit the caches), and the estimated
time at B=8 T=4096 H=16 on an M3 Max (40-core GPU, 14.2 TFLOP/s fp32, 400 GB/s; the 8x8 matrix
tiles assumed to run at half of the fp32 peak):

    kernel                         kFLOP   bytes    est. ms   threadgroup memory  registers/thread (est.)
    INTRA                           12.2    1280     1.7      28.7 kB             ~40
    FORWARD                        114.7    2048     8.5      17.5 kB             ~75 (K=128), ~105 (K=256)
    FORWARD saving states and U    114.7    4608     8.5      17.5 kB             as FORWARD
    STATE_BACKWARD                 114.7    5120     8.5      16.5 kB             as FORWARD
    BACKWARD                       141.8    7424    10.5      27.7 kB             ~45

    ESTIMATED: forward 10.2 ms, forward+backward 39.3 ms at B=8 T=4096 H=16 K=V=128 bf16
    (the scan: 16.5 ms and 107 ms); K=V=256: 35.7 ms and 140 ms.

Registers: FORWARD and STATE_BACKWARD hold the simdgroup's 8 columns of the state as ceil(K / 8)
tiles (2 floats per lane each) plus 2 * C / 8 accumulator tiles; the others hold a few tiles.
Products with a lower-triangular diagonal tile of the forward (the inverse, P) are summed per lane
over k <= i (``lower_multiply_accumulate``), so a bad value at step t reaches no earlier output.
Every kernel runs 128 threads (4 simdgroups); the threadgroup memory above is at C = 32 and
K >= 32 (``threadgroup_bytes``; tests compare it with what the harness measures, all <= 32 KiB).

Memory (training, besides inputs and gradients; ``training_bytes``): states and dS, 2 B H N Kp Vp
floats; U and Z, 2 B H N C Vp; P and the inverse, 2 B H N C^2: 2.6 GiB at B=8 T=4096 H=16
K=V=128, 9.1 GiB at K=V=256 (where ``dispatch.plan`` falls back to the scan's backward if that
exceeds half of the GPU's recommended working set).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from .chunked_source import (
    BACKWARD_INPUTS,
    BACKWARD_OUTPUTS,
    BACKWARD_SOURCE,
    FORWARD_INPUTS,
    FORWARD_OUTPUTS,
    FORWARD_SOURCE,
    HEADER,
    INTRA_INPUTS,
    INTRA_OUTPUTS,
    INTRA_SOURCE,
    STATE_BACKWARD_INPUTS,
    STATE_BACKWARD_OUTPUTS,
    STATE_BACKWARD_SOURCE,
)

__all__ = ["ChunkGeometry", "threadgroup_bytes", "training_bytes", "KERNELS"]

SIMD_WIDTH = 32
THREADGROUP_MEMORY_LIMIT = 32 * 1024
KERNELS = ("intra", "forward", "state_backward", "backward")


@dataclass(frozen=True)
class ChunkGeometry:
    """Chunk length, simdgroups per threadgroup, and key channels staged per block (the
    sequential kernels use ``key_block``, INTRA ``intra_key_block``; BACKWARD always 8)."""

    chunk: int = 32
    simdgroups: int = 4
    key_block: int = 32
    intra_key_block: int = 16

    @property
    def threads(self) -> int:
        return SIMD_WIDTH * self.simdgroups

    @property
    def value_tile(self) -> int:
        return 8 * self.simdgroups


def _round8(x: int) -> int:
    return -(-x // 8) * 8


def geometry_for(K: int, override: ChunkGeometry | None = None) -> ChunkGeometry:
    """The launch geometry: key blocks no wider than the (padded) key dimension."""
    base = override or ChunkGeometry()
    return ChunkGeometry(base.chunk, base.simdgroups, min(base.key_block, _round8(K)),
                         min(base.intra_key_block, _round8(K)))


def threadgroup_bytes(kernel: str, K: int, geometry: ChunkGeometry) -> int:
    """Threadgroup memory one threadgroup of ``kernel`` declares (mirrors the sources)."""
    C = geometry.chunk
    right_rows = 4 * (C // 8) * (C // 8 - 1)
    scratch = 64 * geometry.simdgroups  # an 8x8 tile per simdgroup (products with lower-triangular tiles)
    if kernel == "intra":
        floats = (6 * C + right_rows) * geometry.intra_key_block + 3 * C * C + scratch
    elif kernel in ("forward", "state_backward"):
        floats = 2 * C * C + 2 * C * geometry.key_block + geometry.key_block + (scratch if kernel == "forward" else 0)
    elif kernel == "backward":
        floats = 2 * C * C + 16 * C * 8 + 2 * right_rows * 8 + 16
    else:
        raise ValueError(kernel)
    return 4 * floats


def training_bytes(B: int, T: int, H: int, K: int, V: int, geometry: ChunkGeometry | None = None) -> int:
    """Transient float32 buffers of one forward+backward (states and dS, U and Z, P and the
    inverse); the inputs, the outputs and the gradients are not counted."""
    geometry = geometry_for(K, geometry)
    C = geometry.chunk
    N = -(-T // C)
    Kp, Vp = _round8(K), _round8(V)
    return 4 * B * H * N * (2 * Kp * Vp + 2 * C * Vp + 2 * C * C)


@lru_cache(maxsize=None)
def _metal_kernel(name: str, source: str, input_names: tuple[str, ...], output_names: tuple[str, ...]):
    return mx.fast.metal_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                                source=source, header=HEADER)


def _package():
    return importlib.import_module(__package__)


def _launch(name, source, input_names, output_names, inputs, template, groups, geometry, output_shapes, output_dtypes):
    package = _package()
    threads = geometry.threads
    launch = package.KernelLaunch(
        name=name,
        source=source,
        input_names=input_names,
        output_names=output_names,
        inputs=inputs,
        template=template,
        grid=(threads * groups[0], groups[1], groups[2]),
        threadgroup=(threads, 1, 1),
        output_shapes=output_shapes,
        output_dtypes=output_dtypes,
        kernel=_metal_kernel(name, source, input_names, output_names),
    )
    return launch


def _template(dtype, K: int, geometry: ChunkGeometry, key_block: int | None) -> list:
    template = [("InT", dtype), ("K", K), ("C", geometry.chunk), ("NS", geometry.simdgroups)]
    if key_block is not None:
        template.append(("BK", key_block))
    return template


def _meta(T: int, H: int, N: int, V: int, save: bool = False) -> mx.array:
    return mx.array([T, H, N, V, int(save)], dtype=mx.int32)


def intra_launch(q, k, g, b, geometry: ChunkGeometry):
    B, T, H, K = q.shape
    C = geometry.chunk
    N = -(-T // C)
    return _launch(
        "gdn2_chunk_intra", INTRA_SOURCE, INTRA_INPUTS, INTRA_OUTPUTS,
        [q, k, g, b, _meta(T, H, N, 0)], _template(q.dtype, K, geometry, geometry.intra_key_block),
        (1, N, B * H), geometry, [(B, H, N, C, C), (B, H, N, C, C)], [mx.float32, mx.float32],
    )


def forward_launch(q, k, v, g, b, w, state0, P, inverse, scale: float, geometry: ChunkGeometry, save: bool):
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = geometry.chunk
    N = -(-T // C)
    Kp, Vp = _round8(K), _round8(V)
    tiles = -(-Vp // geometry.value_tile)
    saved = [(B, H, N, Kp, Vp), (B, H, N * C, Vp)] if save else [(1,), (1,)]
    return _launch(
        "gdn2_chunk_forward", FORWARD_SOURCE, FORWARD_INPUTS, FORWARD_OUTPUTS,
        [q, k, v, g, b, w, state0, P, inverse, _meta(T, H, N, V, save), mx.array([scale], dtype=mx.float32)],
        _template(q.dtype, K, geometry, geometry.key_block), (1, tiles, B * H), geometry,
        [(B, T, H, V), (B, H, K, V), *saved], [q.dtype, mx.float32, mx.float32, mx.float32],
    )


def state_backward_launch(q, k, v, g, b, w, d_o, d_final, P, inverse, scale: float, geometry: ChunkGeometry):
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = geometry.chunk
    N = -(-T // C)
    Kp, Vp = _round8(K), _round8(V)
    tiles = -(-Vp // geometry.value_tile)
    return _launch(
        "gdn2_chunk_state_backward", STATE_BACKWARD_SOURCE, STATE_BACKWARD_INPUTS, STATE_BACKWARD_OUTPUTS,
        [q, k, v, g, b, w, d_o, d_final, P, inverse, _meta(T, H, N, V), mx.array([scale], dtype=mx.float32)],
        _template(q.dtype, K, geometry, geometry.key_block), (1, tiles, B * H), geometry,
        [(B, T, H, V), (B, T, H, V), (B, H, K, V), (B, H, N, Kp, Vp), (B, H, N * C, Vp)],
        [q.dtype, q.dtype, mx.float32, mx.float32, mx.float32],
    )


def backward_launch(q, k, g, b, d_o, checkpoints, d_states, new_values, z, V: int, scale: float,
                    geometry: ChunkGeometry):
    B, T, H, K = q.shape
    N = -(-T // geometry.chunk)
    return _launch(
        "gdn2_chunk_backward", BACKWARD_SOURCE, BACKWARD_INPUTS, BACKWARD_OUTPUTS,
        [q, k, g, b, d_o, checkpoints, d_states, new_values, z, _meta(T, H, N, V),
         mx.array([scale], dtype=mx.float32)],
        _template(q.dtype, K, geometry, None), (1, N, B * H), geometry,
        [(B, T, H, K)] * 4, [q.dtype] * 4,
    )


_geometry_override: list[ChunkGeometry | None] = [None]


def use_chunk_geometry(geometry: ChunkGeometry | None):
    """Force the chunk geometry (tests use C = 16 so that short inputs span several chunks)."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        saved = _geometry_override[0]
        _geometry_override[0] = geometry
        try:
            yield
        finally:
            _geometry_override[0] = saved

    return scope()


def run(launch) -> list:
    return _package().launcher(launch)


def forward(q, k, v, g, b, w, state0, scale: float, geometry: ChunkGeometry, save: bool):
    """(o, final_state, states, U) through INTRA and FORWARD (states and U only when ``save``)."""
    P, inverse = run(intra_launch(q, k, g, b, geometry))
    return run(forward_launch(q, k, v, g, b, w, state0, P, inverse, scale, geometry, save))


def backward(q, k, v, g, b, w, state0, d_o, d_final, scale: float, geometry: ChunkGeometry):
    """Every gradient: (dq, dk, dv, dg, db, dw, d_state0) in the inputs' dtypes (state: float32)."""
    P, inverse = run(intra_launch(q, k, g, b, geometry))
    _, _, states, new_values = run(forward_launch(q, k, v, g, b, w, state0, P, inverse, scale, geometry, True))
    d_v, d_w, d_state0, d_states, z = run(
        state_backward_launch(q, k, v, g, b, w, d_o, d_final, P, inverse, scale, geometry))
    d_q, d_k, d_g, d_b = run(
        backward_launch(q, k, g, b, d_o, states, d_states, new_values, z, v.shape[-1], scale, geometry))
    return d_q, d_k, d_v, d_g, d_b, d_w, d_state0
