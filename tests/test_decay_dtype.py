"""A float32 g beside bfloat16 or float16 q, k, v, b, w (the layer computes its log decays in
float32): every path of both frameworks against the float64 spec on the same rounded inputs, o in
q's dtype and each gradient in its input's dtype; any other mix of dtypes is refused."""

from __future__ import annotations

import numpy as np
import pytest

from gdn2 import spec
from gdn2.testing import make_case, rounded_case, run_mlx, run_torch, with_expected, worst_error

torch = pytest.importorskip("torch")

GRADIENTS = ("dq", "dk", "dv", "dg", "db", "dw")


def _case(seed, dtype: str):
    """q, k, v, b, w rounded to ``dtype``, g to float32, the spec rerun on those values."""
    case = make_case(1, 70, 2, 32, 24, seed, log_decay_range=(-20.0, 0.0))
    narrow = getattr(torch, dtype)
    rounded = rounded_case(case, lambda x: torch.tensor(x).to(narrow).double().numpy())
    rounded["inputs"]["g"] = case["inputs"]["g"].astype(np.float32).astype(np.float64)
    return with_expected(rounded)


def _check(result, case, dtype, tolerance, label):
    assert result.dtypes["o"] == dtype and result.dtypes["dg"] == "float32", (label, result.dtypes)
    assert all(result.dtypes[name] == dtype for name in GRADIENTS if name != "dg"), (label, result.dtypes)
    error, name, errors = worst_error(result, case["expected"])
    assert error <= tolerance, (label, name, errors)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("path", ["reference", "chunk", "kernel"])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # the kernel path must not give way
def test_torch_paths(path, dtype, seed, monkeypatch, fresh_path_log):
    if path == "kernel":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = _case(seed, dtype)
    _check(run_torch(case, dtype, path=path, g_dtype="float32"), case, dtype, 2e-2, (path, seed))


@pytest.mark.parametrize("path", ["reference", "chunk"])
def test_mlx_paths(path, seed):
    pytest.importorskip("mlx.core")
    case = _case(seed, "bfloat16")
    _check(run_mlx(case, "bfloat16", path=path, g_dtype="float32"), case, "bfloat16", 2e-2, (path, seed))


def test_metal_kernels_run_a_float32_g_in_float32(seed):
    """The Metal kernels take one input dtype: the entry runs the call in float32 and casts back."""
    pytest.importorskip("mlx.core")
    from gdn2.mlx import metal
    from gdn2.mlx.metal import dispatch
    from gdn2.testing import mlx_gradients
    from tests.metal_harness import harness

    case = _case(seed, "bfloat16")

    def entry(q, k, v, g, b, w, initial_state=None, output_final_state=True):
        return dispatch.run(q, k, v, g, b, w, scale=q.shape[-1] ** -0.5, initial_state=initial_state,
                            output_final_state=output_final_state)

    with metal.use_launcher(harness.harness_launcher):
        result = mlx_gradients(case, "bfloat16", entry, g_dtype="float32")
    _check(result, case, "bfloat16", 2e-2, seed)


@pytest.mark.parametrize("q_dtype,name,other", [
    ("bfloat16", "g", "float16"),  # g: q's dtype or float32 only
    ("float64", "g", "float32"),   # float64 inputs: all float64
    ("float32", "g", "bfloat16"),
    ("bfloat16", "k", "float32"),  # only g may differ
    ("bfloat16", "w", "float32"),
])
def test_other_mixes_are_refused(q_dtype, name, other):
    x = {n: torch.zeros(1, 3, 1, 4, dtype=getattr(torch, q_dtype)) for n in spec.INPUT_NAMES}
    x[name] = x[name].to(getattr(torch, other))
    with pytest.raises(ValueError, match=f"^{name}: expected dtype {q_dtype}"):
        spec.validate(*(x[n] for n in spec.INPUT_NAMES))
