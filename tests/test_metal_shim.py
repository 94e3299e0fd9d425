"""The harness's Metal shim itself, against numpy: simdgroup_matrix (load, store with stride and
transpose, multiply, multiply_accumulate, make_filled, the lane layout of thread_elements),
threadgroup memory poisoning, and the misuse reports (divergent simdgroup operations,
lane-dependent load arguments)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from gdn2.mlx.metal import KernelLaunch  # noqa: E402
from tests.metal_harness import harness  # noqa: E402


def run(name, source, inputs, outputs, groups=1, threads=32, template=(), header="", schedules=harness.SCHEDULES):
    """Run a small kernel through the harness: inputs {name: array}, outputs {name: (shape, dtype)}."""
    kernel = mx.fast.metal_kernel(name=name, input_names=list(inputs), output_names=list(outputs), source=source,
                                  header=header)
    launch = KernelLaunch(
        name=name, source=source, input_names=tuple(inputs), output_names=tuple(outputs),
        inputs=list(inputs.values()), template=list(template), grid=(threads * groups, 1, 1),
        threadgroup=(threads, 1, 1), output_shapes=[s for s, _ in outputs.values()],
        output_dtypes=[d for _, d in outputs.values()], kernel=kernel)
    raw = harness.run_launch(launch, schedules=schedules)
    return [np.array(harness.from_raw(r, d)) for r, (_, d) in zip(raw, outputs.values())]


# D = op(A) @ op(B) + op(C), each operand loaded from device memory with its own row stride and
# transpose flag (runtime values), the result stored with a stride and a transpose flag.
MMA_SOURCE = """
    const int ta = flags[0], tb = flags[1], tc = flags[2], td = flags[3];
    simdgroup_float8x8 A, B, C, D;
    simdgroup_load(A, a, 11, ulong2(0, 0), ta != 0);
    simdgroup_load(B, b, 9, ulong2(0, 0), tb != 0);
    simdgroup_load(C, c, 8, ulong2(0, 0), tc != 0);
    simdgroup_multiply_accumulate(D, A, B, C);
    simdgroup_store(D, d, 10, ulong2(0, 0), td != 0);
    simdgroup_multiply(A, A, B);  // the product may overwrite an operand
    simdgroup_store(A, product, 8);
"""


def load(x, stride, transpose):
    """What simdgroup_load gives: element (r, c) = x[r * stride + c] (x[c * stride + r] transposed)."""
    flat = x.reshape(-1)
    r, c = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    return flat[c * stride + r] if transpose else flat[r * stride + c]


@pytest.mark.parametrize("flags", [(0, 0, 0, 0), (1, 0, 1, 0), (0, 1, 0, 1), (1, 1, 1, 1)])
def test_load_multiply_accumulate_store(flags, seed):
    rng = np.random.default_rng(seed)
    a, b, c = (rng.standard_normal(n).astype(np.float32) for n in (8 * 11, 8 * 9, 64))
    d, product = run("shim_mma", MMA_SOURCE,
                     dict(a=mx.array(a), b=mx.array(b), c=mx.array(c), flags=mx.array(flags, dtype=mx.int32)),
                     dict(d=((80,), mx.float32), product=((64,), mx.float32)))
    A, B, C = load(a, 11, flags[0]), load(b, 9, flags[1]), load(c, 8, flags[2])
    expected = A.astype(np.float64) @ B + C
    stored = load(d, 10, flags[3])  # reading back with the store's stride and flag gives D
    np.testing.assert_allclose(stored, expected, rtol=1e-5, atol=1e-5)
    untouched = np.ones(80, bool)
    untouched[(np.arange(8)[:, None] * 10 + np.arange(8)).reshape(-1)] = False
    assert np.isnan(d[untouched]).all(), "the store wrote outside the 8x8 window"
    np.testing.assert_allclose(product.reshape(8, 8), A.astype(np.float64) @ B, rtol=1e-5, atol=1e-5)


LAYOUT_SOURCE = """
    // each lane writes the coordinates it holds, then its elements of a loaded matrix
    const uint lane = thread_index_in_simdgroup;
    simdgroup_float8x8 M;
    simdgroup_load(M, m, 8);
    const uint fm = ((lane / 4) & 4) + ((lane / 2) % 4);
    const uint fn = ((lane / 4) & 2) * 2 + (lane % 2) * 2;
    elements[fm * 8 + fn] = M.thread_elements()[0];
    elements[fm * 8 + fn + 1] = M.thread_elements()[1];
    simdgroup_float8x8 F = make_filled_simdgroup_matrix<float, 8>(float(lane == 0 ? 2.5f : 2.5f));
    F.thread_elements()[1] = -1.0f;  // one element per lane changed through thread_elements
    simdgroup_store(F, filled, 8);
"""


def test_thread_elements_layout_and_filled_matrix(seed):
    """Lane l holds row fm(l), columns fn(l), fn(l)+1 (Apple's layout, as MLX's steel GEMM reads it)."""
    m = np.random.default_rng(seed).standard_normal(64).astype(np.float32)
    elements, filled = run("shim_layout", LAYOUT_SOURCE, dict(m=mx.array(m)),
                           dict(elements=((64,), mx.float32), filled=((64,), mx.float32)))
    np.testing.assert_array_equal(elements, m)
    expected = np.full((8, 8), 2.5, np.float32)
    expected[:, 1::2] = -1.0  # element 1 of every lane is an odd column
    np.testing.assert_array_equal(filled.reshape(8, 8), expected)


THREADGROUP_SOURCE = """
    // two simdgroups: each stages its own matrix in threadgroup memory, then multiplies the
    // other's by its own (a barrier between the writes and the loads)
    threadgroup float tiles[2 * 64];
    const uint tid = thread_position_in_threadgroup.x;
    const uint sg = simdgroup_index_in_threadgroup;
    for (uint e = tid; e < 128; e += 64) tiles[e] = x[e];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 A, B, D;
    simdgroup_load(A, tiles + (1 - sg) * 64, 8);
    simdgroup_load(B, tiles + sg * 64, 8, ulong2(0, 0), true);
    simdgroup_multiply(D, A, B);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_store(D, tiles + sg * 64, 8);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = tid; e < 128; e += 64) y[e] = tiles[e];
"""


def test_threadgroup_memory_and_two_simdgroups(seed):
    x = np.random.default_rng(seed).standard_normal(128).astype(np.float32)
    (y,) = run("shim_threadgroup", THREADGROUP_SOURCE, dict(x=mx.array(x)), dict(y=((128,), mx.float32)), threads=64)
    m = x.reshape(2, 8, 8).astype(np.float64)
    np.testing.assert_allclose(y.reshape(2, 8, 8), [m[1] @ m[0].T, m[0] @ m[1].T], rtol=1e-5, atol=1e-5)
    assert harness.last_threadgroup_bytes == 2 * 64 * 4


def test_threadgroup_memory_is_poisoned_at_each_group_start(seed):
    """Group 0 writes its threadgroup memory; group 1 reads it without writing: NaN, not group 0's data."""
    source = """
        threadgroup float scratch[32];
        const uint tid = thread_position_in_threadgroup.x;
        if (threadgroup_position_in_grid.x == 0) scratch[tid] = x[tid];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        y[threadgroup_position_in_grid.x * 32 + tid] = scratch[31 - tid];
    """
    x = np.random.default_rng(seed).standard_normal(32).astype(np.float32)
    (y,) = run("shim_poison", source, dict(x=mx.array(x)), dict(y=((64,), mx.float32)), groups=2)
    np.testing.assert_array_equal(y[:32], x[::-1])
    assert np.isnan(y[32:]).all()


def test_uninitialised_matrix_is_nan():
    source = """
        simdgroup_float8x8 A, B = make_filled_simdgroup_matrix<float, 8>(1.0f), D;
        simdgroup_multiply(D, A, B);
        simdgroup_store(D, y, 8);
    """
    (y,) = run("shim_uninitialised", source, dict(x=mx.zeros(1)), dict(y=((64,), mx.float32)))
    assert np.isnan(y).all()


@pytest.mark.parametrize("case,message", [
    ("divergent", "deadlock"),
    ("different", "different simdgroup operations"),
    ("lane_pointer", "different pointer"),
    ("origin", "matrix_origin"),
])
def test_misuse_is_reported(case, message):
    body = {
        "divergent": "if (lane >= 16) { return; } simdgroup_multiply(D, A, A);",
        "different": "if (lane < 16) { simdgroup_multiply(D, A, A); } else { simdgroup_barrier(mem_flags::mem_none); }",
        "lane_pointer": "simdgroup_load(D, x + (lane % 2), 8);",
        "origin": "simdgroup_load(D, x, 8, ulong2(1, 0));",
    }[case]
    source = f"""
        const uint lane = thread_index_in_simdgroup;
        simdgroup_float8x8 A = make_filled_simdgroup_matrix<float, 8>(1.0f), D = A;
        {body}
        simdgroup_store(D, y, 8);
    """
    with pytest.raises(harness.HarnessError, match=message):
        run(f"shim_misuse_{case}", source, dict(x=mx.zeros(80)), dict(y=((64,), mx.float32)), schedules=(0,))
