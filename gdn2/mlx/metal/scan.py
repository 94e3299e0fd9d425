"""The per-value-column scan on Metal (``scan_source.py``): launchers, ``scan_gdn2`` and its memory.

The scan runs one threadgroup per (batch * head, value tile) forward: T sequential steps, one
simdgroup per state column, two ``simd_sum`` per column and step. It is the decode kernel (T == 1)
and the path for short inputs where the chunked kernels' fixed cost per chunk does not pay.

Backward (``BACKWARD_SOURCE``): one threadgroup per batch * head covering every value column,
so the key-side gradients are summed over columns inside the kernel (no per-tile partial sums in
device memory). Per chunk of C steps, last first, and per value tile: replay from the checkpoint
into a per-group scratch, walk back.

Counted cost (``cost.scan_cost``; ESTIMATES, nothing here was measured: no Mac was available), per
token and head at K = V = 128, bf16 inputs, and the estimated time at B=8 T=4096 H=16 on an M3 Max
(40-core GPU, 14.2 TFLOP/s fp32, 400 GB/s; the scan assumed at 22% of the fp32 peak: two simd_sum
of ~14 cycles per column and step against one cycle per FMA):

    kernel                  kFLOP   bytes     est. ms   threadgroup memory        registers/thread (est.)
    forward                  98.3    1792      16.5     16 L K bytes (16 kB)      ~30
    forward (checkpoints)    98.3    2816      16.5     as forward                as forward
    backward                393.2    135424   177.5     16 K (1 + NS) (18-28 kB)  ~70 (K=128), ~90 (K=256)

    ESTIMATED: forward 16.5 ms, forward+backward 211 ms at B=8 T=4096 H=16 K=V=128 bf16; the
    backward's bytes are the replay scratch (8 K V per step), and it runs only B * H threadgroups.

Threads: 32 * NS (forward 128; backward up to 256). Registers: the forward holds its columns'
state (ceil(K / 32) * 2 floats per lane), the backward the state and its gradient
(2 * ceil(K / 32) * CPS, CPS <= 32 / ceil(K / 32)) and a few per-key accumulators.

Transient memory of the backward (``backward_bytes``): checkpoints B H ceil(T / C) V Kp floats,
scratch B H C NS CPS Kp, saved dS B H V Kp, per-chunk key sums B H C 4 K, the rerun forward's
outputs: 2.5 GiB at B=8 T=4096 H=16 K=V=256 with C = 64 (0.9 GiB at K=V=128).
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

__all__ = ["ScanGeometry", "scan_gdn2", "backward_bytes", "forward_threadgroup_bytes", "backward_threadgroup_bytes"]

SIMD_WIDTH = 32
_THREADGROUP_FLOATS = 7168  # 28 kB of the 32 kB of threadgroup memory


@dataclass(frozen=True)
class ScanGeometry:
    """Threadgroup shape: ``simdgroups`` per group, each owning ``columns`` value columns."""

    simdgroups: int
    columns: int

    @property
    def tile(self) -> int:
        return self.simdgroups * self.columns


def forward_geometry(K: int, V: int) -> ScanGeometry:
    """4 simdgroups x 2 columns: small tiles keep many groups in flight, also for decode."""
    return ScanGeometry(4, 2)


def backward_geometry(K: int, V: int) -> ScanGeometry:
    """As many simdgroups as the reduction buffer allows (one group per head does every column);
    at most 32 state and 32 gradient floats per lane (S and dS are [ceil(K / 32), columns])."""
    simdgroups = max(1, min(8, (_THREADGROUP_FLOATS - 4 * K) // (4 * K)))
    return ScanGeometry(simdgroups, max(1, min(8, -(-V // simdgroups), 32 // _lanes(K))))


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
    its discarded outputs, the replay scratch, the saved dS and the per-chunk key sums. Inputs
    and gradients are not counted (``itemsize``: bytes per element of the inputs)."""
    geometry = geometry or backward_geometry(K, V)
    KP = SIMD_WIDTH * _lanes(K)
    N = -(-T // interval)
    floats = (B * H * N * V * KP  # checkpoints
              + B * H * interval * geometry.tile * KP  # scratch
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


def _template(dtype, K: int, V: int, geometry: ScanGeometry, interval: int, block: int, save: bool) -> list:
    return [("InT", dtype), ("K", K), ("V", V), ("KPL", _lanes(K)), ("NS", geometry.simdgroups),
            ("CPS", geometry.columns), ("C", interval), ("L", block), ("SAVE", save)]


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
        template=_template(q.dtype, K, V, geometry, interval, forward_block(K), save),
        grid=(threads, tiles, B * H),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, H, V), (B, H, K, V), checkpoints],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
        kernel=_metal_kernel(name, source, FORWARD_INPUTS, FORWARD_OUTPUTS),
    )


def backward_launch(q, k, v, g, b, w, d_o, d_final, checkpoints, scale: float, interval: int,
                    geometry: ScanGeometry | None = None, source: str = BACKWARD_SOURCE,
                    name: str = "gdn2_scan_backward"):
    """Every gradient (q's dtype; d_state0 float32) and three scratch buffers (float32)."""
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
        template=_template(q.dtype, K, V, geometry, interval, 1, False),
        grid=(threads, 1, B * H),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H, K), (B, T, H, V),
                       (B, H, K, V), (B * H * interval * geometry.tile * KP,), (B * H * V * KP,),
                       (B * H * interval * 4 * K,)],
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


@lru_cache(maxsize=None)
def _scan_function(scale: float, interval: int):
    """One ``mx.custom_function`` per (scale, checkpoint interval): (o, final_state) of 7 arrays."""

    @mx.custom_function
    def gdn2_scan(q, k, v, g, b, w, state0):
        o, final_state, _ = run(forward_launch(q, k, v, g, b, w, state0, scale, interval, save=False,
                                               geometry=_geometry_override.get("forward")))
        return o, final_state

    @gdn2_scan.vjp
    def gdn2_scan_vjp(primals, cotangents, outputs):
        q, k, v, g, b, w, state0 = primals
        d_o, d_final = cotangents
        d_o = mx.zeros(v.shape, dtype=q.dtype) if d_o is None else d_o
        d_final = mx.zeros(state0.shape, dtype=mx.float32) if d_final is None else d_final.astype(mx.float32)
        *grads, d_state0 = backward(q, k, v, g, b, w, state0, d_o, d_final, scale, interval)
        grads = [grad.astype(x.dtype) for grad, x in zip(grads, primals)]
        return (*grads, d_state0.astype(state0.dtype))

    return gdn2_scan


def scan_gdn2(q, k, v, g, b, w, scale: float, initial_state=None, interval: int = 64):
    """GDN-2 on the scan kernels: ``(o [B, T, H, V] in q's dtype, final_state float32)``;
    differentiable in every input and ``initial_state`` (checkpoints every ``interval`` steps)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    state0 = mx.zeros((B, H, K, V), dtype=mx.float32) if initial_state is None else initial_state.astype(mx.float32)
    return _scan_function(float(scale), int(interval))(q, k, v, g, b, w, state0)
