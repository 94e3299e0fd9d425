"""Which Metal kernels a call runs (the scan or the chunked kernels), and the entry ``run``.

The forward and the backward are chosen separately: the forward by its estimated time, the
backward (the vjp, which reruns a forward of its own) by the estimated time of that rerun and the
backward. Decode (T == 1) runs the scan; training-length inputs run the chunked kernels; in
between the counted cost of ``cost.py`` decides, and the chunked backward gives way to the scan's
when its buffers would exceed half of the GPU's recommended working set. ``GDN2_METAL_KERNEL``
(``scan`` or ``chunked``) forces both.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from . import chunked, cost, scan

__all__ = ["KernelPlan", "plan", "counted", "run", "probe"]

KINDS = ("scan", "chunked")


@dataclass(frozen=True)
class KernelPlan:
    forward: str  # "scan" or "chunked"
    backward: str
    reason: str

    def __str__(self) -> str:
        if self.forward == self.backward:
            return f"{self.forward} kernels ({self.reason})"
        return f"{self.forward} forward, {self.backward} backward ({self.reason})"


def memory_budget() -> float | None:
    """Half of the GPU's recommended working set (None where MLX does not report it)."""
    try:
        info = mx.device_info()  # on a Mac's GPU: memory_size, max_recommended_working_set_size, ...
    except Exception:  # an MLX without device_info
        return None
    size = info.get("max_recommended_working_set_size")
    return None if size is None else 0.5 * float(size)


def plan(B: int, T: int, H: int, K: int, V: int, dtype, interval: int = 64, budget: float | None = None) -> KernelPlan:
    """The kernels for these sizes. ``budget``: device bytes the backward may use (default:
    ``memory_budget()``)."""
    forced = os.environ.get("GDN2_METAL_KERNEL", "").strip()
    if forced:
        if forced not in KINDS:
            raise ValueError(f"GDN2_METAL_KERNEL: expected one of {', '.join(KINDS)}, received {forced!r}")
        return KernelPlan(forced, forced, "requested by GDN2_METAL_KERNEL")
    if T == 1:
        return KernelPlan("scan", "scan", "decode, T == 1")
    counts = counted(B, T, H, K, V, dtype, interval)
    forward = min(KINDS, key=lambda kind: counts[kind]["forward_seconds"])
    backward = min(KINDS, key=lambda kind: counts[kind]["backward_seconds"])
    reason = "estimated on an M3 Max: forward {:.3g} ms scan, {:.3g} ms chunked; backward {:.3g} ms scan, " \
             "{:.3g} ms chunked".format(*(counts[kind][f"{part}_seconds"] * 1e3
                                          for part in ("forward", "backward") for kind in KINDS))
    budget = memory_budget() if budget is None else budget
    if backward == "chunked" and budget is not None:
        needed = counts["chunked"]["backward_bytes"]
        if needed > budget >= counts["scan"]["backward_bytes"]:
            backward = "scan"
            reason += f"; the chunked backward's {needed / 2**30:.1f} GiB of buffers exceed {budget / 2**30:.1f} GiB"
    return KernelPlan(forward, backward, reason)


def counted(B: int, T: int, H: int, K: int, V: int, dtype, interval: int = 64) -> dict:
    """Per kernel family (``scan``, ``chunked``): the ESTIMATED forward and backward (the vjp)
    seconds on an M3 Max (``cost.py``) and the backward's transient device bytes (besides inputs
    and gradients). ``bench/ops.py`` prints these next to its measurements."""
    itemsize = 4 if dtype == mx.float32 else 2
    scan_costs = cost.scan_cost(B, T, H, K, V, itemsize, interval=interval)
    chunked_costs = cost.chunked_cost(B, T, H, K, V, itemsize)
    return dict(
        scan=dict(forward_seconds=cost.estimate_seconds(scan_costs[:1]),
                  backward_seconds=cost.estimate_seconds(scan_costs[1:]),
                  backward_bytes=scan.backward_bytes(B, T, H, K, V, interval, itemsize)),
        chunked=dict(forward_seconds=cost.estimate_seconds(chunked_costs[:2]),
                     backward_seconds=cost.estimate_seconds(chunked_costs[2:]),
                     backward_bytes=chunked.training_bytes(B, T, H, K, V)),
    )


def _package():
    return importlib.import_module(__package__)


def _forward(kind: str, q, k, v, g, b, w, state0, scale: float, interval: int):
    if kind == "scan":
        o, final_state, _ = scan.run(scan.forward_launch(q, k, v, g, b, w, state0, scale, interval, save=False,
                                                         geometry=scan._geometry_override.get("forward")))
        return o, final_state
    o, final_state, _, _ = chunked.forward(q, k, v, g, b, w, state0, scale,
                                           chunked.geometry_for(q.shape[-1], chunked._geometry_override[0]), save=False)
    return o, final_state


def _backward(kind: str, q, k, v, g, b, w, state0, d_o, d_final, scale: float, interval: int):
    if kind == "scan":
        return scan.backward(q, k, v, g, b, w, state0, d_o, d_final, scale, interval)
    return chunked.backward(q, k, v, g, b, w, state0, d_o, d_final, scale,
                            chunked.geometry_for(q.shape[-1], chunked._geometry_override[0]))


@lru_cache(maxsize=None)
def _function(scale: float, interval: int, forward_kind: str, backward_kind: str):
    """One ``mx.custom_function`` per (scale, checkpoint interval, forward and backward kernels)."""

    @mx.custom_function
    def gdn2_metal(q, k, v, g, b, w, state0):
        return _forward(forward_kind, q, k, v, g, b, w, state0, scale, interval)

    @gdn2_metal.vjp
    def gdn2_metal_vjp(primals, cotangents, outputs):
        q, k, v, g, b, w, state0 = primals
        d_o, d_final = cotangents
        d_o = mx.zeros(v.shape, dtype=q.dtype) if d_o is None else d_o
        d_final = mx.zeros(state0.shape, dtype=mx.float32) if d_final is None else d_final.astype(mx.float32)
        *grads, d_state0 = _backward(backward_kind, q, k, v, g, b, w, state0, d_o, d_final, scale, interval)
        grads = [grad.astype(x.dtype) for grad, x in zip(grads, primals)]
        return (*grads, d_state0.astype(state0.dtype))

    return gdn2_metal


_probed: dict[tuple, str | None] = {}


def probe(kernel_plan: KernelPlan, dtype, K: int, V: int, interval: int) -> str | None:
    """Compile and launch every kernel of the plan once, eagerly, on a tiny problem with the same
    template arguments; None if they ran, else the failure.

    MLX builds a Metal library at evaluation time, long after the call returned a lazy graph, so
    a compile or launch failure would surface in the caller's ``mx.eval``; here it becomes an
    exception the path selection catches. Cached per configuration and launcher (the arrays are
    fresh, so this also runs inside ``mx.compile``).
    """
    package = _package()
    kinds = tuple(sorted({kernel_plan.forward, kernel_plan.backward}))
    key = (kinds, str(dtype), K, V, interval, package.launcher, tuple(sorted(scan._geometry_override.items())),
           chunked._geometry_override[0])
    if key not in _probed:
        try:
            x = mx.full((1, 1, 1, K), 0.5, dtype=dtype)
            y = mx.full((1, 1, 1, V), 0.5, dtype=dtype)
            state = mx.zeros((1, 1, K, V), dtype=mx.float32)
            outputs = []
            for kind in kinds:
                outputs += _forward(kind, x, x, y, -x, x, y, state, 1.0, interval)
                outputs += _backward(kind, x, x, y, -x, x, y, state, y, state, 1.0, interval)
            mx.eval(outputs)
            _probed[key] = None
        except Exception as error:
            _probed[key] = f"{type(error).__name__}: {error}"
    return _probed[key]


def run(q, k, v, g, b, w, *, scale: float, initial_state, output_final_state: bool, checkpoint_interval: int = 64):
    """GDN-2 on the Metal kernels (arguments already validated; float32, float16 or bfloat16,
    K, V <= 256). Returns ``(o [B, T, H, V] in q's dtype, final_state float32 or None)``;
    differentiable in every input and in ``initial_state``. Raises RuntimeError when a kernel
    fails to compile or launch."""
    out_dtype = q.dtype
    q, k, v, g, b, w = _one_dtype(q, k, v, g, b, w)
    B, T, H, K = q.shape
    V = v.shape[-1]
    kernel_plan = plan(B, T, H, K, V, q.dtype, checkpoint_interval)
    failure = probe(kernel_plan, q.dtype, K, V, checkpoint_interval)
    if failure is not None:
        raise RuntimeError(f"Metal kernel failed to compile or launch: {failure}")
    function = _function(float(scale), int(checkpoint_interval), kernel_plan.forward, kernel_plan.backward)
    o, final_state = function(q, k, v, g, b, w, _initial_state(q, v, initial_state))
    return o.astype(out_dtype), (final_state if output_final_state else None)


def family_gdn2(kind: str, q, k, v, g, b, w, scale: float, initial_state=None, interval: int = 64):
    """GDN-2 on one kernel family (``scan`` or ``chunked``) for both passes, without the plan or
    the probe (the tests and benches that compare the families): ``(o, final_state float32)``,
    differentiable in every input and in ``initial_state``."""
    out_dtype = q.dtype
    q, k, v, g, b, w = _one_dtype(q, k, v, g, b, w)
    o, final_state = _function(float(scale), int(interval), kind, kind)(q, k, v, g, b, w, _initial_state(q, v, initial_state))
    return o.astype(out_dtype), final_state


def _one_dtype(q, k, v, g, b, w):
    """The kernels take one input dtype: a float32 g beside 16-bit inputs runs them all in float32
    (exact; the gradients go back to each input's dtype through the casts)."""
    if g.dtype == q.dtype:
        return q, k, v, g, b, w
    return tuple(x.astype(mx.float32) for x in (q, k, v, g, b, w))


def _initial_state(q, v, initial_state):
    B, _, H, K = q.shape
    V = v.shape[-1]
    return mx.zeros((B, H, K, V), dtype=mx.float32) if initial_state is None else initial_state.astype(mx.float32)
