"""The scan Metal kernels (``gdn2/mlx/metal/scan.py``; the backward sums the key-side gradients
over value columns inside the kernel and holds a segment of replayed states in registers),
executed on the CPU through the harness and compared with the float64 spec; their transient
memory, threadgroup limits and register budget."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from gdn2 import spec  # noqa: E402
from gdn2.mlx import metal  # noqa: E402
from gdn2.mlx.metal import dispatch, scan  # noqa: E402
from gdn2.mlx.metal import scan_source as source  # noqa: E402
from tests.metal_harness import harness  # noqa: E402
from tests.metal_harness.cases import BARRIER, NAMES, TOLERANCE, check_all, make_case  # noqa: E402

# several value tiles; backward segments of 2 steps: several per chunk, some stored, some partial
SMALL = dict(forward=scan.ScanGeometry(2, 2), backward=scan.ScanGeometry(2, 2, 2))


def run_scan(case, interval, geometry, launcher=harness.harness_launcher):
    a = case["arrays"]
    d_o = mx.array(case["d_o"].astype(np.float32))
    d_final = mx.array(case["d_final"].astype(np.float32))

    def loss(*inputs):
        o, final = dispatch.family_gdn2("scan", *inputs[:6], case["K"] ** -0.5, inputs[6], interval)
        return (o.astype(mx.float32) * d_o).sum() + (final * d_final).sum(), (o, final)

    saved = dict(scan._geometry_override)
    scan._geometry_override.clear()
    scan._geometry_override.update(geometry or {})
    try:
        with metal.use_launcher(launcher):
            (_, (o, final)), grads = mx.value_and_grad(loss, argnums=tuple(range(7)))(*(a[n] for n in NAMES))
            mx.eval(o, final, grads)
    finally:
        scan._geometry_override.clear()
        scan._geometry_override.update(saved)
    return (o, final), dict(zip(NAMES, grads))


# (B, T, H, K, V, checkpoint interval, geometry): T a multiple of no interval, K != V, K not a
# multiple of 32, several value tiles inside the backward's one threadgroup; the default geometry,
# with chunks of several segments (8 steps; 4 above K = 128) of which one is stored and one partial;
# the largest K and V; decode.
SHAPES = [
    (1, 7, 2, 40, 10, 3, SMALL),
    (2, 13, 1, 32, 24, 5, SMALL),
    (1, 11, 1, 48, 20, 4, None),
    (1, 21, 1, 32, 8, 20, None),
    (1, 10, 1, 160, 12, 10, None),
    (1, 3, 1, 256, 256, 2, None),
    (1, 1, 2, 16, 8, 64, SMALL),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}C{}{}".format(*s[:6], "" if s[6] else "-default"))
def test_scan_matches_spec_forward_and_every_gradient(shape, seed):
    B, T, H, K, V, interval, geometry = shape
    case = make_case(B, T, H, K, V, seed)
    check_all(case, run_scan(case, interval, geometry), TOLERANCE["float32"], seed)


def test_scan_half_inputs_and_strong_decay(seed):
    case = make_case(1, 9, 2, 40, 12, seed, dtype="bfloat16")
    check_all(case, run_scan(case, 4, SMALL), TOLERANCE["bfloat16"], seed, state_tolerance=1e-5)
    case = make_case(1, 45, 1, 32, 8, seed, log_decay_range=(-20.0, 0.0), resets=True)
    check_all(case, run_scan(case, 16, SMALL), 2e-5, seed)


@pytest.mark.parametrize("interval,geometry", [(4, None), (64, None), (9, scan.ScanGeometry(2, 2, 2))])
def test_backward_memory_under_3_gib_and_counted_from_the_launches(interval, geometry, seed):
    """backward_bytes equals the buffers the vjp allocates besides the inputs and the gradients
    (the checkpointing forward's outputs, the backward's scratch outputs: segment start states,
    saved dS, key sums); at B=8 T=4096 H=16 K=V=256 with checkpoints every 64 steps it is under
    3 GiB (no [tiles, B, T, H, K] partials, no state per step); the segment start states are
    max(1, ceil(C / R) - 2) states per tile and chunk, not C."""
    B, T, H, K, V = 2, 13, 3, 40, 20
    case = make_case(B, T, H, K, V, seed, dtype="bfloat16")
    a = case["arrays"]
    inputs = [a[n] for n in spec.INPUT_NAMES]
    forward = scan.forward_launch(*inputs, a["initial_state"], 1.0, interval, save=True)
    backward = scan.backward_launch(*inputs, inputs[2], a["initial_state"], None, 1.0, interval, geometry)
    itemsize = {mx.float32: 4, mx.bfloat16: 2, mx.float16: 2}
    allocated = sum(int(np.prod(s)) * itemsize[d] for s, d in zip(forward.output_shapes, forward.output_dtypes))
    allocated += sum(int(np.prod(s)) * 4 for s in backward.output_shapes[7:])  # the scratch outputs
    assert scan.backward_bytes(B, T, H, K, V, interval, itemsize=2, geometry=geometry) == allocated
    geometry = geometry or scan.backward_geometry(K, V)
    starts = -(-interval // geometry.segment) - 2
    assert backward.output_shapes[7] == (B * H * max(1, starts) * geometry.tile * 32 * -(-K // 32),)
    assert scan.backward_bytes(8, 4096, 16, 256, 256, 64, itemsize=2) < 3 * 2**30


def test_backward_holds_at_most_64_floats_of_states_per_lane():
    """The default backward geometry: a state slice of at most 8 floats per lane (ceil(K / 32) key
    channels x columns), R = 8 held states up to K = 128 and 4 above: at most 64 floats."""
    for K, V in itertools.product(range(1, 257), (1, 7, 64, 130, 256)):
        geometry = scan.backward_geometry(K, V)
        slice_floats = -(-K // 32) * geometry.columns
        assert geometry.columns >= 1 and slice_floats <= 8
        assert geometry.segment == (8 if K <= 128 else 4)
        assert geometry.segment * slice_floats <= 64


@pytest.mark.parametrize("K", [16, 64, 256])
def test_scan_threadgroup_limits(K, seed):
    """Threadgroup memory as the harness measures it equals the declared count, under 32 KiB;
    at most 1024 threads."""
    case = make_case(1, 2, 1, K, 8, seed)
    a = case["arrays"]
    inputs = [a[n] for n in spec.INPUT_NAMES]
    forward = scan.forward_launch(*inputs, a["initial_state"], 1.0, 2, save=True)
    _, _, checkpoints = harness.harness_launcher(forward)
    assert harness.last_threadgroup_bytes == scan.forward_threadgroup_bytes(K) <= 32 * 1024
    geometry = scan.backward_geometry(K, 8)
    backward = scan.backward_launch(*inputs, inputs[2], a["initial_state"], checkpoints, 1.0, 2)
    harness.harness_launcher(backward)
    assert harness.last_threadgroup_bytes == scan.backward_threadgroup_bytes(K, geometry) <= 32 * 1024
    for launch in (forward, backward):
        assert launch.threadgroup[0] <= 1024


def test_backward_is_bitwise_independent_of_the_segment_length(seed):
    """Every replayed state is computed by the same arithmetic whatever the segment length, so the
    gradients are equal bit for bit with 1 step per segment (every state through device memory),
    3 (stored start states, a partial last segment) and a whole chunk (no stored start state);
    with hard resets, a NaN in g and an Inf in v (non-finite gradients compared as bits too)."""
    B, T, H, K, V, interval = 1, 29, 2, 40, 6, 16
    case = make_case(B, T, H, K, V, seed, resets=True)
    a = dict(case["arrays"])
    g, v = np.array(a["g"]), np.array(a["v"])
    g[0, 9, 1, 3] = np.nan
    v[0, 21, 0, 1] = np.inf
    a["g"], a["v"] = mx.array(g), mx.array(v)
    inputs = [a[n] for n in spec.INPUT_NAMES]
    d_o = mx.array(case["d_o"].astype(np.float32))
    d_final = mx.array(case["d_final"].astype(np.float32))
    checkpoints = harness.harness_launcher(
        scan.forward_launch(*inputs, a["initial_state"], 0.3, interval, True, scan.ScanGeometry(2, 2)))[2]
    launches = [scan.backward_launch(*inputs, d_o, d_final, checkpoints, 0.3, interval, scan.ScanGeometry(2, 2, R))
                for R in (1, 3, interval)]
    harness.prepare(launches)
    first, *others = [harness.run_launch(launch, seed=seed)[:7] for launch in launches]
    assert any(not np.isfinite(x.view(np.float32)).all() for x in first[:6] if x.dtype == np.uint32)
    for outputs in others:
        for name, x, y in zip(source.BACKWARD_OUTPUTS, first, outputs):
            assert np.array_equal(x, y), f"{name} differs between segment lengths (seed={seed})"


def test_every_scan_barrier_is_needed(seed):
    case = make_case(1, 40, 1, 64, 6, seed)
    a = case["arrays"]
    inputs = [a[n] for n in spec.INPUT_NAMES]
    d_o = mx.array(case["d_o"].astype(np.float32))
    d_final = mx.array(case["d_final"].astype(np.float32))
    geometry = scan.ScanGeometry(2, 2, 3)  # chunks of 16: 6 segments, 4 start states stored

    def forward(text=source.FORWARD_SOURCE, name="gdn2_scan_forward"):
        return scan.forward_launch(*inputs, a["initial_state"], 0.125, 16, True, geometry, text, name)

    checkpoints = harness.harness_launcher(forward())[2]

    def backward(text=source.BACKWARD_SOURCE, name="gdn2_scan_backward"):
        return scan.backward_launch(*inputs, d_o, d_final, checkpoints, 0.125, 16, geometry, text, name)

    variants = []
    for kernel, make, text in (("forward", forward, source.FORWARD_SOURCE),
                               ("backward", backward, source.BACKWARD_SOURCE)):
        parts = text.split(BARRIER)
        for index in range(len(parts) - 1):
            broken = BARRIER.join(parts[: index + 1]) + "/* barrier removed */" + BARRIER.join(parts[index + 1:])
            variants.append((kernel, index, make(broken, f"gdn2_scan_{kernel}_nobarrier{index}")))
    harness.prepare([v for _, _, v in variants])
    intact = dict(forward=harness.run_launch(forward(), seed=seed), backward=harness.run_launch(backward(), seed=seed))
    for kernel, index, variant in variants:
        try:
            outputs = harness.run_launch(variant, seed=seed)
        except harness.ScheduleDependentResult:
            continue
        changed = any(not np.array_equal(x, y) for x, y in zip(outputs, intact[kernel]))
        assert changed, f"scan {kernel}: removing barrier {index} goes unnoticed (seed={seed})"
