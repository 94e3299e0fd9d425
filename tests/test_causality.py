"""Causality for bad values on the chunk path: a NaN or Inf in an input at step t reaches outputs at
t and after, never before, nor other batch rows, heads or packed sequences; the reference path
(and the float64 spec) is the ground truth. In the layer, NaN hidden states at padding positions
do not reach the real tokens of a right-padded batch."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from gdn2.spec import INPUT_NAMES, reference_backward, reference_forward, relative_error
from gdn2.testing import GRAD_NAMES, make_case, packed_case, run_mlx, run_torch

RUNNERS = {"torch": run_torch, "mlx": run_mlx}

# T = 37 in chunks of 16: the first step, the middle of a chunk, a chunk boundary, the last step.
T, CHUNK = 37, 16
POSITIONS = {"first": 0, "mid-chunk": 7, "chunk-boundary": 16, "last": T - 1}
BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
ROW, HEAD, CHANNEL = 1, 0, 2  # where the bad value goes: batch row 1, head 0, one channel


def spec_results(case: dict) -> dict:
    """The float64 spec on the case's inputs, NaN and Inf included (as the reference computes them)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, final_state = reference_forward(**case["inputs"])
        grads = reference_backward(**case["inputs"], d_o=case["d_o"], d_final_state=case["d_final_state"])
    return dict(o=o, final_state=final_state, **{f"d{name}": grads[name] for name in GRAD_NAMES})


def bad_case(seed, name: str, position: int, value: float) -> tuple[dict, dict, dict]:
    """(the case with ``value`` in ``name`` at one element of step ``position``, the spec on the
    clean inputs, the spec on the bad inputs)."""
    case = make_case(2, T, 2, 8, 6, seed, log_decay_range=(-5.0, 0.0), reference=False)
    clean = spec_results(case)
    case["inputs"][name][ROW, position, HEAD, CHANNEL] = value
    return case, clean, spec_results(case)


def assert_same_where_finite(label: str, got, expected, tolerance: float = 1e-5):
    """Non-finite exactly where ``expected`` is, and equal to it elsewhere."""
    finite = np.isfinite(expected)
    mismatch = np.argwhere(np.isfinite(got) != finite)
    assert mismatch.size == 0, f"{label}: finite where the reference is not, or the reverse, at {mismatch[:4].tolist()}"
    error = relative_error(got[finite], expected[finite])
    assert error <= tolerance, f"{label}: relative error {error:.2e} where finite"


def check_causal(result: dict, clean: dict, bad: dict, position: int):
    o = result["o"]
    # Before t: exactly the clean run, in every row and head.
    if position > 0:
        assert relative_error(o[:, :position], clean["o"][:, :position]) <= 1e-5, "outputs before the bad step changed"
    # Other batch rows and heads: the clean run, outputs and every gradient.
    others = [(0, slice(None)), (ROW, 1 - HEAD)]
    for row, head in others:
        assert relative_error(o[row, :, head], clean["o"][row, :, head]) <= 1e-5, (row, head)
        assert relative_error(result["final_state"][row, head], clean["final_state"][row, head]) <= 1e-5, (row, head)
        for name in GRAD_NAMES:
            grad, expected = result[f"d{name}"], clean[f"d{name}"]
            index = (row, head) if name == "initial_state" else (row, slice(None), head)
            assert relative_error(grad[index], expected[index]) <= 1e-5, (name, row, head)
    # From t on: NaN or Inf exactly where the reference has them, equal elsewhere.
    assert_same_where_finite("o", o, bad["o"])
    assert_same_where_finite("final_state", result["final_state"], bad["final_state"])
    # Gradients: the loss is not finite; every gradient the reference leaves non-finite is non-finite.
    for name in GRAD_NAMES:
        grad, expected = result[f"d{name}"], bad[f"d{name}"]
        leaked = np.argwhere(np.isfinite(grad) & ~np.isfinite(expected))
        assert leaked.size == 0, f"d{name}: finite where the reference is not, at {leaked[:4].tolist()}"


@pytest.mark.parametrize("framework", RUNNERS)
@pytest.mark.parametrize("position", POSITIONS, ids=str)
@pytest.mark.parametrize("name", INPUT_NAMES)
def test_nan_reaches_no_earlier_output(framework, name, position, seed):
    case, clean, bad = bad_case(seed, name, POSITIONS[position], np.nan)
    check_causal(RUNNERS[framework](case, "float32", CHUNK, "chunk"), clean, bad, POSITIONS[position])


# g = -inf is a hard reset, not a bad value (tests/test_hard_reset.py)
INF_CASES = [(name, value) for name in INPUT_NAMES for value in ("inf", "-inf") if (name, value) != ("g", "-inf")]


@pytest.mark.parametrize("framework", RUNNERS)
@pytest.mark.parametrize("name, value", INF_CASES)
def test_inf_reaches_no_earlier_output(framework, name, value, seed):
    position = POSITIONS["mid-chunk"]
    case, clean, bad = bad_case(seed, name, position, BAD[value])
    check_causal(RUNNERS[framework](case, "float32", CHUNK, "chunk"), clean, bad, position)


@pytest.mark.parametrize("framework", RUNNERS)
def test_reference_path_is_the_same_ground_truth(framework, seed):
    """The reference path itself gives what the tests above hold the chunk path to."""
    case, clean, bad = bad_case(seed, "k", POSITIONS["mid-chunk"], np.nan)
    check_causal(RUNNERS[framework](case, "float32", CHUNK, "reference"), clean, bad, POSITIONS["mid-chunk"])


@pytest.mark.parametrize("framework", RUNNERS)
@pytest.mark.parametrize("name", ["k", "v"])
def test_nan_stays_in_its_packed_sequence(framework, name, seed):
    """A NaN in the third of five packed sequences: the other four are untouched (outputs, final
    states and every gradient), the third equals the reference before that step and is non-finite
    exactly where the reference is from then on."""
    lengths = [5, 20, 19, 1, 11]
    case = packed_case(seed, lengths, H=2, K=8, V=6)
    clean = case["expected"]
    start = sum(lengths[:2])
    position = start + 9  # the middle of the third sequence's first chunk of 16
    case["inputs"][name][0, position, 1, 3] = np.nan
    with np.errstate(all="ignore"):
        bad_o, bad_final = reference_forward(**case["inputs"], cu_seqlens=case["cu_seqlens"])
    result = RUNNERS[framework](case, "float32", CHUNK, "chunk")
    outside = np.ones(sum(lengths), dtype=bool)
    outside[start : start + lengths[2]] = False
    assert relative_error(result["o"][:, outside], clean["o"][:, outside]) <= 1e-5
    assert relative_error(result["o"][:, start:position], clean["o"][:, start:position]) <= 1e-5
    assert_same_where_finite("o", result["o"], bad_o)
    assert_same_where_finite("final_state", result["final_state"], bad_final)
    rows = [0, 1, 3, 4]
    assert relative_error(result["final_state"][rows], clean["final_state"][rows]) <= 1e-5
    for grad in GRAD_NAMES:
        got, expected = result[f"d{grad}"], clean[f"d{grad}"]
        if grad == "initial_state":
            assert relative_error(got[rows], expected[rows]) <= 1e-5, grad
        else:
            assert relative_error(got[:, outside], expected[:, outside]) <= 1e-5, grad


# ---- the layer: padding positions holding NaN ---------------------------------------------------


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_layer_right_padding_with_nan_hidden_states(framework, seed):
    """Right padding whose hidden states are NaN: the real tokens' outputs (and, in torch, the
    weight gradients) equal those of the same batch with zeros at the padding."""
    pytest.importorskip("torch")
    pytest.importorskip("mlx.core")
    from test_layer import MIXERS, mixer_pair

    torch_layer, mlx_layer, _ = mixer_pair(MIXERS["plain"], seed)
    rng = np.random.default_rng(seed)
    B, T_layer, hidden = 2, 13, MIXERS["plain"]["hidden_size"]
    x = rng.standard_normal((B, T_layer, hidden)).astype(np.float32)
    mask = np.ones((B, T_layer), dtype=np.int64)
    mask[1, 6:] = 0
    poisoned = x.copy()
    poisoned[1, 6:] = np.nan
    clean = x.copy()
    clean[1, 6:] = 0.0
    if framework == "torch":
        import torch

        def run(hidden_states):
            torch_layer.zero_grad()
            out = torch_layer(torch.tensor(hidden_states), attention_mask=torch.tensor(mask))
            (out * torch.tensor(mask)[..., None]).sum().backward()
            grads = {name: p.grad.double().numpy().copy() for name, p in torch_layer.named_parameters()}
            return out.detach().double().numpy(), grads

        (out, grads), (expected, expected_grads) = run(poisoned), run(clean)
        for name, grad in grads.items():
            assert np.isfinite(grad).all() and relative_error(grad, expected_grads[name]) <= 1e-5, name
    else:
        import mlx.core as mx

        def run(hidden_states):
            return np.array(mlx_layer(mx.array(hidden_states), attention_mask=mx.array(mask))).astype(np.float64)

        out, expected = run(poisoned), run(clean)
    assert np.isfinite(out).all(), "NaN at padding reached real tokens"
    assert relative_error(out, expected) <= 1e-6
