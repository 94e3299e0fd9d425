"""Argument validation and path selection, in both frameworks."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest

from gdn2.spec import random_inputs

FRAMEWORKS = ["torch", "mlx"]


def arrays(framework, B=2, T=5, H=2, K=4, V=3, seed=0, dtype="float32"):
    x = random_inputs(B, T, H, K, V, seed)
    if framework == "torch":
        import torch

        make = lambda a, d=dtype: torch.tensor(a, dtype=getattr(torch, d))  # noqa: E731
    else:
        import mlx.core as mx

        make = lambda a, d=dtype: mx.array(a, dtype=getattr(mx, d))  # noqa: E731
    out = {n: make(x[n]) for n in ("q", "k", "v", "g", "b", "w")}
    out["initial_state"] = make(x["initial_state"], "float32")
    out["make"] = make
    return out


def api(framework):
    if framework == "torch":
        import gdn2.torch as module
    else:
        import gdn2.mlx as module
    return module


def call(framework, x, **kwargs):
    args = {n: x[n] for n in ("q", "k", "v", "g", "b", "w")}
    args.update(kwargs)
    return api(framework).chunk_gdn2(**args)


# (what to change, a phrase the error must contain), by the argument and what is wrong with it
BAD_INPUTS = [
    pytest.param(lambda x, m: dict(k=m(np.ones((2, 5, 2, 5)))), "k: expected shape [B, T, H, K] = [2, 5, 2, 4]", id="k-shape"),
    pytest.param(lambda x, m: dict(g=m(np.ones((2, 6, 2, 4)))), "g: expected shape [B, T, H, K]", id="g-shape"),
    pytest.param(lambda x, m: dict(b=m(np.ones((2, 5, 3, 4)))), "b: expected shape [B, T, H, K]", id="b-shape"),
    pytest.param(lambda x, m: dict(w=m(np.ones((2, 5, 2, 4)))), "w: expected shape [B, T, H, V] = [2, 5, 2, 3]", id="w-shape"),
    pytest.param(lambda x, m: dict(v=m(np.ones((1, 5, 2, 3)))), "v: expected shape [B, T, H, V] = [2, 5, 2, 3] (B, T, H from q, V from v), received [1, 5, 2, 3]", id="v-shape"),
    pytest.param(lambda x, m: dict(q=m(np.ones((2, 5, 2)))), "q: expected 4 dimensions", id="q-dimensions"),
    pytest.param(lambda x, m: dict(w=m(np.ones((2, 5, 2, 3)), "float16")), "w: expected dtype float32 (the dtype of q), received float16", id="w-dtype"),
    pytest.param(lambda x, m: dict(initial_state=m(np.ones((2, 2, 4, 4)), "float32")), "initial_state: expected shape [B, H, K, V] = [2, 2, 4, 3]", id="initial_state-shape"),
    pytest.param(lambda x, m: dict(initial_state=m(np.ones((2, 2, 4, 3)), "float16")), "initial_state: expected dtype float32, received float16", id="initial_state-dtype"),
    pytest.param(lambda x, m: dict(chunk_size=0), "chunk_size: expected an integer >= 1, received 0", id="chunk_size-0"),
    pytest.param(lambda x, m: dict(chunk_size=2.5), "chunk_size: expected an integer >= 1", id="chunk_size-2.5"),
    pytest.param(lambda x, m: dict(scale=0.0), "scale: expected a finite number > 0, received 0.0", id="scale-0"),
    pytest.param(lambda x, m: dict(scale=float("nan")), "scale: expected a finite number > 0", id="scale-nan"),
    pytest.param(lambda x, m: dict(scale=-1.0), "scale: expected a finite number > 0", id="scale-negative"),
    pytest.param(lambda x, m: dict(path="fast"), "path: expected one of reference, chunk, kernel", id="path-unknown"),
    pytest.param(lambda x, m: dict(output_final_state="no"), "output_final_state: expected True or False, received 'no'",
                 id="output_final_state-string"),
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("change,message", BAD_INPUTS)
def test_bad_input_names_argument_expected_and_received(framework, change, message):
    x = arrays(framework)
    with pytest.raises(ValueError) as error:
        call(framework, x, **change(x, x["make"]))
    assert message in str(error.value)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_integer_input_is_rejected(framework):
    x = arrays(framework)
    bad = x["make"](np.ones((2, 5, 2, 4)), "int32")
    with pytest.raises(ValueError, match="q: expected a floating dtype"):
        call(framework, dict(x, q=bad))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_recurrent_validates_too(framework):
    x = arrays(framework)
    args = {n: x[n] for n in ("q", "k", "v", "g", "b", "w")}
    args["v"] = x["make"](np.ones((2, 5, 2, 7)))
    with pytest.raises(ValueError, match="w: expected shape"):
        api(framework).recurrent_gdn2(**args)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_path_report_and_environment(framework, monkeypatch):
    x = arrays(framework)
    args = {n: x[n] for n in ("q", "k", "v", "g", "b", "w")}
    module = api(framework)
    monkeypatch.delenv("GDN2_PATH", raising=False)
    automatic = module.which_path(**args)
    assert automatic.path == "chunk" and "automatic" in automatic.reason  # no GPU kernel on this machine
    assert module.which_path(**args, path="reference").path == "reference"
    monkeypatch.setenv("GDN2_PATH", "reference")
    assert module.which_path(**args).path == "reference"
    assert "GDN2_PATH" in module.which_path(**args).reason
    assert module.which_path(**args, path="chunk").path == "chunk"  # the argument wins
    monkeypatch.setenv("GDN2_PATH", "turbo")
    with pytest.raises(ValueError, match="GDN2_PATH: expected one of reference, chunk, kernel, received 'turbo'"):
        module.which_path(**args)


def test_forced_unavailable_kernel_falls_back_once_with_a_warning(monkeypatch, caplog, fresh_path_log):
    """MLX on Linux has no Metal: a forced kernel gives way to the chunk path, warning once."""
    import mlx.core as mx

    x = arrays("mlx")
    args = {n: x[n] for n in ("q", "k", "v", "g", "b", "w")}
    monkeypatch.delenv("GDN2_PATH", raising=False)
    choice = api("mlx").which_path(**args, path="kernel")
    assert choice.path == "chunk" and "unavailable" in choice.reason
    with caplog.at_level(logging.INFO, logger="gdn2"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forced, _ = call("mlx", x, path="kernel")
        again, _ = call("mlx", x, path="kernel")
    fallback_warnings = [w for w in caught if "requested but unavailable" in str(w.message)]
    assert len(fallback_warnings) == 1
    reference, _ = call("mlx", x, path="chunk")
    assert np.allclose(np.array(forced), np.array(reference))
    assert mx.all(forced == again).item()


def test_choice_is_logged_once(monkeypatch, caplog, fresh_path_log):
    x = arrays("torch")
    monkeypatch.delenv("GDN2_PATH", raising=False)
    with caplog.at_level(logging.INFO, logger="gdn2"):
        call("torch", x)
        call("torch", x)
    lines = [r.getMessage() for r in caplog.records if r.name == "gdn2"]
    assert len(lines) == 1 and lines[0].startswith("gdn2.torch: chunk")


def kernel_package(framework):
    """The framework's kernel package and the name of its entry function."""
    if framework == "torch":
        pytest.importorskip("triton")
        from gdn2.torch import triton as kernels

        return kernels, "triton_gdn2"
    from gdn2.mlx import metal as kernels

    return kernels, "metal_gdn2"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_kernel_failure_gives_way_and_a_wrapper_bug_surfaces(framework, monkeypatch, fresh_path_log):
    """A failure the kernel package declares (compile, launch, resources) gives way to the chunk
    path with one warning; any other exception from the kernel path propagates."""
    x = arrays(framework)
    kernels, entry = kernel_package(framework)
    monkeypatch.setattr(kernels, "unsupported_reason", lambda *args, **kwargs: None)
    expected, _ = call(framework, x, path="chunk")

    def raising(error):
        def kernel(*args, **kwargs):
            raise error

        return kernel

    for failure in kernels.KERNEL_FAILURES:
        monkeypatch.setattr(kernels, entry, raising(failure(f"{failure.__name__} from the kernel")))
        with pytest.warns(RuntimeWarning, match=f"kernel failed: {failure.__name__}: {failure.__name__} from the kernel"):
            o, _ = call(framework, x, path="kernel")
        assert np.allclose(o.tolist(), expected.tolist())
    for bug in (TypeError("a wrapper bug"), AttributeError("a wrapper bug"), ValueError("a wrapper bug")):
        monkeypatch.setattr(kernels, entry, raising(bug))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback may happen
            with pytest.raises(type(bug), match="a wrapper bug"):
                call(framework, x, path="kernel")
