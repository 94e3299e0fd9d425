"""A chunk size larger than the input is capped at the longest sequence: memory follows the input,
not the chunk_size argument (16 tokens with chunk_size=4096 once asked for tens of GB)."""

from __future__ import annotations

import numpy as np
import pytest

from gdn2 import algorithm
from gdn2.spec import INPUT_NAMES, parse_cu_seqlens
from gdn2.testing import GRAD_NAMES, make_case, packed_case, run_mlx, run_torch, worst_error
from gdn2.xp import NumpyOps

RUNNERS = {"torch": run_torch, "mlx": run_mlx}


def test_effective_chunk_size():
    assert algorithm.effective_chunk_size(4096, 16) == 16
    assert algorithm.effective_chunk_size(64, 200) == 64
    assert algorithm.effective_chunk_size(64, 1) == 1
    offsets = parse_cu_seqlens(np.array([0, 3, 40, 45]), 1, 45)
    assert algorithm.effective_chunk_size(4096, 45, offsets) == 37  # the longest sequence


class RecordingOps(NumpyOps):
    """The numpy shim, recording the largest array any of its methods takes or returns."""

    def __init__(self):
        self.largest = 0

    def __getattribute__(self, name):
        attribute = super().__getattribute__(name)
        if name.startswith("_") or name == "largest" or not callable(attribute):
            return attribute

        def recorded(*args, **kwargs):
            result = attribute(*args, **kwargs)
            arrays = [x for x in (*args, result) if isinstance(x, np.ndarray)]
            arrays += [x for group in args if isinstance(group, (list, tuple)) for x in group if isinstance(x, np.ndarray)]
            sizes = [x.size for x in arrays]
            object.__setattr__(self, "largest", max([self.largest, *sizes]))
            return result

        return recorded


def largest_array(case, chunk_size: int, cu_seqlens=None) -> tuple[int, dict]:
    """Forward and backward of the shared algorithm in float64: (the largest array, the results)."""
    ops = RecordingOps()
    x = case["inputs"]
    args = [x[n] for n in INPUT_NAMES]
    scale = x["q"].shape[-1] ** -0.5
    sequences = None if cu_seqlens is None else parse_cu_seqlens(cu_seqlens, 1, x["q"].shape[1])
    o, final_state, states = algorithm.forward(ops, *args, scale, x["initial_state"], chunk_size, sequences)
    grads = algorithm.backward(ops, *args, scale, states, case["d_o"], case["d_final_state"], chunk_size, sequences)
    return ops.largest, dict(o=o, final_state=final_state, **{f"d{n}": g for n, g in zip(GRAD_NAMES, grads)})


def test_memory_follows_the_input_not_the_chunk_size(seed):
    """chunk_size=1024 on 16 tokens allocates nothing larger than chunk_size=16 does (and gives
    the spec's results)."""
    case = make_case(1, 16, 2, 4, 3, seed, log_decay_range=(-5.0, 0.0))
    capped, result = largest_array(case, 1024)
    exact, _ = largest_array(case, 16)
    assert capped == exact, f"largest array {capped} elements with chunk_size=1024, {exact} with 16"
    error, name, _ = worst_error(result, case["expected"])
    assert error <= 1e-12, (name, error)


def test_memory_follows_the_longest_packed_sequence(seed):
    case = packed_case(seed, [3, 11, 7], H=1, K=4, V=3)
    capped, result = largest_array(case, 1024, case["cu_seqlens"])
    exact, _ = largest_array(case, 11, case["cu_seqlens"])
    assert capped == exact, f"largest array {capped} elements with chunk_size=1024, {exact} with 11"
    error, name, _ = worst_error(result, case["expected"])
    assert error <= 1e-12, (name, error)


@pytest.mark.parametrize("framework", RUNNERS)
def test_chunk_size_4096_on_16_tokens(framework, seed):
    """Runs at once and equals chunk_size=16 (the same computation) and the spec."""
    case = make_case(2, 16, 2, 8, 6, seed)
    huge = RUNNERS[framework](case, "float32", 4096, "chunk")
    exact = RUNNERS[framework](case, "float32", 16, "chunk")
    for name, value in huge.items():
        np.testing.assert_array_equal(value, exact[name], err_msg=name)
    error, name, _ = worst_error(huge, case["expected"])
    assert error <= 1e-5, (name, error)
