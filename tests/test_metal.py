"""The MLX Metal kernels, executed on the CPU: the exact source MLX generates, compiled with g++
against tests/metal_harness/metal_shim.h, every threadgroup run as fibers under several thread
schedules, compared with the float64 spec (forward and every gradient).

Every kernel launch of ``gdn2.mlx.metal`` goes through ``harness_launcher`` here, so these tests
cover the Python orchestration, the ``mx.custom_function`` vjp and the Metal source together.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.metal_harness` under plain `pytest` too

from gdn2 import paths, spec  # noqa: E402
from gdn2.mlx import metal  # noqa: E402
from gdn2.mlx.metal import scan_source as metal_source  # noqa: E402
from tests.metal_harness import harness  # noqa: E402

SMALL = dict(forward=metal.Geometry(2, 2), backward=metal.Geometry(2, 2))  # 64 threads, 4-column tiles
NAMES = spec.INPUT_NAMES + ("initial_state",)
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"

# (B, T, H, K, V, chunk_size, geometry): T a multiple of no chunk (nor of the staged block),
# K != V, K not a multiple of 32, several value tiles; the default geometry once; decode.
SHAPES = [
    (1, 7, 2, 40, 10, 3, SMALL),
    (2, 13, 1, 32, 24, 5, SMALL),
    (1, 37, 1, 64, 6, 16, SMALL),
    (1, 11, 1, 48, 20, 4, None),
    (1, 3, 1, 256, 256, 2, None),  # the largest K and V: 8 key channels per lane
    (1, 1, 2, 16, 8, 64, SMALL),
]
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 2.5e-2}


def make_case(B, T, H, K, V, seed, dtype="float32", log_decay_range=(-3.0, 0.0)):
    """Inputs rounded to ``dtype`` (the spec sees the rounded values), cotangents, spec results."""
    x = spec.random_inputs(B, T, H, K, V, seed, log_decay_range=log_decay_range)
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


def run_kernel_path(case, chunk_size, geometry, with_grad=True):
    """Forward (and gradients of sum(o*d_o) + sum(final*d_final)) through the harness."""
    a = case["arrays"]
    scale = case["K"] ** -0.5
    d_o = mx.array(case["d_o"].astype(np.float32))
    d_final = mx.array(case["d_final"].astype(np.float32))

    def loss(*inputs):
        o, final = metal.metal_gdn2(*inputs[:6], scale=scale, initial_state=inputs[6], output_final_state=True,
                                     checkpoint_interval=chunk_size)
        return (o.astype(mx.float32) * d_o).sum() + (final * d_final).sum(), (o, final)

    with metal.use_launcher(harness.harness_launcher), metal.use_geometry(**(geometry or {})):
        if not with_grad:
            return loss(*(a[n] for n in NAMES))[1], None
        (_, (o, final)), grads = mx.value_and_grad(loss, argnums=tuple(range(7)))(*(a[n] for n in NAMES))
        mx.eval(o, final, grads)
    return (o, final), dict(zip(NAMES, grads))


def check(name, got, expected, tolerance, seed):
    error = spec.relative_error(got, expected)
    assert error < tolerance, f"{name}: relative error {error:.3e} >= {tolerance:.1e} (seed={seed})"
    return error


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}C{}{}".format(*s[:6], "" if s[6] else "-default"))
def test_kernel_matches_spec_forward_and_every_gradient(shape, seed):
    B, T, H, K, V, chunk_size, geometry = shape
    case = make_case(B, T, H, K, V, seed)
    (o, final), grads = run_kernel_path(case, chunk_size, geometry)
    tolerance = TOLERANCE["float32"]
    check("o", as64(o), case["o"], tolerance, seed)
    check("final_state", as64(final), case["final"], tolerance, seed)
    for name in NAMES:
        assert grads[name].dtype == case["arrays"][name].dtype
        check(f"d{name}", as64(grads[name]), case["grads"][name], tolerance, seed)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_inputs_float32_state(dtype, seed):
    case = make_case(1, 9, 2, 40, 12, seed, dtype=dtype)
    (o, final), grads = run_kernel_path(case, 4, SMALL)
    assert o.dtype == getattr(mx, dtype) and final.dtype == mx.float32
    tolerance = TOLERANCE[dtype]
    check("o", as64(o), case["o"], tolerance, seed)
    check("final_state", as64(final), case["final"], 1e-5, seed)  # float32 state, float32 math
    for name in NAMES:
        assert grads[name].dtype == case["arrays"][name].dtype
        check(f"d{name}", as64(grads[name]), case["grads"][name], tolerance, seed)


def test_strong_decay_stays_finite_and_accurate(seed):
    """g anywhere in [-20, 0] over a long sequence: every exponent is one step's g."""
    case = make_case(1, 45, 1, 32, 8, seed, log_decay_range=(-20.0, 0.0))
    (o, final), grads = run_kernel_path(case, 16, SMALL)
    check("o", as64(o), case["o"], 2e-5, seed)
    check("final_state", as64(final), case["final"], 2e-5, seed)
    for name in NAMES:
        check(f"d{name}", as64(grads[name]), case["grads"][name], 2e-5, seed)


def test_decode_steps_continue_a_prefill(seed):
    """T == 1 with a state, step after step, reproduces the spec over the whole sequence."""
    B, T, H, K, V = 1, 4, 2, 24, 8
    case = make_case(B, T, H, K, V, seed)
    a = case["arrays"]
    state = a["initial_state"]
    outputs = []
    with metal.use_launcher(harness.harness_launcher), metal.use_geometry(**SMALL):
        for t in range(T):
            step = [a[n][:, t : t + 1] for n in spec.INPUT_NAMES]
            o, state = metal.metal_gdn2(*step, scale=K**-0.5, initial_state=state, output_final_state=True)
            assert o.shape == (B, 1, H, V) and state.shape == (B, H, K, V)
            outputs.append(as64(o))
    check("o (decode)", np.concatenate(outputs, axis=1), case["o"], 2e-5, seed)
    check("final_state (decode)", as64(state), case["final"], 2e-5, seed)


def test_no_initial_state_and_no_final_state(seed):
    B, T, H, K, V = 1, 6, 1, 32, 8
    case = make_case(B, T, H, K, V, seed)
    a = dict(case["arrays"])
    zero_state = {n: np.array(a[n].astype(mx.float32), dtype=np.float64) for n in spec.INPUT_NAMES}
    expected, _ = spec.reference_forward(**zero_state)
    with metal.use_launcher(harness.harness_launcher), metal.use_geometry(**SMALL):
        o, final = metal.metal_gdn2(*(a[n] for n in spec.INPUT_NAMES), scale=K**-0.5, initial_state=None,
                                     output_final_state=False, checkpoint_interval=4)
    assert final is None
    check("o", as64(o), expected, 2e-5, seed)


# ---- the generated source and the harness itself ----------------------------------------------


def small_launches(seed):
    case = make_case(1, 40, 1, 64, 6, seed)
    a = case["arrays"]
    inputs = [a[n] for n in spec.INPUT_NAMES]
    d_o = mx.array(case["d_o"].astype(np.float32))
    d_final = mx.array(case["d_final"].astype(np.float32))
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
    a = make_case(1, 2, 1, 8, 4, seed)["arrays"]
    args = [a[n] for n in spec.INPUT_NAMES]
    if not mx.metal.is_available():
        assert metal.unsupported_reason(*args, None, 64) == "Metal is not available on this machine"
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert metal.unsupported_reason(*args, None, 64) is None
    wide = mx.zeros((1, 2, 1, 300))
    assert metal.unsupported_reason(wide, wide, args[2], wide, wide, args[5], None, 64) == "K=300 > 256"
    assert "float64" in metal.unsupported_reason(*(x.astype(mx.float64) for x in args), None, 64)


def api_arguments(case):
    a = case["arrays"]
    return dict(q=a["q"], k=a["k"], v=a["v"], g=a["g"], b=a["b"], w=a["w"], initial_state=a["initial_state"])


def test_fallback_when_metal_is_missing_or_fails(monkeypatch, seed, fresh_path_log):
    """The MLX API gives way to the chunk path with one warning; the results stay right."""
    import gdn2.mlx as api

    case = make_case(1, 6, 1, 16, 8, seed)
    arguments = dict(api_arguments(case), output_final_state=True, chunk_size=4, path="kernel")
    if not mx.metal.is_available():
        with pytest.warns(RuntimeWarning, match="Metal is not available"):
            o, final = api.chunk_gdn2(**arguments)
        check("o (no Metal)", as64(o), case["o"], 2e-5, seed)

    def failing_launcher(launch):
        raise RuntimeError(f"Unable to build metal library from source for {launch.name} (seed {seed})")

    monkeypatch.setattr(metal, "unsupported_reason", lambda *args, **kwargs: None)
    with metal.use_launcher(failing_launcher), pytest.warns(RuntimeWarning, match="Metal kernel failed"):
        o, final = api.chunk_gdn2(**arguments)
    check("o (kernel failed)", as64(o), case["o"], 2e-5, seed)
    check("final_state (kernel failed)", as64(final), case["final"], 2e-5, seed)


def test_mlx_api_kernel_path_end_to_end(monkeypatch, seed):
    """gdn2.mlx.chunk_gdn2(path='kernel') runs the Metal source (through the harness) under mx.grad."""
    import gdn2.mlx as api

    case = make_case(1, 9, 2, 24, 8, seed)
    monkeypatch.setattr(metal, "unsupported_reason", lambda *args, **kwargs: None)
    a = case["arrays"]
    assert api.which_path(a["q"], a["k"], a["v"], a["g"], a["b"], a["w"], path="kernel").path == "kernel"
    d_o = mx.array(case["d_o"].astype(np.float32))

    def loss(q):
        o, _ = api.chunk_gdn2(q, a["k"], a["v"], a["g"], a["b"], a["w"], initial_state=a["initial_state"],
                              chunk_size=4, path="kernel")
        return (o * d_o).sum()

    used = []

    def counting_launcher(launch):
        used.append(launch.name)
        return harness.harness_launcher(launch)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback may happen
        with metal.use_launcher(counting_launcher), metal.use_geometry(**SMALL):
            d_q = mx.grad(loss)(a["q"])
    assert "gdn2_backward" in used and "gdn2_forward" in used
    expected = spec.reference_backward(**{n: np.array(a[n], dtype=np.float64) for n in NAMES}, d_o=case["d_o"])
    check("dq (API)", as64(d_q), expected["q"], 2e-5, seed)


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


def test_packed_sequences_on_the_kernel_path(monkeypatch, seed, fresh_path_log):
    """cu_seqlens through the Metal kernels (run by the harness, as a zero-padded batch): equal to
    each sequence run alone, outputs, final states and every gradient."""
    from frameworks import packed_case, random_lengths, run_packed_mlx

    case = packed_case(seed, random_lengths(seed, 3), H=1, K=16, V=8)
    monkeypatch.setattr(metal, "unsupported_reason", lambda *args, **kwargs: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback may happen
        with metal.use_launcher(harness.harness_launcher), metal.use_geometry(**SMALL):
            result = run_packed_mlx(case, "kernel", 8)
    for name, value in result.items():
        check(f"{name} (packed)", value, case["expected"][name], 2e-5, seed)


def test_recurrent_decode_step_runs_the_kernel(monkeypatch, seed, fresh_path_log):
    """gdn2.mlx.recurrent_gdn2 with T == 1 and a state (the layer's decode step) runs the Metal
    kernel where it can, and equals the spec."""
    import gdn2.mlx as api

    case = make_case(1, 1, 2, 24, 8, seed)
    a = case["arrays"]
    monkeypatch.setattr(metal, "unsupported_reason", lambda *args, **kwargs: None)
    used = []

    def counting_launcher(launch):
        used.append(launch.name)
        return harness.harness_launcher(launch)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback may happen
        with metal.use_launcher(counting_launcher), metal.use_geometry(**SMALL):
            o, state = api.recurrent_gdn2(*(a[n] for n in spec.INPUT_NAMES), initial_state=a["initial_state"],
                                          output_final_state=True)
            mx.eval(o, state)
    assert "gdn2_forward" in used
    check("o (recurrent decode)", as64(o), case["o"], 2e-5, seed)
    check("final_state (recurrent decode)", as64(state), case["final"], 2e-5, seed)
