"""Run one GDN-2 call in a framework on numpy inputs and return everything as float64 numpy.

``case`` dicts come from ``make_case``: inputs, the upstream gradients ``d_o`` and
``d_final_state``, and the float64 spec's outputs and gradients for them.
"""

from __future__ import annotations

import numpy as np

from gdn2.spec import INPUT_NAMES, random_inputs, reference_backward, reference_forward

GRAD_NAMES = INPUT_NAMES + ("initial_state",)


def make_case(B, T, H, K, V, seed, *, log_decay_range=(-3.0, 0.0), erase_max=1.0, with_state=True, reference=True):
    inputs = random_inputs(B, T, H, K, V, seed, log_decay_range=log_decay_range, erase_max=erase_max)
    if not with_state:
        inputs["initial_state"] = None
    rng = np.random.default_rng(seed + 1)
    case = dict(
        inputs=inputs,
        d_o=rng.standard_normal((B, T, H, V)),
        d_final_state=rng.standard_normal((B, H, K, V)),
    )
    if reference:
        o, final_state = reference_forward(**inputs)
        grads = reference_backward(**inputs, d_o=case["d_o"], d_final_state=case["d_final_state"])
        case["expected"] = dict(o=o, final_state=final_state, **{f"d{n}": grads[n] for n in GRAD_NAMES})
    return case


def run_torch(case, dtype="float32", chunk_size=64, path=None, function=None, device="cpu"):
    import torch

    from gdn2.torch import chunk_gdn2

    function = function or chunk_gdn2
    torch_dtype = getattr(torch, dtype)
    state_dtype = torch.float64 if dtype == "float64" else torch.float32
    tensors = {
        n: torch.tensor(case["inputs"][n], dtype=torch_dtype, device=device, requires_grad=True) for n in INPUT_NAMES
    }
    initial = case["inputs"]["initial_state"]
    if initial is not None:
        initial = torch.tensor(initial, dtype=state_dtype, device=device, requires_grad=True)
    kwargs = dict(initial_state=initial, output_final_state=True, chunk_size=chunk_size)
    if path is not None:
        kwargs["path"] = path
    o, final_state = function(*(tensors[n] for n in INPUT_NAMES), **kwargs)
    loss = (o.to(state_dtype) * torch.tensor(case["d_o"], dtype=state_dtype, device=device)).sum()
    loss = loss + (final_state * torch.tensor(case["d_final_state"], dtype=state_dtype, device=device)).sum()
    loss.backward()
    out = dict(o=o, final_state=final_state, **{f"d{n}": tensors[n].grad for n in INPUT_NAMES})
    if initial is not None:
        out["dinitial_state"] = initial.grad
    return {name: value.detach().double().cpu().numpy() for name, value in out.items()}


def run_mlx(case, dtype="float32", chunk_size=64, path=None, function=None, compile=False):
    import mlx.core as mx

    from gdn2.mlx import chunk_gdn2

    function = function or chunk_gdn2
    mx_dtype = getattr(mx, dtype)
    state_dtype = mx.float64 if dtype == "float64" else mx.float32
    compute = mx.float64 if dtype == "float64" else mx.float32
    arrays = [mx.array(case["inputs"][n], dtype=compute).astype(mx_dtype) for n in INPUT_NAMES]
    initial = case["inputs"]["initial_state"]
    has_state = initial is not None
    if has_state:
        arrays.append(mx.array(initial, dtype=state_dtype))
    d_o = mx.array(case["d_o"], dtype=state_dtype)
    d_final = mx.array(case["d_final_state"], dtype=state_dtype)
    kwargs = dict(output_final_state=True, chunk_size=chunk_size)
    if path is not None:
        kwargs["path"] = path

    def loss(*args):
        o, final_state = function(*args[:6], initial_state=args[6] if has_state else None, **kwargs)
        return (o.astype(state_dtype) * d_o).sum() + (final_state * d_final).sum(), (o, final_state)

    value_and_grad = mx.value_and_grad(loss, argnums=tuple(range(len(arrays))))
    if compile:
        value_and_grad = mx.compile(value_and_grad)
    (_, (o, final_state)), grads = value_and_grad(*arrays)
    names = ["d" + n for n in GRAD_NAMES[: len(arrays)]]
    out = dict(o=o, final_state=final_state, **dict(zip(names, grads)))
    return {name: np.array(value.astype(mx.float64 if dtype == "float64" else mx.float32)).astype(np.float64) for name, value in out.items()}


def worst_error(result, expected):
    """The largest relative error over every output and gradient ``result`` has, and its name."""
    from gdn2.spec import relative_error

    errors = {name: relative_error(value, expected[name]) for name, value in result.items()}
    name = max(errors, key=errors.get)
    return errors[name], name, errors


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


def random_lengths(seed, count=5):
    """Lengths including 1 and values that are not multiples of any chunk size used."""
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(2, 40, count - 1).tolist()
