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
