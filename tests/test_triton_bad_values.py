"""Hard resets and bad values on the Triton kernel path, run by the Triton interpreter
(``TRITON_INTERPRET=1``, set in conftest.py): the cases the chunk path is held to
(tests/test_hard_reset.py, tests/test_causality.py). The interpreter is slow, so each run puts
one position (or one input) in each (batch row, head) slot, which the operator keeps apart."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from gdn2.spec import INPUT_NAMES, reference_forward, relative_error  # noqa: E402
from gdn2.testing import make_case, run_torch, with_expected, worst_error  # noqa: E402
from gdn2.torch import chunk_gdn2  # noqa: E402
from gdn2.torch.ops import which_path  # noqa: E402

# A kernel that falls back to the chunk path warns "gdn2.torch: ...": make that a failure.
kernel_only = pytest.mark.filterwarnings("error:gdn2:RuntimeWarning")

T = 70  # chunks of 64: a full chunk and a short one
# (batch row, head, step) slots: the first step, the middle of a chunk, a chunk boundary, the last step.
RESET_SLOTS = [(0, 0, 0), (0, 1, 30), (1, 0, 64), (1, 1, T - 1)]


@pytest.fixture
def interpreter(monkeypatch, fresh_path_log):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("GDN2_PATH", raising=False)


@kernel_only
@pytest.mark.parametrize("value", [-np.inf, -1e6], ids=["-inf", "-1e6"])
def test_kernel_hard_reset(value, interpreter, seed):
    """g = ``value`` on every channel at one step per slot; forward and every gradient, with a
    gradient into the final state, against the spec: within 1e-4 and at most twice the chunk
    path's error (every exponent a span sum, no difference of cumulative sums)."""
    case = make_case(2, T, 2, 16, 16, seed, log_decay_range=(-5.0, 0.0), reference=False)
    for row, head, step in RESET_SLOTS:
        case["inputs"]["g"][row, step, head] = value
    case = with_expected(case)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="invalid value|overflow|divide by zero")  # numpy, in the interpreter
        result = run_torch(case, "float32", 64, "kernel")
        chunk_result = run_torch(case, "float32", 64, "chunk")
    error, name, errors = worst_error(result, case["expected"])
    chunk_error, _, _ = worst_error(chunk_result, case["expected"])
    assert error <= 1e-4, (seed, name, errors)
    assert error <= 2 * chunk_error + 1e-7, (seed, name, error, chunk_error)  # the chunk path's accuracy


def forward(inputs: dict):
    x = {n: torch.tensor(inputs[n], dtype=torch.float32) for n in INPUT_NAMES}
    state = torch.tensor(inputs["initial_state"], dtype=torch.float32)
    assert which_path(*x.values(), state, path="kernel").path == "kernel"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="invalid value|overflow|divide by zero")
        o, final_state = chunk_gdn2(**x, initial_state=state, output_final_state=True, path="kernel")
    return o.double().numpy(), final_state.double().numpy()


@kernel_only
@pytest.mark.parametrize("position", [
    pytest.param(30, id="mid-chunk"),
    pytest.param(64, id="chunk-boundary"),
    pytest.param(T - 1, id="last"),
])
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_kernel_nan_reaches_no_earlier_output(position, bad, interpreter, seed):
    """A NaN or +inf in q, k, v, g, b or w (one input per (row, head) slot) at step ``position``:
    earlier outputs are the clean run's; from then on, non-finite exactly where the spec is."""
    case = make_case(2, T, 3, 16, 16, seed, log_decay_range=(-5.0, 0.0), reference=False)
    clean, _ = reference_forward(**case["inputs"])
    slots = [(row, head) for row in range(2) for head in range(3)]
    for name, (row, head) in zip(INPUT_NAMES, slots):
        case["inputs"][name][row, position, head, 2] = bad
    with np.errstate(all="ignore"):
        bad_o, bad_final = reference_forward(**case["inputs"])
    o, final_state = forward(case["inputs"])
    for name, (row, head) in zip(INPUT_NAMES, slots):
        before = relative_error(o[row, :position, head], clean[row, :position, head])
        assert before <= 1e-5, f"{name}: outputs before the NaN changed (relative error {before:.2e})"
        after, expected = o[row, position:, head], bad_o[row, position:, head]
        assert (np.isfinite(after) == np.isfinite(expected)).all(), f"{name}: non-finite elsewhere than the spec"
        assert (np.isfinite(final_state[row, head]) == np.isfinite(bad_final[row, head])).all(), name
