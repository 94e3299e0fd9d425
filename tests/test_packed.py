"""Packed variable-length batches (``cu_seqlens``): packed equals each sequence run alone."""

from __future__ import annotations

import numpy as np
import pytest
from frameworks import GRAD_NAMES

from gdn2.spec import INPUT_NAMES, random_inputs, reference_backward, reference_forward, relative_error


def packed_case(seed, lengths, H=2, K=8, V=6):
    """Inputs for sequences of ``lengths`` packed in one row, and the spec run on each alone."""
    T, N = sum(lengths), len(lengths)
    x = random_inputs(1, T, H, K, V, seed, log_decay_range=(-20.0, 0.0))
    rng = np.random.default_rng(seed + 1)
    x["initial_state"] = rng.standard_normal((N, H, K, V))
    d_o, d_final = rng.standard_normal((1, T, H, V)), rng.standard_normal((N, H, K, V))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    outputs, finals, grads = [], [], {n: [] for n in GRAD_NAMES}
    for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        alone = {name: x[name][:, start:end] for name in INPUT_NAMES}
        state = x["initial_state"][n : n + 1]
        if start == end:
            outputs.append(np.zeros((1, 0, H, V)))
            finals.append(state)
            for name in INPUT_NAMES:
                grads[name].append(alone[name])
            grads["initial_state"].append(d_final[n : n + 1])
            continue
        o, final_state = reference_forward(**alone, initial_state=state)
        outputs.append(o)
        finals.append(final_state)
        grad = reference_backward(**alone, initial_state=state, d_o=d_o[:, start:end], d_final_state=d_final[n : n + 1])
        for name in GRAD_NAMES:
            grads[name].append(grad[name])
    expected = dict(o=np.concatenate(outputs, 1), final_state=np.concatenate(finals, 0))
    expected.update({f"d{n}": np.concatenate(grads[n], 0 if n == "initial_state" else 1) for n in GRAD_NAMES})
    return dict(inputs=x, d_o=d_o, d_final_state=d_final, cu_seqlens=offsets, expected=expected)


def run_packed_torch(case, path, chunk_size):
    import torch

    from gdn2.torch import chunk_gdn2

    leaves = {n: torch.tensor(case["inputs"][n], dtype=torch.float32, requires_grad=True) for n in GRAD_NAMES}
    o, final_state = chunk_gdn2(
        *(leaves[n] for n in INPUT_NAMES), initial_state=leaves["initial_state"], output_final_state=True,
        chunk_size=chunk_size, path=path, cu_seqlens=torch.tensor(case["cu_seqlens"]),
    )
    loss = (o * torch.tensor(case["d_o"], dtype=torch.float32)).sum()
    (loss + (final_state * torch.tensor(case["d_final_state"], dtype=torch.float32)).sum()).backward()
    result = dict(o=o, final_state=final_state, **{f"d{n}": leaves[n].grad for n in GRAD_NAMES})
    return {n: x.detach().double().numpy() for n, x in result.items()}


def run_packed_mlx(case, path, chunk_size):
    import mlx.core as mx

    from gdn2.mlx import chunk_gdn2

    arrays = [mx.array(case["inputs"][n], dtype=mx.float32) for n in GRAD_NAMES]
    d_o, d_final = mx.array(case["d_o"], dtype=mx.float32), mx.array(case["d_final_state"], dtype=mx.float32)
    cu_seqlens = mx.array(case["cu_seqlens"])

    def loss(*xs):
        o, final_state = chunk_gdn2(
            *xs[:6], initial_state=xs[6], output_final_state=True, chunk_size=chunk_size, path=path, cu_seqlens=cu_seqlens
        )
        return (o * d_o).sum() + (final_state * d_final).sum(), (o, final_state)

    (_, (o, final_state)), grads = mx.value_and_grad(loss, argnums=tuple(range(7)))(*arrays)
    result = dict(o=o, final_state=final_state, **{f"d{n}": g for n, g in zip(GRAD_NAMES, grads)})
    return {n: np.array(x).astype(np.float64) for n, x in result.items()}


RUNNERS = {"torch": run_packed_torch, "mlx": run_packed_mlx}


def random_lengths(seed, count=5):
    """Lengths including 1 and values that are not multiples of any chunk size used."""
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(2, 40, count - 1).tolist()


@pytest.mark.parametrize("framework", ["torch", "mlx"])
@pytest.mark.parametrize("path", ["reference", "chunk"])
@pytest.mark.parametrize("chunk_size", [8, 16])
def test_packed_equals_separate_runs(framework, path, chunk_size, seed):
    case = packed_case(seed, random_lengths(seed))
    result = RUNNERS[framework](case, path, chunk_size)
    for name, value in result.items():
        assert relative_error(value, case["expected"][name]) <= 1e-5, name


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_empty_sequence_passes_state_through(framework, seed):
    case = packed_case(seed, [5, 0, 12])
    result = RUNNERS[framework](case, "chunk", 8)
    for name, value in result.items():
        assert relative_error(value, case["expected"][name]) <= 1e-5, name
    assert np.allclose(result["final_state"][1], case["inputs"]["initial_state"][1])


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_split_and_join_sequences_is_exact(framework, seed):
    """The padded-batch adapter that the kernel paths use for packed input, on the chunk path."""
    from gdn2 import chunk as algorithm

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
    rows = [algorithm.split_sequences(ops, convert(case["inputs"][n]), case["cu_seqlens"]) for n in INPUT_NAMES]
    o, final_state = chunk_gdn2(*rows, initial_state=convert(case["inputs"]["initial_state"]), output_final_state=True, path="chunk")
    o = algorithm.join_sequences(ops, o, case["cu_seqlens"])
    assert relative_error(back(o), case["expected"]["o"]) <= 1e-5
    assert relative_error(back(final_state), case["expected"]["final_state"]) <= 1e-5


BAD_OFFSETS = [
    ([1, 5, 20], "cu_seqlens: expected to start at 0, received 1"),
    ([0, 12, 5, 20], "cu_seqlens: expected non-decreasing offsets"),
    ([0, 5, 19], "cu_seqlens: expected to end at T=20, received 19"),
    ([0], "cu_seqlens: expected shape [N + 1] with N >= 1"),
]


@pytest.mark.parametrize("framework", ["torch", "mlx"])
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
