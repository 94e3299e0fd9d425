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
        assert str(error.value) == f"{name}: expected {TYPE[framework]}, received {received}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_initial_state_and_offsets_of_another_type(framework, seed):
    args, _, x = operator_args(framework, seed)
    with pytest.raises(ValueError, match=rf"initial_state: expected {TYPE[framework]}, received numpy.ndarray"):
        module(framework).chunk_gdn2(*args, initial_state=x["initial_state"].astype(np.float32))
    with pytest.raises(ValueError, match=rf"cu_seqlens: expected {TYPE[framework]}, received list"):
        module(framework).chunk_gdn2(*args, cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match=rf"^cu_seqlens: expected {TYPE[framework]}, received list$"):
        module(framework).layer.GatedDeltaNet2(hidden_size=8, head_dim=4, num_heads=2)(
            (torch.zeros if framework == "torch" else mx.zeros)((1, 10, 8)), cu_seqlens=[0, 4, 10]
        )


def test_torch_tensors_passed_to_mlx(seed):
    args, state, _ = operator_args("mlx", seed)
    torch_args, torch_state, _ = operator_args("torch", seed)
    with pytest.raises(ValueError, match=r"k: expected mlx.core.array, received torch.Tensor"):
        gm.chunk_gdn2(args[0], torch_args[1], *args[2:])
    with pytest.raises(ValueError, match=r"initial_state: expected mlx.core.array, received torch.Tensor"):
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


# ---- the language model: token ids ----

SMALL = ModelConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, head_dim=4, chunk_size=4)


def language_model(framework):
    model = module(framework).GDN2LanguageModel(SMALL)
    return model if framework == "mlx" else model.eval()


def ids(framework, values, dtype="int64"):
    values = np.asarray(values)
    return torch.tensor(values, dtype=getattr(torch, dtype)) if framework == "torch" else mx.array(values).astype(getattr(mx, dtype))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("bad, low, high", [(16, 0, 16), (-1, -1, 15), (10**6, 0, 10**6)])
def test_token_ids_out_of_range(framework, bad, low, high):
    tokens = np.arange(16).reshape(2, 8) if bad != -1 else np.arange(16).reshape(2, 8) - (np.arange(16).reshape(2, 8) == 0)
    tokens = tokens.copy()
    tokens[1, 3] = bad
    tokens[0, 0] = low
    tokens[0, 1] = high
    with pytest.raises(ValueError) as error:
        language_model(framework)(ids(framework, tokens))
    assert str(error.value) == f"input_ids: expected token ids in [0, 15] (vocab_size 16), received min {low}, max {high}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_token_ids_type_shape_and_dtype(framework):
    model = language_model(framework)
    with pytest.raises(ValueError, match=rf"^input_ids: expected {TYPE[framework]}, received numpy.ndarray$"):
        model(np.zeros((1, 4), dtype=np.int64))
    with pytest.raises(ValueError, match=rf"^input_ids: expected {TYPE[framework]}, received list$"):
        model([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"^input_ids: expected at least one token \(B >= 1 and T >= 1\), received shape \[2, 0\]$"):
        model(ids(framework, np.zeros((2, 0), dtype=np.int64)))
    with pytest.raises(ValueError, match=r"^input_ids: expected shape \[B, T\], received \[4\]$"):
        model(ids(framework, np.arange(4)))
    with pytest.raises(ValueError, match=r"^input_ids: expected an integer dtype \(.*\), received float32$"):
        model(ids(framework, np.ones((1, 4)), "float32"))
    # in range: same logits on two calls (an id == vocab_size used to read past the table)
    good = ids(framework, np.array([[0, 15, 3, 7]]))
    first, second = (np.array(model(good).tolist()) for _ in range(2))
    np.testing.assert_array_equal(first, second)


def test_token_check_under_torch_compile():
    """The check reads no values inside a compiled graph (fullgraph: a graph break would fail)."""
    from gdn2.inputs import check_token_ids

    def embed(tokens):
        check_token_ids(tokens, 16, "torch", torch_layer._token_range)
        return tokens * 2

    tokens = ids("torch", np.array([[1, 2, 3, 15]]))
    compiled = torch.compile(embed, backend="eager", fullgraph=True)
    assert compiled(tokens).tolist() == [[2, 4, 6, 30]]
    with pytest.raises(ValueError, match="received min 2, max 16"):  # outside the graph, still checked
        embed(tokens + 1)


def test_token_check_under_mx_compile():
    model = language_model("mlx")
    tokens = ids("mlx", np.array([[1, 2, 3, 15]]))
    compiled = mx.compile(lambda t: model(t))
    np.testing.assert_allclose(np.array(compiled(tokens)), np.array(model(tokens)), rtol=1e-6, atol=1e-6)


# ---- the layer: T = 0, types, devices, a cache of another batch ----


def mixer(framework):
    layer = module(framework).GatedDeltaNet2(hidden_size=8, head_dim=4, num_heads=2, chunk_size=4)
    return layer if framework == "mlx" else layer.eval()


def hidden(framework, shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return torch.tensor(x) if framework == "torch" else mx.array(x)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_layer_input_with_no_tokens(framework):
    layer = mixer(framework)
    for shape in ([2, 0, 8], [0, 3, 8]):
        with pytest.raises(ValueError) as error:
            layer(hidden(framework, shape))
        assert str(error.value) == f"hidden_states: expected at least one token (B >= 1 and T >= 1), received shape {shape}"
        with pytest.raises(ValueError, match=r"hidden_states: expected at least one token"):
            layer(hidden(framework, shape), cache=module(framework).GDN2Cache())


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_layer_inputs_of_another_type(framework):
    layer = mixer(framework)
    x = hidden(framework, [2, 5, 8])
    with pytest.raises(ValueError, match=rf"^hidden_states: expected {TYPE[framework]}, received numpy.ndarray$"):
        layer(np.zeros((2, 5, 8), np.float32))
    with pytest.raises(ValueError, match=rf"^attention_mask: expected {TYPE[framework]}, received numpy.ndarray$"):
        layer(x, attention_mask=np.ones((2, 5), np.int64))
    other = hidden("mlx" if framework == "torch" else "torch", [2, 5, 8])
    with pytest.raises(ValueError, match=rf"^hidden_states: expected {TYPE[framework]}, received {TYPE['mlx' if framework == 'torch' else 'torch']}$"):
        layer(other)


def test_layer_inputs_on_mixed_devices():
    layer = mixer("torch")
    x = hidden("torch", [1, 5, 8])
    with pytest.raises(ValueError, match=r"^attention_mask: expected a tensor on cpu \(the device of hidden_states\), received one on meta$"):
        layer(x, attention_mask=torch.ones(1, 5, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected a tensor on cpu \(the device of hidden_states\), received one on meta$"):
        layer(x, cu_seqlens=torch.tensor([0, 2, 5], device="meta"))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_cache_reused_with_another_batch_size(framework):
    layer = mixer(framework)
    cache = module(framework).GDN2Cache()
    with torch.no_grad():
        layer(hidden(framework, [2, 5, 8]), cache=cache)
        for B, step in ((3, 1), (1, 4)):
            with pytest.raises(ValueError) as error:
                layer(hidden(framework, [B, step, 8]), cache=cache)
            assert str(error.value) == (
                f"cache: expected hidden_states of the 2 sequences it holds (B=2), received B={B} (a new batch needs a new cache)"
            )
        assert cache.offset == 5  # refused calls leave the cache as it was
        layer(hidden(framework, [2, 1, 8]), cache=cache)
    assert cache.offset == 6


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_language_model_cache_with_another_batch_size(framework):
    model = language_model(framework)
    cache = model.make_cache()
    with torch.no_grad():
        model(ids(framework, np.ones((2, 3), np.int64)), cache)
        with pytest.raises(ValueError, match=r"^cache: expected hidden_states of the 2 sequences it holds \(B=2\), received B=1"):
            model(ids(framework, np.ones((1, 1), np.int64)), cache)


def test_layer_takes_parsed_offsets_as_well():
    from gdn2.spec import parse_cu_seqlens

    layer = mixer("torch")
    x = hidden("torch", [1, 5, 8])
    offsets = torch.tensor([0, 2, 5])
    with torch.no_grad():
        expected = layer(x, cu_seqlens=offsets)
        np.testing.assert_array_equal(layer(x, cu_seqlens=parse_cu_seqlens(offsets, 1, 5)).numpy(), expected.numpy())


def test_public_entries_name_an_array_of_the_other_library():
    """q of the wrong library through the public entry points (not only validate itself)."""
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("mlx.core")
    from gdn2.mlx import chunk_gdn2 as mlx_chunk_gdn2
    from gdn2.torch import chunk_gdn2 as torch_chunk_gdn2

    x = [torch.randn(1, 4, 1, 8) for _ in range(6)]
    with pytest.raises(ValueError, match=r"q: expected torch.Tensor, received numpy.ndarray"):
        torch_chunk_gdn2(np.zeros((1, 4, 1, 8), dtype=np.float32), *x[1:])
    with pytest.raises(ValueError, match=r"q: expected mlx.core.array, received torch.Tensor"):
        mlx_chunk_gdn2(*x)
    assert mx is not None
