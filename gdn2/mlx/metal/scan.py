"""The per-value-column scan on Metal (``scan_source.py``): launchers, its two passes and its memory
(``dispatch.py`` makes them one differentiable function).

The scan runs one threadgroup per (batch * head, value tile) forward: T sequential steps, one
simdgroup per state column, two ``simd_sum`` per column and step. It is the decode kernel (T == 1)
and the path for short inputs where the chunked kernels' fixed cost per chunk does not pay.

Backward (``BACKWARD_SOURCE``): one threadgroup per batch * head covering every value column,
so the key-side gradients are summed over columns inside the kernel (no per-tile partial sums in
device memory). Per chunk of C steps (the checkpoint interval), last first, and per value tile:
replay from the checkpoint to the start of the chunk's last segment of R steps, storing the start
states of the segments in between (ceil(C / R) - 2 per chunk and tile); then per segment, last
first, replay its R states into registers (each lane's slice: R ceil(K / 32) CPS floats) and walk
them back. No state of a single step goes to device memory; every step is replayed about twice
(1.75 times at C = 64, R = 8). The replayed states have the same bits as a replay into memory.

Counted cost (``cost.scan_cost``; ESTIMATES, nothing here was measured: no Mac was available), per
token and head at K = V = 128, bf16 inputs, and the estimated time at B=8 T=4096 H=16 on an M3 Max
(40-core GPU, 14.2 TFLOP/s fp32, 400 GB/s; the scan assumed at 22% of the fp32 peak: two simd_sum
of ~14 cycles per column and step against one cycle per FMA):

    kernel                  kFLOP   bytes     est. ms   threadgroup memory        registers/thread (est.)
    forward                  98.3    1792      16.5     16 L K bytes (16 kB)      ~30
    forward (checkpoints)    98.3    2816      16.5     as forward                as forward
    backward                442.4    16640     74.3     16 K (1 + NS) (18-28 kB)  ~100 (K=128), ~90 (K=256)

    ESTIMATED: forward 16.5 ms, forward+backward 107 ms at B=8 T=4096 H=16 K=V=128 bf16 (211 ms
    with the earlier per-step replay scratch, 8 K V bytes per step); the backward is counted
    compute-bound (20 + 4 * 1.75 FLOP per state element and step), and it runs only B * H
    threadgroups. Of its bytes, 12288 per token are the segment start states (8 K V * 6 / 64).

Threads: 32 * NS (forward 128; backward up to 256). Registers: the forward holds its columns'
state (ceil(K / 32) * 2 floats per lane). The backward (``backward_geometry``) gives a lane at
most 8 floats of a state (CPS = 8 // ceil(K / 32) columns, at least 1) and holds R of them:
R = 8 up to K = 128, R = 4 above, where the four per-key accumulators already take 4 ceil(K / 32)
floats. Held states per lane: 64 floats at K = 64 and 128 (R 8 x 4 keys x 2 columns at K = 128),
32 at K = 256 (4 x 8 x 1); with the state's gradient (8), the accumulators (16 at K = 128, 32 at
K = 256) and the decayed state of one column (4, 8), the estimates above. A Mac's compiler must
confirm that the unrolled segment loops keep ``held`` in registers (no spill).

Transient memory of the backward (``backward_bytes``): checkpoints B H ceil(T / C) V Kp floats,
segment start states B H max(1, ceil(C / R) - 2) NS CPS Kp, saved dS B H V Kp, per-chunk key sums
B H C 4 K, the rerun forward's outputs: 2.4 GiB at B=8 T=4096 H=16 K=V=256 with C = 64 (0.7 GiB
at K=V=128; 2.5 and 0.9 GiB with the per-step replay scratch).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from .scan_source import (
    BACKWARD_INPUTS,
    BACKWARD_OUTPUTS,
    BACKWARD_SOURCE,
    FORWARD_INPUTS,
    FORWARD_OUTPUTS,
    FORWARD_SOURCE,
)

__all__ = ["ScanGeometry", "backward_bytes", "forward_threadgroup_bytes", "backward_threadgroup_bytes"]

SIMD_WIDTH = 32
_THREADGROUP_FLOATS = 7168  # 28 kB of the 32 kB of threadgroup memory


@dataclass(frozen=True)
class ScanGeometry:
    """Threadgroup shape: ``simdgroups`` per group, each owning ``columns`` value columns; the
    backward replays and walks ``segment`` steps at a time with their states in registers."""

    simdgroups: int
    columns: int
    segment: int = 8

    @property
    def tile(self) -> int:
        return self.simdgroups * self.columns


def forward_geometry(K: int, V: int) -> ScanGeometry:
    """4 simdgroups x 2 columns: small tiles keep many groups in flight, also for decode."""
    return ScanGeometry(4, 2)


def backward_geometry(K: int, V: int) -> ScanGeometry:
    """As many simdgroups as the reduction buffer allows (one group per head does every column).
    A lane holds at most 8 floats of a state (ceil(K / 32) key channels x columns) and a segment
    of R = 8 states (4 above K = 128, where the four per-channel accumulators already take
    4 ceil(K / 32) > 16 floats): at most 64 held floats per lane."""
    simdgroups = max(1, min(8, (_THREADGROUP_FLOATS - 4 * K) // (4 * K)))
    lanes = _lanes(K)
    return ScanGeometry(simdgroups, max(1, min(8, -(-V // simdgroups), 8 // lanes)), 8 if lanes <= 4 else 4)


def segment_slots(interval: int, segment: int) -> int:
    """Start states a backward tile stores per chunk: every segment's but the first (the
    checkpoint) and the last (left in registers); at least 1 so that the buffer is never empty."""
    return max(1, -(-interval // segment) - 2)


def forward_block(K: int) -> int:
    """Steps whose key-side vectors the forward stages at once."""
    return max(1, min(16, 1024 // K))


def forward_threadgroup_bytes(K: int) -> int:
    return 4 * 4 * forward_block(K) * K


def backward_threadgroup_bytes(K: int, geometry: ScanGeometry) -> int:
    return 4 * (4 * K + 4 * geometry.simdgroups * K)


def _lanes(K: int) -> int:
    return -(-K // SIMD_WIDTH)


def backward_bytes(B: int, T: int, H: int, K: int, V: int, interval: int, itemsize: int = 2,
                   geometry: ScanGeometry | None = None) -> int:
    """Transient device memory of one scan backward (the vjp): the forward rerun's checkpoints and
    its discarded outputs, the segments' start states, the saved dS and the per-chunk key sums. Inputs
    and gradients are not counted (``itemsize``: bytes per element of the inputs)."""
    geometry = geometry or backward_geometry(K, V)
    KP = SIMD_WIDTH * _lanes(K)
    N = -(-T // interval)
    floats = (B * H * N * V * KP  # checkpoints
              + B * H * segment_slots(interval, geometry.segment) * geometry.tile * KP  # segment start states
              + B * H * V * KP  # saved dS
              + B * H * interval * 4 * K  # key sums
              + B * H * K * V)  # the rerun forward's final state
    return 4 * floats + B * T * H * V * itemsize  # and its output


def _package():
    return importlib.import_module(__package__)


@lru_cache(maxsize=None)
def _metal_kernel(name: str, source: str, input_names: tuple[str, ...], output_names: tuple[str, ...]):
    return mx.fast.metal_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                                source=source)


def _template(dtype, K: int, V: int, geometry: ScanGeometry, interval: int) -> list:
    return [("InT", dtype), ("K", K), ("V", V), ("KPL", _lanes(K)), ("NS", geometry.simdgroups),
            ("CPS", geometry.columns), ("C", interval)]


def forward_launch(q, k, v, g, b, w, state0, scale: float, interval: int, save: bool,
                   geometry: ScanGeometry | None = None, source: str = FORWARD_SOURCE,
                   name: str = "gdn2_scan_forward"):
    """o [B, T, H, V] (q's dtype), the final state and (``save``) the checkpoints
    [B, H, ceil(T / C), V, 32 ceil(K / 32)] (float32, lane index fastest)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    geometry = geometry or forward_geometry(K, V)
    tiles = -(-V // geometry.tile)
    checkpoints = (B, H, -(-T // interval), V, SIMD_WIDTH * _lanes(K)) if save else (1,)
    threads = SIMD_WIDTH * geometry.simdgroups
    return _package().KernelLaunch(
        name=name,
        source=source,
        input_names=FORWARD_INPUTS,
        output_names=FORWARD_OUTPUTS,
        inputs=[q, k, v, g, b, w, state0, mx.array([T, B, tiles, H], dtype=mx.int32),
                mx.array([scale], dtype=mx.float32)],
        template=_template(q.dtype, K, V, geometry, interval) + [("L", forward_block(K)), ("SAVE", save)],
        grid=(threads, tiles, B * H),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, H, V), (B, H, K, V), checkpoints],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
        kernel=_metal_kernel(name, source, FORWARD_INPUTS, FORWARD_OUTPUTS),
    )


def backward_launch(q, k, v, g, b, w, d_o, d_final, checkpoints, scale: float, interval: int,
                    geometry: ScanGeometry | None = None, source: str = BACKWARD_SOURCE,
                    name: str = "gdn2_scan_backward"):
    """Every gradient (q's dtype; d_state0 float32) and three scratch buffers (float32): the
    segments' start states, the saved dS between chunks, the per-chunk key sums."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    geometry = geometry or backward_geometry(K, V)
    tiles = -(-V // geometry.tile)
    KP = SIMD_WIDTH * _lanes(K)
    threads = SIMD_WIDTH * geometry.simdgroups
    return _package().KernelLaunch(
        name=name,
        source=source,
        input_names=BACKWARD_INPUTS,
        output_names=BACKWARD_OUTPUTS,
        inputs=[q, k, v, g, b, w, d_o, d_final, checkpoints, mx.array([T, B, tiles, H], dtype=mx.int32),
                mx.array([scale], dtype=mx.float32)],
        template=_template(q.dtype, K, V, geometry, interval)
        + [("R", geometry.segment), ("SLOTS", segment_slots(interval, geometry.segment))],
        grid=(threads, 1, B * H),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H, K), (B, T, H, V),
                       (B, H, K, V), (B * H * segment_slots(interval, geometry.segment) * geometry.tile * KP,),
                       (B * H * V * KP,), (B * H * interval * 4 * K,)],
        output_dtypes=[q.dtype] * 6 + [mx.float32] * 4,
        kernel=_metal_kernel(name, source, BACKWARD_INPUTS, BACKWARD_OUTPUTS),
    )


_geometry_override: dict[str, ScanGeometry] = {}


def run(launch) -> list:
    return _package().launcher(launch)


def backward(q, k, v, g, b, w, state0, d_o, d_final, scale: float, interval: int):
    """Every gradient: (dq, dk, dv, dg, db, dw, d_state0): the forward rerun with checkpoints,
    then the backward scan."""
    _, _, checkpoints = run(forward_launch(q, k, v, g, b, w, state0, scale, interval, save=True,
                                           geometry=_geometry_override.get("forward")))
    *grads, _, _, _ = run(backward_launch(q, k, v, g, b, w, d_o, d_final, checkpoints, scale, interval,
                                          geometry=_geometry_override.get("backward")))
    return tuple(grads)
