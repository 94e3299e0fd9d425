"""Metal kernels for GDN-2 on Apple GPUs: the chunked (WY) kernels and the per-column scan.

Two families, chosen per call (``dispatch.plan``; the choice shows in ``gdn2.mlx.which_path``):

* the chunked kernels (``chunked.py``, ``chunked_source.py``): the WY form of
  ``gdn2/algorithm.py`` on 8x8 ``simdgroup_matrix`` tiles, chunks of 32 steps, the state touched
  at chunk boundaries only. Training-length inputs run these.
* the scan (``scan.py``, ``scan_source.py``): T sequential steps per threadgroup, one simdgroup
  per state column. Decode (T == 1) and short inputs run this; its backward also serves as the
  low-memory backward when the chunked kernels' buffers would not fit.

The forward and the backward of one call are chosen separately, from the counted cost in
``cost.py`` (estimates: nothing was timed on a Mac); ``GDN2_METAL_KERNEL=scan|chunked`` forces
one family. The kernels need MLX's GPU device: on a Mac without one, or with MLX's default
device set to the CPU, ``unsupported_reason`` says so and the chunk path runs.

Limits: K, V <= 256; float32, float16 and bfloat16 inputs, float32 state and float32 arithmetic;
float64 goes to the chunk path.

Testing without Apple hardware: every launch goes through ``launcher`` (a function of a
``KernelLaunch``); ``use_launcher`` swaps it, and ``tests/metal_harness`` provides one that
compiles the exact source MLX generates with g++ against a shim header and runs it on the CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx

__all__ = ["unsupported_reason", "describe", "metal_gdn2", "KernelLaunch", "use_launcher", "use_geometry",
           "KERNEL_FAILURES"]

# What a kernel failure raises: MLX reports a Metal library that fails to build or a launch that
# fails as RuntimeError, and ``metal_gdn2`` raises any failure of its probe as RuntimeError.
KERNEL_FAILURES = (RuntimeError,)

MAX_KEY_DIM = 256
MAX_VALUE_DIM = 256


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


def unsupported_reason(q, k, v, g, b, w, initial_state=None, chunk_size: int = 64) -> str | None:
    """None when the Metal kernels can run these arguments, else a short reason."""
    try:
        available = mx.metal.is_available()
    except Exception:  # an MLX build without the metal module
        available = False
    if not available:
        return "Metal is not available on this machine"
    if mx.default_device().type != mx.DeviceType.gpu:
        return "MLX's default device is the CPU (the Metal kernels run on the GPU device)"
    K, V = q.shape[-1], v.shape[-1]
    if K > MAX_KEY_DIM:
        return f"K={K} > {MAX_KEY_DIM}"
    if V > MAX_VALUE_DIM:
        return f"V={V} > {MAX_VALUE_DIM}"
    if q.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        return f"{q.dtype} inputs (the Metal kernels take float32, float16 and bfloat16)"
    return None


def describe(q, k, v, g, b, w, initial_state=None, chunk_size: int = 64, checkpoint_interval: int = 64) -> str:
    """Which kernels a call with these arguments runs, and why (for ``which_path``)."""
    from .dispatch import plan

    B, T, H, K = q.shape
    return str(plan(B, T, H, K, v.shape[-1], q.dtype, checkpoint_interval))


@contextlib.contextmanager
def use_geometry(forward=None, backward=None, chunk=None) -> Iterator[None]:
    """Force threadgroup shapes: the scan's forward and backward (``scan.ScanGeometry``) and the
    chunked kernels' (``chunked.ChunkGeometry``); tests use small ones so that short inputs span
    several value tiles and chunks."""
    from . import chunked, scan

    saved_scan, saved_chunk = dict(scan._geometry_override), chunked._geometry_override[0]
    if forward is not None:
        scan._geometry_override["forward"] = forward
    if backward is not None:
        scan._geometry_override["backward"] = backward
    if chunk is not None:
        chunked._geometry_override[0] = chunk
    try:
        yield
    finally:
        scan._geometry_override.clear()
        scan._geometry_override.update(saved_scan)
        chunked._geometry_override[0] = saved_chunk


def metal_gdn2(q, k, v, g, b, w, *, scale: float, initial_state, output_final_state: bool, checkpoint_interval: int = 64):
    """GDN-2 on the Metal kernels.

    q, k, g, b ``[B, T, H, K]``; v, w ``[B, T, H, V]`` (float32, float16 or bfloat16, already
    validated); ``initial_state`` float32 ``[B, H, K, V]`` or None (zeros). ``checkpoint_interval``:
    steps between the states the scan's backward replays from (the chunked kernels keep a state
    per chunk of 32). Returns ``(o [B, T, H, V] in q's dtype, final_state float32 [B, H, K, V] or
    None)``; differentiable in every input and in ``initial_state`` through ``mx.custom_function``.
    Raises RuntimeError when a kernel fails to compile or launch.
    """
    from .dispatch import run

    return run(q, k, v, g, b, w, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
               checkpoint_interval=checkpoint_interval)
