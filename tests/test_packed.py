"""Packed variable-length batches (``cu_seqlens``): packed equals each sequence run alone."""

from __future__ import annotations

import numpy as np
import pytest

from gdn2.spec import INPUT_NAMES, random_inputs, relative_error
from gdn2.testing import packed_case, random_lengths, run_mlx, run_torch

RUNNERS = {"torch": run_torch, "mlx": run_mlx}
FRAMEWORKS = list(RUNNERS)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("path", ["reference", "chunk"])
@pytest.mark.parametrize("chunk_size", [8, 16])
def test_packed_equals_separate_runs(framework, path, chunk_size, seed):
    case = packed_case(seed, random_lengths(seed))
    result = RUNNERS[framework](case, "float32", chunk_size, path)
    for name, value in result.items():
        assert relative_error(value, case["expected"][name]) <= 1e-5, name


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_empty_sequence_passes_state_through(framework, seed):
    case = packed_case(seed, [5, 0, 12])
    result = RUNNERS[framework](case, "float32", 8, "chunk")
    for name, value in result.items():
        assert relative_error(value, case["expected"][name]) <= 1e-5, name
    assert np.allclose(result["final_state"][1], case["inputs"]["initial_state"][1])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_split_and_join_sequences_is_exact(framework, seed):
    """The padded-batch adapter that the kernel paths use for packed input, on the chunk path."""
    from gdn2.packing import join_sequences, split_sequences
    from gdn2.spec import parse_cu_seqlens

    case = packed_case(seed, random_lengths(seed, 4))
    if framework == "torch":
        import torch

        from gdn2.torch import chunk_gdn2
        from gdn2.torch.xp import torch_ops as ops

        convert, back = (lambda a: torch.tensor(a, dtype=torch.float32)), (lambda t: t.double().numpy())
    else:
        import mlx.core as mx

        from gdn2.mlx import chunk_gdn2
        from gdn2.mlx.xp import mlx_ops as ops

        convert, back = (lambda a: mx.array(a, dtype=mx.float32)), (lambda t: np.array(t).astype(np.float64))
    sequences = parse_cu_seqlens(case["cu_seqlens"], 1, len(case["inputs"]["q"][0]))
    rows = [split_sequences(ops, convert(case["inputs"][n]), sequences) for n in INPUT_NAMES]
    o, final_state = chunk_gdn2(*rows, initial_state=convert(case["inputs"]["initial_state"]), output_final_state=True, path="chunk")
    o = join_sequences(ops, o, sequences)
    assert relative_error(back(o), case["expected"]["o"]) <= 1e-5
    assert relative_error(back(final_state), case["expected"]["final_state"]) <= 1e-5


BAD_OFFSETS = [
    pytest.param([1, 5, 20], "cu_seqlens: expected to start at 0, received 1", id="start-1"),
    pytest.param([0, 12, 5, 20], "cu_seqlens: expected non-decreasing offsets", id="decreasing"),
    pytest.param([0, 5, 19], "cu_seqlens: expected to end at T=20, received 19", id="end-19"),
    pytest.param([0], "cu_seqlens: expected shape [N + 1] with N >= 1", id="no-sequence"),
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("offsets,message", BAD_OFFSETS)
def test_bad_offsets(framework, offsets, message):
    x = random_inputs(1, 20, 2, 4, 3, 0)
    if framework == "torch":
        import torch

        from gdn2.torch import chunk_gdn2

        args, cu = [torch.tensor(x[n], dtype=torch.float32) for n in INPUT_NAMES], torch.tensor(offsets)
    else:
        import mlx.core as mx

        from gdn2.mlx import chunk_gdn2

        args, cu = [mx.array(x[n], dtype=mx.float32) for n in INPUT_NAMES], mx.array(offsets)
    with pytest.raises(ValueError) as error:
        chunk_gdn2(*args, cu_seqlens=cu)
    assert message in str(error.value)


def test_offsets_dtype_device_batch_and_state_rows():
    import torch

    from gdn2.torch import chunk_gdn2

    x = {n: torch.tensor(a, dtype=torch.float32) for n, a in random_inputs(1, 20, 2, 4, 3, 0).items()}
    args = [x[n] for n in INPUT_NAMES]
    with pytest.raises(ValueError, match="cu_seqlens: expected an integer dtype"):
        chunk_gdn2(*args, cu_seqlens=torch.tensor([0.0, 20.0]))
    with pytest.raises(ValueError, match=r"cu_seqlens: expected a tensor on cpu \(the device of q\), received one on meta"):
        chunk_gdn2(*args, cu_seqlens=torch.tensor([0, 20], device="meta"))
    with pytest.raises(ValueError, match=r"initial_state: expected shape \[N \(sequences in cu_seqlens\), H, K, V\] = \[2, 2, 4, 3\]"):
        chunk_gdn2(*args, initial_state=x["initial_state"], cu_seqlens=torch.tensor([0, 7, 20]))
    two_rows = [torch.cat([a, a]) for a in args]
    with pytest.raises(ValueError, match="with cu_seqlens the batch size must be 1"):
        chunk_gdn2(*two_rows, cu_seqlens=torch.tensor([0, 20]))


def test_offsets_parsed_once_give_the_chunk_table_and_positions():
    """The chunk layout starts every sequence in a new chunk: (first token, length) per chunk."""
    from gdn2.spec import parse_cu_seqlens

    sequences = parse_cu_seqlens(np.array([0, 5, 5, 21]), 1, 21)
    assert sequences.count == 3 and sequences.lengths == (5, 0, 16)
    table = sequences.chunk_table(8)
    assert table.tolist() == [[0, 5], [5, 8], [13, 8]]
    layout = sequences.chunk_layout(8)
    for n, (first, length) in enumerate(table):
        slots = layout.token_of_slot[n * 8 : (n + 1) * 8]
        assert slots[:length].tolist() == list(range(first, first + length)) and (slots[length:] == 21).all()
    assert sequences.positions().tolist() == list(range(5)) + list(range(16))
    assert parse_cu_seqlens(sequences, 1, 21) is sequences


def test_parsed_offsets_under_mx_compile(seed):
    from functools import partial

    from gdn2.mlx import chunk_gdn2
    from gdn2.spec import parse_cu_seqlens
    from gdn2.testing import mlx_gradients

    case = packed_case(seed, random_lengths(seed, 3))
    sequences = parse_cu_seqlens(case["cu_seqlens"], 1, int(case["cu_seqlens"][-1]))
    result = mlx_gradients(case, "float32", partial(chunk_gdn2, chunk_size=8, path="chunk", cu_seqlens=sequences), compile=True)
    for name, value in result.items():
        assert relative_error(value, case["expected"][name]) <= 1e-5, name
