"""The per-value-column scan on Metal (``scan_source.py``): launchers, ``scan_gdn2`` and its memory.

The scan runs one threadgroup per (batch * head, value tile) forward: T sequential steps, one
simdgroup per state column, two ``simd_sum`` per column and step. It is the decode kernel (T == 1)
and the path for short inputs where the chunked kernels' fixed cost per chunk does not pay.

Backward (``SCAN_BACKWARD_SOURCE``): one threadgroup per batch * head covering every value column,
so the key-side gradients are summed over columns inside the kernel (no per-tile partial sums in
device memory). Per chunk of C steps, last first, and per value tile: replay from the checkpoint
into a per-group scratch, walk back. Transient memory (``backward_bytes``) at B=8 T=4096 H=16
K=V=256, C=64: checkpoints 2.15 GB, scratch 0.40 GB, saved dS and the per-chunk key sums 0.07 GB,
the forward's discarded output 0.27 GB (bf16): 2.9 GB, under 4 GiB.

Counted cost (ESTIMATES; per token and head, K = V = 128, "M3 Max" 40 cores ~14 TFLOP/s fp32,
~400 GB/s): forward 6 K V = 98 kFLOP with two ``simd_sum`` (~14 cycles each against 1 per FMA)
per column and step, ~22% ALU efficiency: ~20-35 ms at B=8 T=4096 H=16; backward ~30 K V FLOP with
the replay scratch written and read once per step (8 K V bytes, ~128 kB per token-head, mostly
DRAM traffic): ~0.2-0.3 s for forward+backward, and only B * H threadgroups in the backward.
Threadgroup memory: forward 4 * 16 * K floats (16 kB at K = 64, steps staged per block),
backward 4 K (1 + NS) floats (<= 28 kB); 32 * NS threads (<= 256).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from .scan_source import (
    SCAN_BACKWARD_INPUTS,
    SCAN_BACKWARD_OUTPUTS,
    SCAN_BACKWARD_SOURCE,
    SCAN_FORWARD_INPUTS,
    SCAN_FORWARD_OUTPUTS,
    SCAN_FORWARD_SOURCE,
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
    """As many simdgroups as the reduction buffer allows (one group per head does every column)."""
    simdgroups = max(1, min(8, (_THREADGROUP_FLOATS - 4 * K) // (4 * K)))
    return ScanGeometry(simdgroups, min(8, -(-V // simdgroups)))


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
                   geometry: ScanGeometry | None = None, source: str = SCAN_FORWARD_SOURCE,
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
        input_names=SCAN_FORWARD_INPUTS,
        output_names=SCAN_FORWARD_OUTPUTS,
        inputs=[q, k, v, g, b, w, state0, mx.array([T, B, tiles, H], dtype=mx.int32),
                mx.array([scale], dtype=mx.float32)],
        template=_template(q.dtype, K, V, geometry, interval, forward_block(K), save),
        grid=(threads, tiles, B * H),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, H, V), (B, H, K, V), checkpoints],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
        kernel=_metal_kernel(name, source, SCAN_FORWARD_INPUTS, SCAN_FORWARD_OUTPUTS),
    )


def backward_launch(q, k, v, g, b, w, d_o, d_final, checkpoints, scale: float, interval: int,
                    geometry: ScanGeometry | None = None, source: str = SCAN_BACKWARD_SOURCE,
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
        input_names=SCAN_BACKWARD_INPUTS,
        output_names=SCAN_BACKWARD_OUTPUTS,
        inputs=[q, k, v, g, b, w, d_o, d_final, checkpoints, mx.array([T, B, tiles, H], dtype=mx.int32),
                mx.array([scale], dtype=mx.float32)],
        template=_template(q.dtype, K, V, geometry, interval, 1, False),
        grid=(threads, 1, B * H),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H, K), (B, T, H, V),
                       (B, H, K, V), (B * H * interval * geometry.tile * KP,), (B * H * V * KP,),
                       (B * H * interval * 4 * K,)],
        output_dtypes=[q.dtype] * 6 + [mx.float32] * 4,
        kernel=_metal_kernel(name, source, SCAN_BACKWARD_INPUTS, SCAN_BACKWARD_OUTPUTS),
    )


_geometry_override: dict[str, ScanGeometry] = {}


def run(launch) -> list:
    return _package().launcher(launch)


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
        _, _, checkpoints = run(forward_launch(q, k, v, g, b, w, state0, scale, interval, save=True,
                                               geometry=_geometry_override.get("forward")))
        *grads, d_state0, _, _, _ = run(backward_launch(q, k, v, g, b, w, d_o, d_final, checkpoints, scale, interval,
                                                        geometry=_geometry_override.get("backward")))
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
