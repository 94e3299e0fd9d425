"""Bad inputs to the operator, the layer and the language model: a ValueError that names the
argument, the expected and the received, in both frameworks; never a crash or a silent cast."""

from __future__ import annotations

import numpy as np
import pytest

from gdn2.spec import INPUT_NAMES, random_inputs, reference_forward, validate
from gdn2.weights import ModelConfig

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core")

import gdn2.mlx as gm  # noqa: E402
import gdn2.torch as gt  # noqa: E402
from gdn2.mlx import layer as mlx_layer  # noqa: E402
from gdn2.torch import layer as torch_layer  # noqa: E402

FRAMEWORKS = ["torch", "mlx"]


def operator_args(framework, seed, B=1, T=10, H=2, K=4, V=3):
    x = random_inputs(B, T, H, K, V, seed)
    if framework == "torch":
        return [torch.tensor(x[n], dtype=torch.float32) for n in INPUT_NAMES], torch.tensor(x["initial_state"], dtype=torch.float32), x
    return [mx.array(x[n], dtype=mx.float32) for n in INPUT_NAMES], mx.array(x["initial_state"], dtype=mx.float32), x


def module(framework):
    return gt if framework == "torch" else gm


# ---- the operator: types, devices, scale, offsets ----


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("function", ["chunk_gdn2", "recurrent_gdn2"])
def test_scale_true_is_not_a_number(framework, function, seed):
    args, _, x = operator_args(framework, seed)
    with pytest.raises(ValueError, match=r"scale: expected a finite number > 0, received True"):
        getattr(module(framework), function)(*args, scale=True)
    with pytest.raises(ValueError, match=r"scale: expected a finite number > 0, received False"):
        reference_forward(*(x[n] for n in INPUT_NAMES), scale=False)


TYPE = {"torch": "torch.Tensor", "mlx": "mlx.core.array"}


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("position", range(1, 6))
def test_numpy_array_or_list_among_the_inputs(framework, position, seed):
    args, _, x = operator_args(framework, seed)
    name = INPUT_NAMES[position]
    for wrong, received in ((x[name].astype(np.float32), "numpy.ndarray"), (x[name].tolist(), "list")):
        bad = list(args)
        bad[position] = wrong
        with pytest.raises(ValueError) as error:
            module(framework).chunk_gdn2(*bad)
        assert str(error.value) == f"{name}: expected {TYPE[framework]} (the type of q), received {received}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_initial_state_and_offsets_of_another_type(framework, seed):
    args, _, x = operator_args(framework, seed)
    with pytest.raises(ValueError, match=rf"initial_state: expected {TYPE[framework]} \(the type of q\), received numpy.ndarray"):
        module(framework).chunk_gdn2(*args, initial_state=x["initial_state"].astype(np.float32))
    with pytest.raises(ValueError, match=rf"cu_seqlens: expected {TYPE[framework]} \(the type of q\), received list"):
        module(framework).chunk_gdn2(*args, cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match=r"cu_seqlens: expected an integer array of shape \[N \+ 1\], received list"):
        module(framework).layer.GatedDeltaNet2(hidden_size=8, head_dim=4, num_heads=2)(
            (torch.zeros if framework == "torch" else mx.zeros)((1, 10, 8)), cu_seqlens=[0, 4, 10]
        )


def test_torch_tensors_passed_to_mlx(seed):
    args, state, _ = operator_args("mlx", seed)
    torch_args, torch_state, _ = operator_args("torch", seed)
    with pytest.raises(ValueError, match=r"k: expected mlx.core.array \(the type of q\), received torch.Tensor"):
        gm.chunk_gdn2(args[0], torch_args[1], *args[2:])
    with pytest.raises(ValueError, match=r"initial_state: expected mlx.core.array \(the type of q\), received torch.Tensor"):
        gm.chunk_gdn2(*args, initial_state=torch_state)


def test_validate_checks_the_framework_it_is_told(seed):
    x = random_inputs(1, 5, 1, 2, 2, seed)
    arrays = [x[n] for n in INPUT_NAMES]
    with pytest.raises(ValueError, match=r"^q: expected torch.Tensor, received numpy.ndarray$"):
        validate(*arrays, framework="torch")
    with pytest.raises(ValueError, match=r"^q: expected mlx.core.array, received numpy.ndarray$"):
        validate(*arrays, framework="mlx")
    with pytest.raises(ValueError, match=r"^q: expected an array \(numpy.ndarray, torch.Tensor, mlx.core.array\), received list$"):
        validate(x["q"].tolist(), *arrays[1:])
    assert validate(*arrays, framework="numpy").T == 5


def test_mixed_devices(seed):
    args, state, _ = operator_args("torch", seed)
    for position, name in enumerate(INPUT_NAMES):
        bad = list(args)
        bad[position] = bad[position].to("meta")
        with pytest.raises(ValueError) as error:
            gt.chunk_gdn2(*bad)
        expected = "k" if name == "q" else name  # q elsewhere: k is the first one off q's device
        assert str(error.value) == f"{expected}: expected a tensor on {bad[0].device} (the device of q), received one on {'cpu' if name == 'q' else 'meta'}"
    with pytest.raises(ValueError, match=r"initial_state: expected a tensor on cpu \(the device of q\), received one on meta"):
        gt.chunk_gdn2(*args, initial_state=state.to("meta"))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["uint8", "int16", "int8"])
def test_offsets_must_be_int32_or_int64(framework, dtype, seed):
    args, _, _ = operator_args(framework, seed)
    offsets = np.array([0, 4, 10])
    cu = torch.tensor(offsets).to(getattr(torch, dtype)) if framework == "torch" else mx.array(offsets).astype(getattr(mx, dtype))
    with pytest.raises(ValueError, match=rf"cu_seqlens: expected an integer dtype \(int32 or int64\), received {dtype}"):
        module(framework).chunk_gdn2(*args, cu_seqlens=cu)
