"""The MLX Metal kernels, executed on the CPU: the exact source MLX generates, compiled with g++
against tests/metal_harness/metal_shim.h, every threadgroup run as fibers under several thread
schedules, compared with the float64 spec (forward and every gradient).

Every kernel launch of ``gdn2.mlx.metal`` goes through ``harness_launcher`` here, so these tests
cover the Python orchestration, the ``mx.custom_function`` vjp and the Metal source together.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from gdn2 import spec  # noqa: E402
from gdn2.mlx import metal  # noqa: E402
from gdn2.mlx.metal import scan_source as metal_source  # noqa: E402
from gdn2.testing import (  # noqa: E402
    GRAD_NAMES,
    Shape,
    assert_close,
    make_case,
    mlx_arrays,
    mlx_gradients,
    packed_case,
    random_lengths,
    rounded_case,
    run_mlx,
)
from tests.metal_harness import harness  # noqa: E402

SMALL = dict(forward=metal.Geometry(2, 2), backward=metal.Geometry(2, 2))  # 64 threads, 4-column tiles
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"

# (shape, checkpoint interval, threadgroup geometry): T a multiple of no interval (nor of the
# staged block), K != V, K not a multiple of 32, several value tiles; the default geometry once;
# decode.
SHAPES = [
    (Shape(1, 7, 2, 40, 10), 3, SMALL),
    (Shape(2, 13, 1, 32, 24), 5, SMALL),
    (Shape(1, 37, 1, 64, 6), 16, SMALL),
    (Shape(1, 11, 1, 48, 20), 4, None),
    (Shape(1, 3, 1, 256, 256), 2, None),  # the largest K and V: 8 key channels per lane
    (Shape(1, 1, 2, 16, 8), 64, SMALL),
]
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 2.5e-2}


def shape_id(value) -> str:
    if isinstance(value, Shape):
        return str(value)
    if isinstance(value, int):
        return f"interval{value}"
    return "small-tiles" if value else "default-tiles"


def rounded_to(dtype: str):
    """Round float64 numpy values to an MLX dtype and back."""
    return lambda x: np.array(mx.array(x.astype(np.float32)).astype(getattr(mx, dtype)).astype(mx.float32), dtype=np.float64)


def metal_case(shape: Shape, seed, dtype="float32"):
    """A case whose inputs are rounded to ``dtype`` (the spec sees the rounded values)."""
    return rounded_case(shape.case(seed, reference=False), rounded_to(dtype))


def run_kernel_path(case, dtype, checkpoint_interval, geometry):
    """Forward and every gradient of ``metal_gdn2``, every launch through the harness."""
    kernel = partial(metal.metal_gdn2, scale=case["inputs"]["q"].shape[-1] ** -0.5, checkpoint_interval=checkpoint_interval)
    with metal.use_launcher(harness.harness_launcher), metal.use_geometry(**(geometry or {})):
        return mlx_gradients(case, dtype, kernel)


def check_every_output(result, case, tolerance, dtype):
    for name, value in result.items():
        assert_close(name, value, case["expected"][name], tolerance)
    for name in GRAD_NAMES:  # gradients in the dtype of their input
        assert result.dtypes[f"d{name}"] == ("float32" if name == "initial_state" else dtype), name


@pytest.mark.parametrize("shape,checkpoint_interval,geometry", SHAPES, ids=shape_id)
def test_kernel_matches_spec_forward_and_every_gradient(shape, checkpoint_interval, geometry, seed):
    case = metal_case(shape, seed)
    result = run_kernel_path(case, "float32", checkpoint_interval, geometry)
    check_every_output(result, case, TOLERANCE["float32"], "float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_inputs_float32_state(dtype, seed):
    case = metal_case(Shape(1, 9, 2, 40, 12), seed, dtype)
    result = run_kernel_path(case, dtype, 4, SMALL)
    assert result.dtypes["o"] == dtype and result.dtypes["final_state"] == "float32"
    assert_close("final_state", result.pop("final_state"), case["expected"]["final_state"], 1e-5)  # float32 state, float32 math
    check_every_output(result, case, TOLERANCE[dtype], dtype)


def test_strong_decay_stays_finite_and_accurate(seed):
    """g anywhere in [-20, 0] over a long sequence: every exponent is one step's g."""
    case = metal_case(Shape(1, 45, 1, 32, 8, log_decay_range=(-20.0, 0.0)), seed)
    result = run_kernel_path(case, "float32", 16, SMALL)
    check_every_output(result, case, 2e-5, "float32")


def as64(x) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def test_decode_steps_continue_a_prefill(seed):
    """T == 1 with a state, step after step, reproduces the spec over the whole sequence."""
    B, T, H, K, V = 1, 4, 2, 24, 8
    case = metal_case(Shape(B, T, H, K, V), seed)
    a = mlx_arrays(case, "float32")
    state = a["initial_state"]
    outputs = []
    with metal.use_launcher(harness.harness_launcher), metal.use_geometry(**SMALL):
        for t in range(T):
            step = [a[n][:, t : t + 1] for n in spec.INPUT_NAMES]
            o, state = metal.metal_gdn2(*step, scale=K**-0.5, initial_state=state, output_final_state=True)
            assert o.shape == (B, 1, H, V) and state.shape == (B, H, K, V)
            outputs.append(as64(o))
    assert_close("o (decode)", np.concatenate(outputs, axis=1), case["expected"]["o"], 2e-5)
    assert_close("final_state (decode)", as64(state), case["expected"]["final_state"], 2e-5)


def test_no_initial_state_and_no_final_state(seed):
    B, T, H, K, V = 1, 6, 1, 32, 8
    case = rounded_case(make_case(B, T, H, K, V, seed, with_state=False, reference=False), rounded_to("float32"))
    a = mlx_arrays(case, "float32")
    with metal.use_launcher(harness.harness_launcher), metal.use_geometry(**SMALL):
        o, final = metal.metal_gdn2(*(a[n] for n in spec.INPUT_NAMES), scale=K**-0.5, initial_state=None,
                                    output_final_state=False, checkpoint_interval=4)
    assert final is None
    assert_close("o", as64(o), case["expected"]["o"], 2e-5)


# ---- the generated source and the harness itself ----------------------------------------------


def small_launches(seed):
    case = make_case(1, 40, 1, 64, 6, seed, reference=False)
    a = mlx_arrays(case, "float32")
    inputs = [a[n] for n in spec.INPUT_NAMES]
    d_o = mx.array(case["d_o"].astype(np.float32))
    d_final = mx.array(case["d_final_state"].astype(np.float32))
    return inputs, a["initial_state"], d_o, d_final


def test_generated_source_is_complete_and_pinned(seed):
    """MLX 0.32 prints the whole generated kernel while tracing under mx.export_function."""
    inputs, state, _, _ = small_launches(seed)
    with metal.use_geometry(**SMALL):
        launch = metal.forward_launch(*inputs, state, 0.125, 16, save=True)
    source = harness.generated_source(launch)
    name, template_args, parameters = harness.parse_signature(source)
    assert name.startswith("custom_kernel_gdn2_forward")
    assert template_args.startswith("float, 1, 64, 6, 2, 2, 2, 16, 16, 1")  # InT H K V KPL NS CPS C L SAVE
    buffers = [p.name for p in parameters if p.attribute == "buffer"]
    assert buffers == list(metal_source.FORWARD_INPUTS + metal_source.FORWARD_OUTPUTS)
    assert {p.attribute for p in parameters} - {"buffer"} == {
        "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup", "thread_position_in_threadgroup",
        "threadgroup_position_in_grid"}
    for line in metal_source.FORWARD_SOURCE.strip().splitlines():  # the body, verbatim
        assert line.strip() in source
    assert f"template [[host_name(\"{name}\")]] [[kernel]] decltype({name}<" in source


def drop_barrier(source: str, index: int) -> str:
    parts = source.split(BARRIER)
    assert len(parts) > index + 1
    return BARRIER.join(parts[: index + 1]) + "/* barrier removed */" + BARRIER.join(parts[index + 1 :])


@pytest.mark.parametrize("kernel,index", [("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1),
                                          ("backward", 2), ("backward", 3)])
def test_harness_reports_a_missing_barrier(kernel, index, seed):
    inputs, state, d_o, d_final = small_launches(seed)
    with metal.use_geometry(**SMALL):
        if kernel == "forward":
            intact = metal.forward_launch(*inputs, state, 0.125, 16, save=True)
            broken = metal.forward_launch(*inputs, state, 0.125, 16, save=True, name=f"gdn2_forward_nobarrier{index}",
                                          source=drop_barrier(metal_source.FORWARD_SOURCE, index))
        else:
            checkpoints = harness.harness_launcher(metal.forward_launch(*inputs, state, 0.125, 16, save=True))[2]
            intact = metal.backward_launch(*inputs, d_o, d_final, checkpoints, 0.125, 16)
            broken = metal.backward_launch(*inputs, d_o, d_final, checkpoints, 0.125, 16,
                                           name=f"gdn2_backward_nobarrier{index}",
                                           source=drop_barrier(metal_source.BACKWARD_SOURCE, index))
    harness.run_launch(intact, seed=seed)  # the real kernel: identical bits under every schedule
    with pytest.raises(harness.ScheduleDependentResult, match="missing threadgroup_barrier"):
        harness.run_launch(broken, seed=seed)


def test_harness_reports_a_divergent_barrier(seed):
    inputs, state, _, _ = small_launches(seed)
    source = metal_source.FORWARD_SOURCE.replace(BARRIER, "if (lane == 3) return;\n" + BARRIER, 1)
    with metal.use_geometry(**SMALL):
        launch = metal.forward_launch(*inputs, state, 0.125, 16, save=False, name="gdn2_forward_divergent", source=source)
    with pytest.raises(harness.HarnessError, match="divergent barrier|deadlock"):
        harness.run_launch(launch, schedules=(0,))


# ---- availability and fallback ----------------------------------------------------------------


def test_unsupported_reasons(monkeypatch, seed):
    a = mlx_arrays(make_case(1, 2, 1, 8, 4, seed, reference=False), "float32")
    args = [a[n] for n in spec.INPUT_NAMES]
    if not mx.metal.is_available():
        assert metal.unsupported_reason(*args, None, 64) == "Metal is not available on this machine"
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert metal.unsupported_reason(*args, None, 64) is None
    wide = mx.zeros((1, 2, 1, 300))
    assert metal.unsupported_reason(wide, wide, args[2], wide, wide, args[5], None, 64) == "K=300 > 256"
    assert "float64" in metal.unsupported_reason(*(x.astype(mx.float64) for x in args), None, 64)


def test_fallback_when_metal_is_missing_or_fails(monkeypatch, seed, fresh_path_log):
    """The MLX API gives way to the chunk path with one warning; the results stay right."""
    import gdn2.mlx as api

    case = metal_case(Shape(1, 6, 1, 16, 8), seed)
    arguments = dict(mlx_arrays(case, "float32"), output_final_state=True, chunk_size=4, path="kernel")
    if not mx.metal.is_available():
        with pytest.warns(RuntimeWarning, match="Metal is not available"):
            o, final = api.chunk_gdn2(**arguments)
        assert_close("o (no Metal)", as64(o), case["expected"]["o"], 2e-5)

    def failing_launcher(launch):
        raise RuntimeError(f"Unable to build metal library from source for {launch.name} (seed {seed})")

    monkeypatch.setattr(metal, "unsupported_reason", lambda *args, **kwargs: None)
    with metal.use_launcher(failing_launcher), pytest.warns(RuntimeWarning, match="Metal kernel failed"):
        o, final = api.chunk_gdn2(**arguments)
    assert_close("o (kernel failed)", as64(o), case["expected"]["o"], 2e-5)
    assert_close("final_state (kernel failed)", as64(final), case["expected"]["final_state"], 2e-5)


@pytest.fixture
def harness_launches(monkeypatch, fresh_path_log):
    """The MLX API's kernel path taken as available, every launch run by the harness with small
    tiles; yields the names of the kernels launched."""
    monkeypatch.setattr(metal, "unsupported_reason", lambda *args, **kwargs: None)
    used = []

    def counting_launcher(launch):
        used.append(launch.name)
        return harness.harness_launcher(launch)

    with metal.use_launcher(counting_launcher), metal.use_geometry(**SMALL):
        yield used


no_fallback = pytest.mark.filterwarnings("error")  # a fallback to another path warns: make it a failure


@no_fallback
def test_mlx_api_kernel_path_end_to_end(harness_launches, seed):
    """gdn2.mlx.chunk_gdn2(path='kernel') runs the Metal source (through the harness) under mx.grad."""
    import gdn2.mlx as api

    case = metal_case(Shape(1, 9, 2, 24, 8), seed)
    a = mlx_arrays(case, "float32")
    assert api.which_path(a["q"], a["k"], a["v"], a["g"], a["b"], a["w"], path="kernel").path == "kernel"
    d_o = mx.array(case["d_o"].astype(np.float32))

    def loss(q):
        o, _ = api.chunk_gdn2(q, a["k"], a["v"], a["g"], a["b"], a["w"], initial_state=a["initial_state"],
                              chunk_size=4, path="kernel")
        return (o * d_o).sum()

    d_q = mx.grad(loss)(a["q"])
    assert "gdn2_backward" in harness_launches and "gdn2_forward" in harness_launches
    expected = spec.reference_backward(**case["inputs"], d_o=case["d_o"])
    assert_close("dq (API)", as64(d_q), expected["q"], 2e-5)


def test_harness_reports_a_write_out_of_bounds(seed):
    """Drop the column mask of the final-state write: columns past V spill out of the buffer."""
    inputs, state, _, _ = small_launches(seed)  # V = 6 with 4-column tiles: 2 padded columns
    masked = "if (kk < K && j < V) {\n                final_state["
    assert masked in metal_source.FORWARD_SOURCE
    source = metal_source.FORWARD_SOURCE.replace(masked, "if (kk < K) {\n                final_state[")
    with metal.use_geometry(**SMALL):
        launch = metal.forward_launch(*inputs, state, 0.125, 16, save=False, name="gdn2_forward_unmasked", source=source)
    with pytest.raises(harness.OutOfBounds, match="final_state"):
        harness.run_launch(launch, schedules=(0,))


@no_fallback
def test_packed_sequences_on_the_kernel_path(harness_launches, seed):
    """cu_seqlens through the Metal kernels (run by the harness, as a zero-padded batch): equal to
    each sequence run alone, outputs, final states and every gradient."""
    case = packed_case(seed, random_lengths(seed, 3), H=1, K=16, V=8)
    result = run_mlx(case, "float32", 8, "kernel")
    assert "gdn2_backward" in harness_launches
    for name, value in result.items():
        assert_close(f"{name} (packed)", value, case["expected"][name], 2e-5)


@no_fallback
def test_recurrent_decode_step_runs_the_kernel(harness_launches, seed):
    """gdn2.mlx.recurrent_gdn2 with T == 1 and a state (the layer's decode step) runs the Metal
    kernel where it can, and equals the spec."""
    import gdn2.mlx as api

    case = metal_case(Shape(1, 1, 2, 24, 8), seed)
    a = mlx_arrays(case, "float32")
    o, state = api.recurrent_gdn2(*(a[n] for n in spec.INPUT_NAMES), initial_state=a["initial_state"],
                                  output_final_state=True)
    mx.eval(o, state)
    assert "gdn2_forward" in harness_launches
    assert_close("o (recurrent decode)", as64(o), case["expected"]["o"], 2e-5)
    assert_close("final_state (recurrent decode)", as64(state), case["expected"]["final_state"], 2e-5)
