"""What the tests, the benchmarks and ``python -m gdn2 demo`` share: random cases with the float64
spec's answers, one forward+backward through a framework collected as float64 numpy, error
measures and timing.

A case is a dict (``make_case``, ``packed_case``)::

    inputs         q, k, v, g, b, w [B, T, H, D] and initial_state [N, H, K, V] or None (float64)
    d_o            the gradient flowing into o, [B, T, H, V]
    d_final_state  the gradient flowing into the final state, [N, H, K, V]
    cu_seqlens     packed cases only: int64 offsets [N + 1] (B = 1)
    expected       unless ``reference=False``: the spec's o, final_state and dq ... dinitial_state

Running a case (``run_torch``, ``run_mlx``) differentiates ``sum(o * d_o) + sum(final_state *
d_final_state)`` and returns ``Outputs``: o, final_state and a gradient per differentiable input.
torch and MLX are imported only by the functions that use them.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Callable, NamedTuple

import numpy as np

from .spec import INPUT_NAMES, random_inputs, reference_backward, reference_forward, relative_error

GRAD_NAMES = INPUT_NAMES + ("initial_state",)
DEFAULT_DECAY = (-3.0, 0.0)


class Shape(NamedTuple):
    """Sizes of a test or benchmark case; ``str`` is its test id (defaults left out)."""

    B: int
    T: int
    H: int
    K: int
    V: int
    chunk_size: int = 64
    log_decay_range: tuple[float, float] = DEFAULT_DECAY

    def __str__(self) -> str:
        text = f"B{self.B}T{self.T}H{self.H}K{self.K}V{self.V}"
        if self.chunk_size != 64:
            text += f"-C{self.chunk_size}"
        if self.log_decay_range != DEFAULT_DECAY:
            text += "-g{:g}..{:g}".format(*self.log_decay_range)
        return text

    def case(self, seed: int, **options) -> dict:
        """``make_case`` at these sizes and this log decay range."""
        return make_case(self.B, self.T, self.H, self.K, self.V, seed, log_decay_range=self.log_decay_range, **options)


# ---- cases --------------------------------------------------------------------------------------


def make_case(B, T, H, K, V, seed, *, log_decay_range=DEFAULT_DECAY, erase_max=1.0, with_state=True, reference=True) -> dict:
    """Random inputs (``gdn2.spec.random_inputs``), random upstream gradients, and the spec's results."""
    inputs = random_inputs(B, T, H, K, V, seed, log_decay_range=log_decay_range, erase_max=erase_max)
    if not with_state:
        inputs["initial_state"] = None
    rng = np.random.default_rng(seed + 1)
    case = dict(inputs=inputs, d_o=rng.standard_normal((B, T, H, V)), d_final_state=rng.standard_normal((B, H, K, V)))
    return with_expected(case) if reference else case


def with_expected(case: dict) -> dict:
    """The case with ``expected`` (the float64 spec run on its inputs) filled in."""
    inputs, cu_seqlens = case["inputs"], case.get("cu_seqlens")
    o, final_state = reference_forward(**inputs, cu_seqlens=cu_seqlens)
    grads = reference_backward(**inputs, d_o=case["d_o"], d_final_state=case["d_final_state"], cu_seqlens=cu_seqlens)
    expected = dict(o=o, final_state=final_state, **{f"d{name}": grads[name] for name in GRAD_NAMES})
    return dict(case, expected=expected)


def rounded_case(case: dict, round_inputs: Callable[[np.ndarray], np.ndarray]) -> dict:
    """The case with q ... w rounded by ``round_inputs`` (to a low-precision dtype and back) and
    the initial state to float32, and the spec rerun on them: a low-precision run is then judged
    on its arithmetic, not on the rounding of its inputs."""
    inputs = {name: round_inputs(case["inputs"][name]) for name in INPUT_NAMES}
    state = case["inputs"]["initial_state"]
    inputs["initial_state"] = None if state is None else state.astype(np.float32).astype(np.float64)
    return with_expected(dict(case, inputs=inputs))


def packed_case(seed, lengths, H=2, K=8, V=6) -> dict:
    """Sequences of ``lengths`` packed in one row (``cu_seqlens``), g in [-20, 0]; ``expected`` is
    the spec run on each sequence alone."""
    T, N = sum(lengths), len(lengths)
    inputs = random_inputs(1, T, H, K, V, seed, log_decay_range=(-20.0, 0.0))
    rng = np.random.default_rng(seed + 1)
    inputs["initial_state"] = rng.standard_normal((N, H, K, V))
    d_o, d_final = rng.standard_normal((1, T, H, V)), rng.standard_normal((N, H, K, V))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return with_expected(dict(inputs=inputs, d_o=d_o, d_final_state=d_final, cu_seqlens=offsets))


def random_lengths(seed, count=5) -> list[int]:
    """Sequence lengths including 1 and values that are not multiples of any chunk size used."""
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(2, 40, count - 1).tolist()


# ---- running a case -----------------------------------------------------------------------------


class Outputs(dict):
    """o, final_state and the gradients (dq ... dinitial_state) as float64 numpy; ``dtypes``: the
    dtype name each had in the framework."""

    dtypes: dict[str, str]


def _outputs(values: dict, to_numpy) -> Outputs:
    result = Outputs({name: to_numpy(x) for name, x in values.items()})
    result.dtypes = {name: str(x.dtype).rsplit(".", 1)[-1] for name, x in values.items()}
    return result


def torch_gradients(case: dict, dtype: str, function, device: str = "cpu", g_dtype: str | None = None) -> Outputs:
    """``function(q, k, v, g, b, w, initial_state=, output_final_state=True)`` forward and backward
    on the case's inputs in ``dtype`` (g in ``g_dtype`` if given; the state in float32, float64
    for float64)."""
    import torch

    compute = torch.float64 if dtype == "float64" else torch.float32
    dtypes = dict.fromkeys(INPUT_NAMES, dtype) | ({} if g_dtype is None else {"g": g_dtype})
    leaves = {n: torch.tensor(case["inputs"][n], dtype=getattr(torch, dtypes[n]), device=device, requires_grad=True)
              for n in INPUT_NAMES}
    if case["inputs"]["initial_state"] is not None:
        leaves["initial_state"] = torch.tensor(case["inputs"]["initial_state"], dtype=compute, device=device, requires_grad=True)
    o, final_state = function(
        *(leaves[n] for n in INPUT_NAMES), initial_state=leaves.get("initial_state"), output_final_state=True
    )
    loss = (o.to(compute) * torch.tensor(case["d_o"], dtype=compute, device=device)).sum()
    loss = loss + (final_state * torch.tensor(case["d_final_state"], dtype=compute, device=device)).sum()
    loss.backward()
    values = dict(o=o, final_state=final_state, **{f"d{n}": leaf.grad for n, leaf in leaves.items()})
    return _outputs(values, lambda x: x.detach().double().cpu().numpy())


def mlx_arrays(case: dict, dtype: str, g_dtype: str | None = None) -> dict:
    """The case's inputs as MLX arrays in ``dtype`` (g in ``g_dtype`` if given; through float32
    unless float64); the state in float32 (float64 for float64)."""
    import mlx.core as mx

    compute = mx.float64 if dtype == "float64" else mx.float32
    dtypes = dict.fromkeys(INPUT_NAMES, dtype) | ({} if g_dtype is None else {"g": g_dtype})
    arrays = {n: mx.array(case["inputs"][n], dtype=compute).astype(getattr(mx, dtypes[n])) for n in INPUT_NAMES}
    if case["inputs"]["initial_state"] is not None:
        arrays["initial_state"] = mx.array(case["inputs"]["initial_state"], dtype=compute)
    return arrays


def mlx_gradients(case: dict, dtype: str, function, compile: bool = False, g_dtype: str | None = None) -> Outputs:
    """``torch_gradients`` in MLX (``mx.value_and_grad``, optionally under ``mx.compile``)."""
    import mlx.core as mx

    compute = mx.float64 if dtype == "float64" else mx.float32
    arrays = mlx_arrays(case, dtype, g_dtype)
    names = list(arrays)
    d_o, d_final = mx.array(case["d_o"], dtype=compute), mx.array(case["d_final_state"], dtype=compute)

    def loss(*xs):
        o, final_state = function(*xs[:6], initial_state=xs[6] if len(xs) > 6 else None, output_final_state=True)
        return (o.astype(compute) * d_o).sum() + (final_state * d_final).sum(), (o, final_state)

    value_and_grad = mx.value_and_grad(loss, argnums=tuple(range(len(names))))
    if compile:
        value_and_grad = mx.compile(value_and_grad)
    (_, (o, final_state)), grads = value_and_grad(*(arrays[n] for n in names))
    values = dict(o=o, final_state=final_state, **{f"d{n}": grad for n, grad in zip(names, grads)})
    return _outputs(values, lambda x: np.array(x.astype(compute)).astype(np.float64))


def run_torch(case: dict, dtype="float32", chunk_size=64, path=None, *, device="cpu", g_dtype=None) -> Outputs:
    """``gdn2.torch.chunk_gdn2`` forward and backward on the case (packed cases with their offsets;
    g in ``g_dtype`` if given)."""
    import torch

    from .torch import chunk_gdn2

    offsets = case.get("cu_seqlens")
    cu_seqlens = None if offsets is None else torch.tensor(offsets, device=device)
    return torch_gradients(case, dtype, partial(chunk_gdn2, chunk_size=chunk_size, path=path, cu_seqlens=cu_seqlens),
                           device, g_dtype)


def run_mlx(case: dict, dtype="float32", chunk_size=64, path=None, *, compile=False, g_dtype=None) -> Outputs:
    """``gdn2.mlx.chunk_gdn2`` forward and backward on the case (packed cases with their offsets;
    g in ``g_dtype`` if given)."""
    import mlx.core as mx

    from .mlx import chunk_gdn2

    offsets = case.get("cu_seqlens")
    cu_seqlens = None if offsets is None else mx.array(offsets)
    return mlx_gradients(case, dtype, partial(chunk_gdn2, chunk_size=chunk_size, path=path, cu_seqlens=cu_seqlens),
                         compile, g_dtype)


# ---- errors and timing --------------------------------------------------------------------------


def worst_error(result: dict, expected: dict) -> tuple[float, str, dict]:
    """The largest relative error over every output and gradient ``result`` has, its name, and all."""
    errors = {name: relative_error(value, expected[name]) for name, value in result.items()}
    name = max(errors, key=errors.get)
    return errors[name], name, errors


def assert_close(name: str, got, expected, tolerance: float) -> float:
    """Raise ``AssertionError`` unless ``relative_error(got, expected) <= tolerance``; return the error."""
    error = relative_error(got, expected)
    if not error <= tolerance:
        raise AssertionError(f"{name}: relative error {error:.3e} > {tolerance:.1e}")
    return error


def median_ms(run: Callable[[], object], repeats: int, warmup: int = 1, sync: Callable[[], object] = lambda: None) -> float:
    """Median wall time of ``run(); sync()`` in milliseconds over ``repeats`` calls, after ``warmup``
    untimed calls (``sync`` waits for the device, for example ``torch.cuda.synchronize``)."""
    for _ in range(warmup):
        run()
        sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cuda_kernel_times(run: Callable[[], object], iterations: int = 5, top: int = 25) -> list[dict]:
    """GPU time per call of ``run`` by kernel, from torch.profiler: ``[{kernel, ms, calls}]``, the
    ``top`` largest first (``ms`` and ``calls`` per call of ``run``). One untimed call first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            run()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us > 0:
            rows.append((event.key, device_us / 1000 / iterations, event.count // iterations))
    rows.sort(key=lambda r: -r[1])
    return [dict(kernel=name[:90], ms=round(ms, 4), calls=calls) for name, ms, calls in rows[:top]]
