"""Inputs, cotangents and float64 spec results for the Metal kernel tests, and the checks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from gdn2 import spec

NAMES = spec.INPUT_NAMES + ("initial_state",)
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 2.5e-2}


def make_case(B, T, H, K, V, seed, dtype="float32", log_decay_range=(-3.0, 0.0), resets=False):
    """Inputs rounded to ``dtype`` (the spec sees the rounded values), cotangents, spec results.
    ``resets``: hard resets (g = -inf) at a whole step and at single channels."""
    x = spec.random_inputs(B, T, H, K, V, seed, log_decay_range=log_decay_range)
    if resets:
        rng = np.random.default_rng(seed + 2)
        x["g"][:, rng.integers(T)] = -np.inf
        for _ in range(3):
            x["g"][rng.integers(B), rng.integers(T), rng.integers(H), rng.integers(K)] = -np.inf
    arrays = {n: mx.array(x[n].astype(np.float32)).astype(getattr(mx, dtype)) for n in spec.INPUT_NAMES}
    arrays["initial_state"] = mx.array(x["initial_state"].astype(np.float32))
    rounded = {n: np.array(arrays[n].astype(mx.float32), dtype=np.float64) for n in NAMES}
    rng = np.random.default_rng(seed + 1)
    d_o = rng.standard_normal((B, T, H, V))
    d_final = rng.standard_normal((B, H, K, V))
    o, final = spec.reference_forward(**rounded)
    grads = spec.reference_backward(**rounded, d_o=d_o, d_final_state=d_final)
    return dict(arrays=arrays, d_o=d_o, d_final=d_final, o=o, final=final, grads=grads, K=K)


def as64(x) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def check(name, got, expected, tolerance, seed):
    assert np.isfinite(got).all(), f"{name}: not finite (seed={seed})"
    error = spec.relative_error(got, expected)
    assert error < tolerance, f"{name}: relative error {error:.3e} >= {tolerance:.1e} (seed={seed})"


def check_all(case, result, tolerance, seed, state_tolerance=None):
    (o, final), grads = result
    check("o", as64(o), case["o"], tolerance, seed)
    check("final_state", as64(final), case["final"], state_tolerance or tolerance, seed)
    for name in NAMES:
        assert grads[name].dtype == case["arrays"][name].dtype
        check(f"d{name}", as64(grads[name]), case["grads"][name], tolerance, seed)
