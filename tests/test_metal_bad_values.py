"""Hard resets and bad values on the Metal kernels (scan and chunked, each forced), run on the CPU
by the harness: the same cases the chunk path is held to (tests/test_hard_reset.py and
tests/test_causality.py), at fixed positions against the float64 spec."""

from __future__ import annotations

import warnings
from functools import partial

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from gdn2 import spec  # noqa: E402
from gdn2.mlx import metal  # noqa: E402
from gdn2.mlx.metal import chunked, scan  # noqa: E402
from gdn2.testing import GRAD_NAMES, make_case, mlx_gradients, rounded_case, worst_error  # noqa: E402
from tests.metal_harness import harness  # noqa: E402

# 64-thread scan groups with 4-column tiles, chunks of 16: T = 37 spans three chunks.
SMALL = dict(forward=scan.ScanGeometry(2, 2), backward=scan.ScanGeometry(2, 2), chunk=chunked.ChunkGeometry(chunk=16))
KINDS = ("scan", "chunked")
T = 37
POSITIONS = {"first": 0, "mid-chunk": 7, "chunk-boundary": 16, "last": T - 1}
RESETS = {"-inf": -np.inf, "-1e6": -1e6}
ROW, HEAD, CHANNEL = 1, 0, 2


def float32_case(case: dict) -> dict:
    """The case with its inputs rounded to float32 (the spec sees the rounded values)."""
    return rounded_case(case, lambda x: x.astype(np.float32).astype(np.float64))


def run_kernels(case: dict, kind: str, monkeypatch) -> dict:
    """Forward and every gradient of ``metal_gdn2`` with ``kind`` forced, every launch through the harness."""
    monkeypatch.setenv("GDN2_METAL_KERNEL", kind)
    kernel = partial(metal.metal_gdn2, scale=case["inputs"]["q"].shape[-1] ** -0.5, checkpoint_interval=8)
    with metal.use_launcher(harness.harness_launcher), metal.use_geometry(**SMALL):
        return mlx_gradients(case, "float32", kernel)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", RESETS, ids=str)
@pytest.mark.parametrize("position", POSITIONS, ids=str)
def test_hard_reset(kind, position, value, monkeypatch, seed):
    """g = -inf (or -1e6) at every channel of one step: forward and every gradient, with a gradient
    into the final state, against the spec."""
    case = make_case(2, T, 2, 16, 8, seed, log_decay_range=(-5.0, 0.0), reference=False)
    case["inputs"]["g"][:, POSITIONS[position]] = RESETS[value]
    case = float32_case(case)
    result = run_kernels(case, kind, monkeypatch)
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 2e-5, (name, errors)


def spec_results(case: dict) -> dict:
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, final_state = spec.reference_forward(**case["inputs"])
        grads = spec.reference_backward(**case["inputs"], d_o=case["d_o"], d_final_state=case["d_final_state"])
    return dict(o=o, final_state=final_state, **{f"d{n}": grads[n] for n in GRAD_NAMES})


def bad_value_run(kind, name, position, value, monkeypatch, seed):
    case = float32_case(make_case(2, T, 2, 8, 6, seed, log_decay_range=(-5.0, 0.0), reference=False))
    clean = case["expected"]
    case["inputs"][name][ROW, position, HEAD, CHANNEL] = value
    return run_kernels(case, kind, monkeypatch), clean, spec_results(case)


# Every input in the middle of a chunk; k and v also at the other positions.
BAD_SPOTS = [(name, "mid-chunk") for name in spec.INPUT_NAMES] + [
    ("k", "first"), ("k", "chunk-boundary"), ("k", "last"), ("v", "chunk-boundary"), ("v", "last")]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,position", BAD_SPOTS, ids=lambda x: str(x))
def test_nan_reaches_no_earlier_output(kind, name, position, monkeypatch, seed):
    """Outputs before the bad step and of the other batch row are the clean run's; from that step
    on, non-finite exactly where the spec is, equal elsewhere."""
    t = POSITIONS[position]
    result, clean, bad = bad_value_run(kind, name, t, np.nan, monkeypatch, seed)
    o = result["o"]
    if t > 0:
        assert spec.relative_error(o[:, :t], clean["o"][:, :t]) <= 2e-5, "outputs before the bad step changed"
    assert spec.relative_error(o[0], clean["o"][0]) <= 2e-5, "the other batch row changed"
    for label in ("o", "final_state"):
        finite = np.isfinite(bad[label])
        assert (np.isfinite(result[label]) == finite).all(), f"{label}: non-finite elsewhere than the spec"
        assert spec.relative_error(result[label][finite], bad[label][finite]) <= 2e-5, label


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["k", "v", "g"])
def test_nan_gives_no_finite_gradient_where_the_spec_has_none(kind, name, monkeypatch, seed):
    """The loss is NaN: no gradient is finite where the spec's is not, and the other batch row's
    gradients are the clean run's."""
    result, clean, bad = bad_value_run(kind, name, POSITIONS["mid-chunk"], np.nan, monkeypatch, seed)
    for grad in GRAD_NAMES:
        got = result[f"d{grad}"]
        leaked = np.argwhere(np.isfinite(got) & ~np.isfinite(bad[f"d{grad}"]))
        assert leaked.size == 0, f"d{grad}: finite where the spec is not, at {leaked[:4].tolist()}"
        assert spec.relative_error(got[0], clean[f"d{grad}"][0]) <= 2e-5, f"d{grad} of the other batch row"
