"""Higher-order gradients, torch.func transforms and inference tensors on the PyTorch paths.

The reference and chunk paths give exact second-order gradients (float64 ``gradgradcheck``, and
Hessian-vector products of the chunk path equal the reference path's with T spanning several
chunks); the Triton kernel path raises a clear error instead. ``torch.func`` transforms run the
chunk path; forward mode says to use the reference path."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gdn2.spec import INPUT_NAMES, random_inputs  # noqa: E402
from gdn2.torch import chunk_gdn2  # noqa: E402

NAMES = INPUT_NAMES + ("initial_state",)


def leaves(seed, B=1, T=9, H=1, K=3, V=2, dtype=torch.float64):
    x = random_inputs(B, T, H, K, V, seed, log_decay_range=(-2.0, 0.0))
    return [torch.tensor(x[n], dtype=dtype, requires_grad=True) for n in NAMES]


def operator(path, chunk_size):
    def f(q, k, v, g, b, w, initial_state):
        return chunk_gdn2(q, k, v, g, b, w, initial_state=initial_state, output_final_state=True,
                          chunk_size=chunk_size, path=path)
    return f


@pytest.mark.parametrize("path", ["reference", "chunk"])
def test_gradgradcheck(path, seed):
    """T = 9 in chunks of 4: three chunks, so the chunk states depend on the inputs."""
    assert torch.autograd.gradgradcheck(operator(path, 4), leaves(seed), fast_mode=True)


def hessian_vector_products(path, inputs, seed):
    """d/d(inputs) of <grad(loss), u>, loss = <o, d_o> + <final_state, d_final> with d_o a function
    of o (so the cotangent itself carries a graph), for a random direction u."""
    rng = np.random.default_rng(seed)
    o, final_state = operator(path, 16)(*inputs)
    d_o = torch.tensor(rng.standard_normal(o.shape))
    d_final = torch.tensor(rng.standard_normal(final_state.shape))
    loss = (o * d_o).sum() + (torch.tanh(o) ** 2).sum() + (final_state * d_final).sum()
    grads = torch.autograd.grad(loss, inputs, create_graph=True)
    directions = [torch.tensor(rng.standard_normal(x.shape)) for x in inputs]
    inner = sum((g * u).sum() for g, u in zip(grads, directions))
    return torch.autograd.grad(inner, inputs)


def test_chunk_hessian_vector_products_equal_the_reference(seed):
    """T = 40 in chunks of 16 (the states between chunks depend on every input)."""
    inputs = leaves(seed, B=2, T=40, H=2, K=8, V=6)
    expected = hessian_vector_products("reference", inputs, seed)
    got = hessian_vector_products("chunk", inputs, seed)
    for name, x, y in zip(NAMES, got, expected):
        error = float((x - y).norm() / y.norm())
        assert error <= 1e-10, (name, error)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a fallback to the chunk path would warn: make it a failure
def test_triton_kernel_path_refuses_second_order(seed, monkeypatch, fresh_path_log):
    """The kernels' backward is not differentiable: create_graph=True raises, naming the paths that
    give higher-order gradients (run by the Triton interpreter, set in conftest.py)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("GDN2_PATH", raising=False)
    inputs = leaves(seed, T=5, K=16, V=16, dtype=torch.float32)
    inputs[-1] = inputs[-1].detach().requires_grad_(True)
    o, final_state = operator("kernel", 64)(*inputs)
    with pytest.raises(RuntimeError, match=r'chunk_gdn2\(path="kernel"\): higher-order gradients .* path="reference"'):
        torch.autograd.grad(o.sum() + final_state.sum(), inputs, create_graph=True)
    first = torch.autograd.grad(operator("kernel", 64)(*inputs)[0].sum(), inputs)  # first order still works
    assert all(torch.isfinite(x).all() for x in first)


# ---- torch.func ---------------------------------------------------------------------------------


def output_sum(path, chunk_size=4):
    def f(q, k, v, g, b, w, initial_state):
        o, final_state = operator(path, chunk_size)(q, k, v, g, b, w, initial_state)
        return (o * o.detach().sign()).sum() + final_state.sum()
    return f


def assert_all_close(got, expected, label):
    for name, x, y in zip(NAMES, got, expected):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12, msg=f"{label}: {name}")


def test_torch_func_grad_and_vjp(seed):
    inputs = [x.detach() for x in leaves(seed)]
    argnums = tuple(range(len(inputs)))
    expected = torch.func.grad(output_sum("reference"), argnums=argnums)(*inputs)
    assert_all_close(torch.func.grad(output_sum("chunk"), argnums=argnums)(*inputs), expected, "grad")
    (o, final_state), pullback = torch.func.vjp(operator("chunk", 4), *inputs)
    (o_ref, final_ref), pullback_ref = torch.func.vjp(operator("reference", 4), *inputs)
    cotangents = (torch.ones_like(o), torch.ones_like(final_state))
    assert_all_close(pullback(cotangents), pullback_ref(cotangents), "vjp")


def test_torch_func_jacrev_and_vmap(seed):
    inputs = [x.detach() for x in leaves(seed, T=6, K=2, V=2)]
    first_output = lambda path: (lambda *xs: operator(path, 4)(*xs)[0])  # noqa: E731
    torch.testing.assert_close(torch.func.jacrev(first_output("chunk"), argnums=3)(*inputs),
                               torch.func.jacrev(first_output("reference"), argnums=3)(*inputs), rtol=1e-10, atol=1e-12)
    batch = [torch.stack([x, 0.5 * x]) for x in inputs]  # a leading vmap dimension
    mapped = torch.func.vmap(operator("chunk", 4))(*batch)
    for i in range(2):
        one = operator("chunk", 4)(*(x[i] for x in batch))
        for got, expected in zip(mapped, one):
            torch.testing.assert_close(got[i], expected, rtol=1e-12, atol=1e-12)


def test_torch_func_second_order_jacrev_of_grad(seed):
    inputs = [x.detach() for x in leaves(seed, T=6, K=2, V=2)]
    hessian_g = {path: torch.func.jacrev(torch.func.grad(output_sum(path), argnums=3), argnums=3)(*inputs)
                 for path in ("chunk", "reference")}
    torch.testing.assert_close(hessian_g["chunk"], hessian_g["reference"], rtol=1e-9, atol=1e-12)


def test_forward_mode_says_to_use_the_reference_path(seed):
    inputs = [x.detach() for x in leaves(seed)]
    tangents = [torch.ones_like(x) for x in inputs]
    with pytest.raises(NotImplementedError, match=r'forward-mode .* path="reference"'):
        torch.func.jvp(operator("chunk", 4), tuple(inputs), tuple(tangents))
    o, tangent_o = torch.func.jvp(lambda *xs: operator("reference", 4)(*xs)[0], tuple(inputs), tuple(tangents))
    assert torch.isfinite(tangent_o).all()


# ---- inference tensors --------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["reference", "chunk"])
@pytest.mark.parametrize("name", ["q", "v", "initial_state"])
def test_inference_tensor_in_training_names_the_argument(path, name, seed):
    inputs = dict(zip(NAMES, leaves(seed, dtype=torch.float32)))
    with torch.inference_mode():
        inputs[name] = inputs[name].detach().clone()
    expected = (rf"{name}: expected a normal tensor, since gradients are recorded \(\w+ requires grad\), "
                r"received an inference tensor")
    with pytest.raises(ValueError, match=expected):
        operator(path, 4)(**inputs)
    # Without gradients recorded it runs: under no_grad, and under inference mode.
    with torch.no_grad():
        operator(path, 4)(**inputs)
    with torch.inference_mode():
        o, _ = operator(path, 4)(**inputs)
    assert torch.isfinite(o).all()
