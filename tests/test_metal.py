"""The MLX Metal path end to end, executed on the CPU: the exact source MLX generates, compiled with
g++ against tests/metal_harness/metal_shim.h, every threadgroup run as fibers under several thread
schedules, compared with the float64 spec (forward and every gradient).

Every kernel launch of ``gdn2.mlx.metal`` goes through ``harness_launcher`` here, so these tests
cover the public API, the path and kernel choice, the ``mx.custom_function`` vjp and the Metal
source together. The kernels themselves are tested shape by shape in ``test_metal_chunked.py`` and
``test_metal_scan.py``.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from gdn2 import spec  # noqa: E402
from gdn2.mlx import metal  # noqa: E402
from gdn2.mlx.metal import chunked, scan  # noqa: E402
from gdn2.mlx.metal import chunked_source, scan_source  # noqa: E402
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

# 64-thread scan groups with 4-column tiles, chunks of 16: short inputs span several of each
SMALL = dict(forward=scan.ScanGeometry(2, 2), backward=scan.ScanGeometry(2, 2), chunk=chunked.ChunkGeometry(chunk=16))
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"
KINDS = ("scan", "chunked")
LAUNCHED = dict(scan="gdn2_scan_backward", chunked="gdn2_chunk_backward")  # a backward of each family


def rounded_to(dtype: str):
    """Round float64 numpy values to an MLX dtype and back."""
    return lambda x: np.array(mx.array(x.astype(np.float32)).astype(getattr(mx, dtype)).astype(mx.float32), dtype=np.float64)


def metal_case(shape: Shape, seed, dtype="float32", **options):
    """A case whose inputs are rounded to ``dtype`` (the spec sees the rounded values)."""
    return rounded_case(shape.case(seed, reference=False, **options), rounded_to(dtype))


def as64(x) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def check_every_output(result, case, tolerance, dtype):
    for name, value in result.items():
        assert_close(name, value, case["expected"][name], tolerance)
    for name in GRAD_NAMES:  # gradients in the dtype of their input
        assert result.dtypes[f"d{name}"] == ("float32" if name == "initial_state" else dtype), name


@pytest.mark.parametrize("kind", KINDS)
def test_metal_gdn2_matches_spec_forward_and_every_gradient(kind, monkeypatch, seed):
    """metal_gdn2 with each kernel family forced; T a multiple of no chunk, K != V."""
    monkeypatch.setenv("GDN2_METAL_KERNEL", kind)
    case = metal_case(Shape(2, 21, 2, 24, 10), seed)
    kernel = partial(metal.metal_gdn2, scale=24**-0.5, checkpoint_interval=8)
    with metal.use_launcher(harness.harness_launcher), metal.use_geometry(**SMALL):
        result = mlx_gradients(case, "float32", kernel)
    check_every_output(result, case, 2e-5, "float32")


def test_decode_steps_continue_a_prefill(seed):
    """T == 1 with a state (the scan), step after step, reproduces the spec over the whole sequence."""
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


@pytest.mark.parametrize("kind", KINDS)
def test_no_initial_state_and_no_final_state(kind, monkeypatch, seed):
    monkeypatch.setenv("GDN2_METAL_KERNEL", kind)
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
    return [a[n] for n in spec.INPUT_NAMES], a["initial_state"]


def test_generated_source_is_complete_and_pinned(seed):
    """MLX 0.32 prints the whole generated kernel (header, signature, body, instantiation) while
    tracing under mx.export_function; T and H are runtime values, not template arguments."""
    inputs, state = small_launches(seed)
    geometry = chunked.geometry_for(64)
    matrices = [mx.zeros(shape) for shape in chunked.intra_launch(*inputs[:2], *inputs[3:5], geometry).output_shapes]
    launches = [
        (scan.forward_launch(*inputs, state, 0.125, 16, save=True, geometry=scan.ScanGeometry(2, 2)),
         scan_source, "FORWARD", "float, 64, 6, 2, 2, 2, 16, 16, 1", ""),  # InT K V KPL NS CPS C L SAVE
        (chunked.forward_launch(*inputs, state, *matrices, 0.125, geometry, True),
         chunked_source, "FORWARD", "float, 64, 32, 4, 32", chunked_source.HEADER),  # InT K C NS BK
    ]
    for launch, module, kernel, template, header in launches:
        source = harness.generated_source(launch)
        name, template_args, parameters = harness.parse_signature(source)
        assert name.startswith(f"custom_kernel_{launch.name}")
        assert template_args == template
        buffers = [p.name for p in parameters if p.attribute == "buffer"]
        assert buffers == list(getattr(module, f"{kernel}_INPUTS") + getattr(module, f"{kernel}_OUTPUTS"))
        assert {p.attribute for p in parameters} - {"buffer"} == {
            "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup", "thread_position_in_threadgroup",
            "threadgroup_position_in_grid"}
        for line in (header + getattr(module, f"{kernel}_SOURCE")).strip().splitlines():  # verbatim
            assert line.strip() in source
        assert f"template [[host_name(\"{name}\")]] [[kernel]] decltype({name}<" in source


def test_harness_reports_a_divergent_barrier(seed):
    inputs, state = small_launches(seed)
    source = scan_source.FORWARD_SOURCE.replace(BARRIER, "if (lane == 3) return;\n" + BARRIER, 1)
    launch = scan.forward_launch(*inputs, state, 0.125, 16, False, scan.ScanGeometry(2, 2), source,
                                 "gdn2_scan_forward_divergent")
    with pytest.raises(harness.HarnessError, match="divergent barrier|deadlock"):
        harness.run_launch(launch, schedules=(0,))


def test_harness_reports_a_write_out_of_bounds(seed):
    """Drop the column mask of the final-state write: columns past V spill out of the buffer."""
    inputs, state = small_launches(seed)  # V = 6 with 4-column tiles: 2 padded columns
    masked = "if (kk < K && j < V) {\n                final_state["
    assert masked in scan_source.FORWARD_SOURCE
    source = scan_source.FORWARD_SOURCE.replace(masked, "if (kk < K) {\n                final_state[")
    launch = scan.forward_launch(*inputs, state, 0.125, 16, False, scan.ScanGeometry(2, 2), source,
                                 "gdn2_scan_forward_unmasked")
    with pytest.raises(harness.OutOfBounds, match="final_state"):
        harness.run_launch(launch, schedules=(0,))


# ---- availability, choice and fallback --------------------------------------------------------


def test_unsupported_reasons(monkeypatch, seed):
    a = mlx_arrays(make_case(1, 2, 1, 8, 4, seed, reference=False), "float32")
    args = [a[n] for n in spec.INPUT_NAMES]
    if not mx.metal.is_available():
        assert metal.unsupported_reason(*args, None, 64) == "Metal is not available on this machine"
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    # a Mac whose MLX runs on the CPU device (no GPU, or mx.set_default_device(mx.cpu))
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert "default device is the CPU" in metal.unsupported_reason(*args, None, 64)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert metal.unsupported_reason(*args, None, 64) is None
    wide = mx.zeros((1, 2, 1, 300))
    assert metal.unsupported_reason(wide, wide, args[2], wide, wide, args[5], None, 64) == "K=300 > 256"
    assert "float64" in metal.unsupported_reason(*(x.astype(mx.float64) for x in args), None, 64)


def test_which_path_names_the_kernels_and_why(monkeypatch, fresh_path_log):
    """The reason of a kernel choice names the kernel family and the estimate behind it; on the
    CPU device the kernel path is not chosen, with the reason."""
    import gdn2.mlx as api

    def arrays(T):  # B=8 H=16 K=V=128: the chunked kernels' estimate wins forward and backward
        x = mx.zeros((8, T, 16, 128))
        return x, x, x, x, x, x

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    choice = api.which_path(*arrays(4096))
    assert choice.path == "chunk" and "default device is the CPU" in choice.reason
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    training = api.which_path(*arrays(4096))
    assert training.path == "kernel" and "chunked kernels (estimated" in training.reason
    decode = api.which_path(*arrays(1))
    assert decode.path == "kernel" and "scan kernels (decode, T == 1)" in decode.reason


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
    tiles and chunks; yields the names of the kernels launched."""
    monkeypatch.setattr(metal, "unsupported_reason", lambda *args, **kwargs: None)
    used = []

    def counting_launcher(launch):
        used.append(launch.name)
        return harness.harness_launcher(launch)

    with metal.use_launcher(counting_launcher), metal.use_geometry(**SMALL):
        yield used


no_fallback = pytest.mark.filterwarnings("error")  # a fallback to another path warns: make it a failure


@no_fallback
@pytest.mark.parametrize("kind", KINDS)
def test_mlx_api_kernel_path_end_to_end(kind, harness_launches, monkeypatch, seed):
    """gdn2.mlx.chunk_gdn2(path='kernel') runs the Metal source (through the harness) under mx.grad."""
    import gdn2.mlx as api

    monkeypatch.setenv("GDN2_METAL_KERNEL", kind)
    case = metal_case(Shape(1, 9, 2, 24, 8), seed)
    a = mlx_arrays(case, "float32")
    choice = api.which_path(a["q"], a["k"], a["v"], a["g"], a["b"], a["w"], path="kernel")
    assert choice.path == "kernel" and f"{kind} kernels" in choice.reason
    d_o = mx.array(case["d_o"].astype(np.float32))

    def loss(q):
        o, _ = api.chunk_gdn2(q, a["k"], a["v"], a["g"], a["b"], a["w"], initial_state=a["initial_state"],
                              chunk_size=4, path="kernel")
        return (o * d_o).sum()

    d_q = mx.grad(loss)(a["q"])
    assert LAUNCHED[kind] in harness_launches
    expected = spec.reference_backward(**case["inputs"], d_o=case["d_o"])
    assert_close("dq (API)", as64(d_q), expected["q"], 2e-5)


@no_fallback
@pytest.mark.parametrize("kind", KINDS)
def test_packed_sequences_on_the_kernel_path(kind, harness_launches, monkeypatch, seed):
    """cu_seqlens through the Metal kernels (run by the harness, as a zero-padded batch): equal to
    each sequence run alone, outputs, final states and every gradient."""
    monkeypatch.setenv("GDN2_METAL_KERNEL", kind)
    case = packed_case(seed, random_lengths(seed, 3), H=1, K=16, V=8)
    result = run_mlx(case, "float32", 8, "kernel")
    assert LAUNCHED[kind] in harness_launches
    for name, value in result.items():
        assert_close(f"{name} (packed)", value, case["expected"][name], 2e-5)


@no_fallback
def test_recurrent_decode_step_runs_the_kernel(harness_launches, seed):
    """gdn2.mlx.recurrent_gdn2 with T == 1 and a state (the layer's decode step) runs the Metal
    scan where it can, and equals the spec."""
    import gdn2.mlx as api

    case = metal_case(Shape(1, 1, 2, 24, 8), seed)
    a = mlx_arrays(case, "float32")
    o, state = api.recurrent_gdn2(*(a[n] for n in spec.INPUT_NAMES), initial_state=a["initial_state"],
                                  output_final_state=True)
    mx.eval(o, state)
    assert "gdn2_scan_forward" in harness_launches
    assert_close("o (recurrent decode)", as64(o), case["expected"]["o"], 2e-5)
    assert_close("final_state (recurrent decode)", as64(state), case["expected"]["final_state"], 2e-5)


# ---- bad values stay causal -------------------------------------------------------------------


def spec_with_bad_values(case: dict) -> dict:
    with np.errstate(all="ignore"):
        o, final_state = spec.reference_forward(**case["inputs"])
    return dict(o=o, final_state=final_state)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,value", [("v", np.nan), ("k", np.nan), ("g", np.nan), ("b", np.inf)])
def test_a_bad_value_reaches_no_earlier_output(kind, name, value, monkeypatch, seed):
    """A NaN or Inf at step t (mid-chunk) reaches outputs at t and after, never before, and the
    outputs from t on are non-finite exactly where the spec's are: the chunked kernels' products
    with lower-triangular tiles sum only k <= i (the matrix units would multiply the zeros above
    the diagonal by the bad row)."""
    monkeypatch.setenv("GDN2_METAL_KERNEL", kind)
    case = make_case(2, 21, 2, 16, 6, seed, log_decay_range=(-5.0, 0.0), reference=False)
    clean = spec_with_bad_values(case)
    t = 7  # inside the first chunk of 16, and not a block boundary
    case["inputs"][name][1, t, 0, 2] = value
    bad = spec_with_bad_values(case)
    a = mlx_arrays(case, "float32")
    with metal.use_launcher(harness.harness_launcher), metal.use_geometry(**SMALL):
        o, final = metal.metal_gdn2(*(a[n] for n in spec.INPUT_NAMES), scale=0.25, initial_state=a["initial_state"],
                                    output_final_state=True)
    o, final = as64(o), as64(final)
    assert_close("o before the bad step", o[:, :t], clean["o"][:, :t], 2e-5)
    assert_close("o of the other batch row", o[0], clean["o"][0], 2e-5)
    for label, got, expected in (("o", o, bad["o"]), ("final_state", final, bad["final_state"])):
        finite = np.isfinite(expected)
        assert (np.isfinite(got) == finite).all(), f"{label}: non-finite elsewhere than the spec"
        assert_close(f"{label} where finite", got[finite], expected[finite], 2e-5)
