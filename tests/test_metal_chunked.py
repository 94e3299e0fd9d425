"""The chunked (WY) Metal kernels (``gdn2/mlx/metal/chunked.py``), executed on the CPU through the
harness (the exact source MLX generates, every threadgroup as fibers under several schedules) and
compared with the float64 spec: forward and every gradient, with a nonzero gradient into the final
state. Shapes are chosen so that few distinct kernels are compiled (T and H are runtime values)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from gdn2 import spec  # noqa: E402
from gdn2.mlx import metal  # noqa: E402
from gdn2.mlx.metal import chunked, dispatch  # noqa: E402
from gdn2.mlx.metal import chunked_source as source  # noqa: E402
from tests.metal_harness import harness  # noqa: E402
from tests.metal_harness.cases import BARRIER, NAMES, TOLERANCE, check_all, make_case  # noqa: E402

SMALL = chunked.ChunkGeometry(chunk=16)  # short inputs span several chunks


def run_chunked(case, geometry, launcher=harness.harness_launcher):
    """Forward and the gradients of sum(o * d_o) + sum(final * d_final), every launch through
    ``launcher``."""
    a = case["arrays"]
    d_o = mx.array(case["d_o"].astype(np.float32))
    d_final = mx.array(case["d_final"].astype(np.float32))

    def loss(*inputs):
        o, final = dispatch.family_gdn2("chunked", *inputs[:6], case["K"] ** -0.5, inputs[6])
        return (o.astype(mx.float32) * d_o).sum() + (final * d_final).sum(), (o, final)

    with metal.use_launcher(launcher), chunked.use_chunk_geometry(geometry):
        (_, (o, final)), grads = mx.value_and_grad(loss, argnums=tuple(range(7)))(*(a[n] for n in NAMES))
        mx.eval(o, final, grads)
    return (o, final), dict(zip(NAMES, grads))


# (B, T, H, K, V, geometry, log-decay range, hard resets)
SHAPES = [
    # several chunks, T not a multiple of 16, K != V, K over two key blocks (three in INTRA),
    # V over three of the four simdgroups, two heads
    (2, 37, 2, 40, 20, SMALL, (-3.0, 0.0), False),
    # the default chunk of 32 over three chunks, two value tiles; strong decay and hard resets
    (1, 70, 1, 24, 40, None, (-20.0, 0.0), True),
    # a single step (decode length) and T shorter than the chunk
    (1, 1, 2, 24, 40, None, (-3.0, 0.0), False),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}C{}g{}{}".format(
    *s[:5], (s[5] or chunked.ChunkGeometry()).chunk, s[6][0], "-resets" if s[7] else ""))
def test_chunked_matches_spec_forward_and_every_gradient(shape, seed):
    B, T, H, K, V, geometry, decay, resets = shape
    case = make_case(B, T, H, K, V, seed, log_decay_range=decay, resets=resets)
    check_all(case, run_chunked(case, geometry), TOLERANCE["float32"], seed)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_chunked_half_inputs_float32_state(dtype, seed):
    case = make_case(1, 20, 2, 40, 20, seed, dtype=dtype)
    (o, final), grads = result = run_chunked(case, SMALL)
    assert o.dtype == getattr(mx, dtype) and final.dtype == mx.float32
    check_all(case, result, TOLERANCE[dtype], seed, state_tolerance=1e-5)  # float32 state, float32 math


def test_chunked_largest_key_and_value_dims(seed):
    """K = V = 256 (32 state tiles per simdgroup, eight value tiles, eight key blocks): one small
    case; every kernel's threadgroup memory as measured by the harness equals the declared count
    and fits 32 KiB, with at most 1024 threads."""
    case = make_case(1, 5, 1, 256, 256, seed)
    measured = {}

    def measuring_launcher(launch):
        outputs = harness.harness_launcher(launch)
        measured[launch.name] = (harness.last_threadgroup_bytes, launch.threadgroup)
        return outputs

    check_all(case, run_chunked(case, None, measuring_launcher), 5e-5, seed)
    geometry = chunked.geometry_for(256)
    for kernel in chunked.KERNELS:
        declared = chunked.threadgroup_bytes(kernel, 256, geometry)
        got, threadgroup = measured[f"gdn2_chunk_{kernel}"]
        assert got == declared, f"{kernel}: the harness measured {got} bytes, threadgroup_bytes says {declared}"
        assert declared <= chunked.THREADGROUP_MEMORY_LIMIT, f"{kernel}: {declared} bytes of threadgroup memory"
        assert threadgroup[0] * threadgroup[1] * threadgroup[2] <= 1024


@pytest.mark.parametrize("K", [8, 40, 256])
@pytest.mark.parametrize("chunk", [16, 32])
def test_threadgroup_memory_and_threads_within_limits(K, chunk):
    geometry = chunked.geometry_for(K, chunked.ChunkGeometry(chunk=chunk))
    assert geometry.threads <= 1024
    for kernel in chunked.KERNELS:
        assert chunked.threadgroup_bytes(kernel, K, geometry) <= chunked.THREADGROUP_MEMORY_LIMIT


def test_training_memory_is_counted(seed):
    """training_bytes equals the float32 buffers the training launches allocate between forward and
    backward (P, the inverse, states, U, dS, Z), and states and dS dominate at a training shape."""
    B, T, H, K, V = 2, 70, 3, 20, 12
    case = make_case(B, T, H, K, V, seed)
    a = case["arrays"]
    inputs = [a[n] for n in spec.INPUT_NAMES]
    geometry = chunked.geometry_for(K)
    shapes = chunked.intra_launch(a["q"], a["k"], a["g"], a["b"], geometry).output_shapes
    shapes += chunked.forward_launch(*inputs, a["initial_state"], None, None, 1.0, geometry, True).output_shapes[2:]
    shapes += chunked.state_backward_launch(*inputs, inputs[2], a["initial_state"], None, None, 1.0,
                                            geometry).output_shapes[3:]
    assert chunked.training_bytes(B, T, H, K, V, geometry) == 4 * sum(int(np.prod(s)) for s in shapes)
    states = 2 * 8 * 16 * 128 * 128 * 128 * 4  # B=8 T=4096 H=16 K=V=128: T / 32 states and dS
    assert 0.75 < states / chunked.training_bytes(8, 4096, 16, 128, 128) < 0.8


# ---- every barrier is needed, and the harness sees a missing one --------------------------------


def barrier_cases(seed):
    """The launches of one small problem (3 chunks of 16, three key blocks in INTRA, two in the
    sequential kernels, three active simdgroups) with their real inputs."""
    B, T, H, K, V = 1, 40, 1, 40, 20
    case = make_case(B, T, H, K, V, seed)
    a = case["arrays"]
    inputs = [a[n] for n in spec.INPUT_NAMES]
    geometry = chunked.geometry_for(K, SMALL)
    d_o = mx.array(case["d_o"].astype(np.float32))
    d_final = mx.array(case["d_final"].astype(np.float32))
    run = harness.harness_launcher
    intra = chunked.intra_launch(a["q"], a["k"], a["g"], a["b"], geometry)
    P, inverse = run(intra)
    forward = chunked.forward_launch(*inputs, a["initial_state"], P, inverse, 0.3, geometry, True)
    _, _, states, new_values = run(forward)
    state_backward = chunked.state_backward_launch(*inputs, d_o, d_final, P, inverse, 0.3, geometry)
    _, _, _, d_states, z = run(state_backward)
    backward = chunked.backward_launch(a["q"], a["k"], a["g"], a["b"], d_o, states, d_states, new_values, z, V, 0.3,
                                       geometry)
    return dict(intra=intra, forward=forward, state_backward=state_backward, backward=backward)


KERNEL_SOURCES = dict(intra=source.INTRA_SOURCE, forward=source.FORWARD_SOURCE,
                      state_backward=source.STATE_BACKWARD_SOURCE, backward=source.BACKWARD_SOURCE)


def test_every_barrier_is_needed(seed):
    """Remove each threadgroup_barrier of each chunked kernel in turn: the harness reports a
    schedule-dependent result, or the outputs change (a read of poisoned memory)."""
    launches = barrier_cases(seed)
    variants = []
    for kernel, text in KERNEL_SOURCES.items():
        launch = launches[kernel]
        parts = text.split(BARRIER)
        assert len(parts) > 2, kernel
        for index in range(len(parts) - 1):
            broken = BARRIER.join(parts[: index + 1]) + "/* barrier removed */" + BARRIER.join(parts[index + 1:])
            variant = chunked._launch(f"{launch.name}_nobarrier{index}", broken, launch.input_names,
                                      launch.output_names, launch.inputs, launch.template,
                                      (launch.grid[0] // launch.threadgroup[0], *launch.grid[1:]),
                                      chunked.ChunkGeometry(simdgroups=launch.threadgroup[0] // 32),
                                      launch.output_shapes, launch.output_dtypes)
            variants.append((kernel, index, variant))
    harness.prepare([variant for _, _, variant in variants])
    intact = {kernel: harness.run_launch(launch, seed=seed) for kernel, launch in launches.items()}
    for kernel, index, variant in variants:
        try:
            outputs = harness.run_launch(variant, seed=seed)
        except harness.ScheduleDependentResult:
            continue
        changed = any(not np.array_equal(x, y) for x, y in zip(outputs, intact[kernel]))
        assert changed, f"{kernel}: removing barrier {index} goes unnoticed (seed={seed})"
