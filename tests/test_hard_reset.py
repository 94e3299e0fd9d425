"""Hard resets on the chunk path: ``g = -inf`` (exp gives 0, the state forgets) or ``g = -1e6`` at
one step is legal, and the float64 spec stays finite. Forward and every gradient (with a gradient
into the final state) against the spec, both frameworks, with the reset at the first step, in the
middle of a chunk, at a chunk boundary, between blocks of a chunk, and at the last step."""

from __future__ import annotations

import numpy as np
import pytest

from gdn2 import algorithm
from gdn2.spec import INPUT_NAMES
from gdn2.testing import GRAD_NAMES, make_case, run_mlx, run_torch, with_expected, worst_error
from gdn2.xp import numpy_ops

RUNNERS = {"torch": run_torch, "mlx": run_mlx}

# T = 45 in chunks of 32: the first chunk has four blocks of 8 (the pairwise decays between blocks
# span whole blocks), the second is short and zero-padded.
T, CHUNK = 45, 32
POSITIONS = {"first": 0, "mid-chunk": 13, "block-boundary": 16, "chunk-boundary": 32, "last": T - 1}
RESETS = {"-inf": -np.inf, "-1e6": -1e6}


def reset_case(seed, position: int, value: float, whole_step: bool = True) -> dict:
    """A case with g = ``value`` at ``position``: every channel of every head (``whole_step``), or
    one channel of one head; the spec's results on those inputs."""
    case = make_case(2, T, 2, 16, 8, seed, log_decay_range=(-5.0, 0.0), reference=False)
    g = case["inputs"]["g"]
    if whole_step:
        g[:, position] = value
    else:
        g[1, position, 0, 3] = value
    expected = with_expected(case)
    for name, x in expected["expected"].items():
        assert np.all(np.isfinite(x)), f"the spec is not finite in {name}"
    return expected


@pytest.mark.parametrize("value", RESETS, ids=str)
@pytest.mark.parametrize("position", POSITIONS, ids=str)
def test_numpy_chunk_algorithm_with_hard_reset(position, value, seed):
    """The shared algorithm in float64 equals the spec to rounding with a reset anywhere."""
    case = reset_case(seed, POSITIONS[position], RESETS[value])
    x = case["inputs"]
    args = [x[n] for n in INPUT_NAMES]
    scale = 16**-0.5
    o, final_state, states = algorithm.forward(numpy_ops, *args, scale, x["initial_state"], CHUNK)
    grads = algorithm.backward(numpy_ops, *args, scale, states, case["d_o"], case["d_final_state"], CHUNK)
    result = dict(o=o, final_state=final_state, **{f"d{n}": gr for n, gr in zip(GRAD_NAMES, grads)})
    error, name, _ = worst_error(result, case["expected"])
    assert error <= 1e-12, (name, error)


@pytest.mark.parametrize("framework", RUNNERS)
@pytest.mark.parametrize("value", RESETS, ids=str)
@pytest.mark.parametrize("position", POSITIONS, ids=str)
def test_chunk_path_with_hard_reset(framework, position, value, seed):
    case = reset_case(seed, POSITIONS[position], RESETS[value])
    result = RUNNERS[framework](case, "float32", CHUNK, "chunk")
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 1e-5, (name, errors)


@pytest.mark.parametrize("framework", RUNNERS)
@pytest.mark.parametrize("position", ["mid-chunk", "chunk-boundary"])
def test_chunk_path_with_one_channel_reset(framework, position, seed):
    """A reset of one key channel of one head: the other channels and heads keep their state."""
    case = reset_case(seed, POSITIONS[position], -np.inf, whole_step=False)
    result = RUNNERS[framework](case, "float32", CHUNK, "chunk")
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 1e-5, (name, errors)


@pytest.mark.parametrize("framework", RUNNERS)
def test_chunk_path_with_hard_reset_float64(framework, seed):
    case = reset_case(seed, POSITIONS["block-boundary"], -np.inf)
    result = RUNNERS[framework](case, "float64", CHUNK, "chunk")
    error, name, errors = worst_error(result, case["expected"])
    assert error <= 1e-10, (name, errors)
