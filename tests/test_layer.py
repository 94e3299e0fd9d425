"""The GatedDeltaNet2 layer and the small language model in PyTorch and MLX.

Checked: the layer against an independent float64 numpy version built on ``gdn2.spec``; the two
frameworks against each other on the same weights; gradients through the chunk path against the
reference path; the inference cache (prefill then token by token) against one full forward;
safetensors weights written by one framework and read by the other, both ways.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core")
pytest.importorskip("safetensors")

from mlx.utils import tree_flatten  # noqa: E402

from gdn2 import spec  # noqa: E402
from gdn2.mlx import layer as mlx_layer  # noqa: E402
from gdn2.torch import layer as torch_layer  # noqa: E402
from gdn2.weights import ModelConfig, initial_weights  # noqa: E402

# Small mixers covering grouped value heads, expand_v, negative eigenvalues, conv bias, no conv.
MIXERS = {
    "plain": dict(hidden_size=32, head_dim=8, num_heads=2),
    "grouped": dict(hidden_size=24, head_dim=8, num_heads=2, num_v_heads=4, expand_v=0.5, allow_neg_eigval=True, conv_bias=True),
    "no_conv": dict(hidden_size=16, head_dim=8, num_heads=2, expand_v=2.0, use_short_conv=False),
}
TINY_MODEL = dict(vocab_size=37, hidden_size=32, num_layers=2, num_heads=2, head_dim=8, num_v_heads=4, chunk_size=8)


def mixer_pair(kwargs: dict, seed: int, chunk_size: int = 8):
    """The same mixer in both frameworks, with the same (random, seeded) weights."""
    t = torch_layer.GatedDeltaNet2(**kwargs, chunk_size=chunk_size)
    m = mlx_layer.GatedDeltaNet2(**kwargs, chunk_size=chunk_size)
    shapes = {name: tuple(p.shape) for name, p in t.named_parameters()}
    weights = initial_weights(shapes, seed)
    # Random (not initial) values for the norm weight and the gate bias so that they matter.
    rng = np.random.default_rng(seed)
    for name in weights:
        if name.endswith(("o_norm.weight", ".bias")):
            weights[name] = rng.uniform(0.5, 1.5, weights[name].shape).astype(np.float32)
    torch_layer.set_numpy_weights(t, weights)
    mlx_layer.set_numpy_weights(m, weights)
    return t, m, weights


def numpy_mixer(weights: dict, x: np.ndarray, kwargs: dict) -> np.ndarray:
    """The GDN-2 mixer in float64 numpy, written from the equations and ``spec.reference_forward``."""
    x = x.astype(np.float64)
    W = {name: value.astype(np.float64) for name, value in weights.items()}
    B, T, _ = x.shape
    H, K = kwargs["num_heads"], kwargs["head_dim"]
    HV = kwargs.get("num_v_heads") or H
    V = int(K * kwargs.get("expand_v", 1.0))

    def linear(name, inp):
        out = inp @ W[f"{name}.weight"].T
        return out + W[f"{name}.bias"] if f"{name}.bias" in W else out

    def silu(z):
        return z / (1 + np.exp(-z))

    def sigmoid(z):
        return 1 / (1 + np.exp(-z))

    def conv(name, inp):
        if not kwargs.get("use_short_conv", True):
            return silu(inp)
        weight = W[f"{name}.weight"][:, 0, :]  # [D, width]
        width = weight.shape[1]
        padded = np.concatenate([np.zeros((B, width - 1, inp.shape[2])), inp], axis=1)
        out = sum(padded[:, i : i + T] * weight[:, i] for i in range(width))
        return silu(out + W[f"{name}.bias"] if f"{name}.bias" in W else out)

    q = conv("q_conv1d", linear("q_proj", x)).reshape(B, T, H, K)
    k = conv("k_conv1d", linear("k_proj", x)).reshape(B, T, H, K)
    v = conv("v_conv1d", linear("v_proj", x)).reshape(B, T, HV, V)
    f = linear("f_proj.1", linear("f_proj.0", x)) + W["dt_bias"]
    g = (-np.exp(W["A_log"])[:, None] * np.log1p(np.exp(f)).reshape(B, T, H, K))
    b = sigmoid(linear("b_proj", x)).reshape(B, T, H, K) * (2.0 if kwargs.get("allow_neg_eigval") else 1.0)
    w = sigmoid(linear("w_proj", x)).reshape(B, T, HV, V)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    groups = HV // H
    q, k, g, b = (np.repeat(a, groups, axis=2) for a in (q, k, g, b))
    o, _ = spec.reference_forward(q, k, v, g, b, w)
    gate = linear("g_proj.1", linear("g_proj.0", x)).reshape(B, T, HV, V)
    eps = kwargs.get("norm_eps", 1e-5)
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * W["o_norm.weight"] * sigmoid(gate)
    return linear("o_proj", o.reshape(B, T, HV * V))


def torch_names(module) -> dict:
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def mlx_names(module) -> dict:
    return {name: tuple(p.shape) for name, p in tree_flatten(module.parameters())}


@pytest.mark.parametrize("kind", list(MIXERS))
def test_parameter_names_and_shapes_match_across_frameworks(kind):
    kwargs = MIXERS[kind]
    t, m = torch_layer.GatedDeltaNet2(**kwargs), mlx_layer.GatedDeltaNet2(**kwargs)
    assert torch_names(t) == mlx_names(m)
    names = set(torch_names(t))
    expected = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "f_proj.0.weight", "f_proj.1.weight",
                "b_proj.weight", "w_proj.weight", "A_log", "dt_bias", "g_proj.0.weight", "g_proj.1.weight",
                "g_proj.1.bias", "o_norm.weight", "o_proj.weight"}
    assert expected <= names
    if kwargs.get("use_short_conv", True):
        K = kwargs["num_heads"] * kwargs["head_dim"]
        assert torch_names(t)["q_conv1d.weight"] == (K, 1, 4)
    lm_t, lm_m = torch_layer.GDN2LanguageModel(ModelConfig(**TINY_MODEL)), mlx_layer.GDN2LanguageModel(ModelConfig(**TINY_MODEL))
    assert torch_names(lm_t) == mlx_names(lm_m)


@pytest.mark.parametrize("kind", list(MIXERS))
def test_mixer_matches_float64_numpy_and_other_framework(kind, seed):
    kwargs = MIXERS[kind]
    t, m, weights = mixer_pair(kwargs, seed)
    x = np.random.default_rng(seed).standard_normal((2, 21, kwargs["hidden_size"])).astype(np.float32)
    expected = numpy_mixer(weights, x, kwargs)
    with torch.no_grad():
        out_torch = t(torch.from_numpy(x)).numpy()
    out_mlx = np.array(m(mx.array(x)))
    assert out_torch.shape == out_mlx.shape == x.shape
    assert np.abs(expected).max() > 1e-3, "degenerate test: output near zero"
    assert spec.relative_error(out_torch, expected) < 1e-5
    assert spec.relative_error(out_mlx, expected) < 1e-5
    np.testing.assert_allclose(out_torch, out_mlx, rtol=1e-4, atol=1e-5)


def test_torch_gradients_chunk_path_match_reference_path(seed):
    kwargs = MIXERS["grouped"]
    chunked, _, weights = mixer_pair(kwargs, seed)
    reference = torch_layer.GatedDeltaNet2(**kwargs, path="reference")
    torch_layer.set_numpy_weights(reference, weights)
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((2, 19, kwargs["hidden_size"])).astype(np.float32))
    d_out = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal((2, 19, kwargs["hidden_size"])).astype(np.float32))
    grads = []
    for module in (chunked, reference):
        x_in = x.clone().requires_grad_(True)
        (module(x_in) * d_out).sum().backward()
        grads.append({"x": x_in.grad, **{n: p.grad for n, p in module.named_parameters()}})
    for name, grad in grads[0].items():
        assert grad is not None and torch.isfinite(grad).all(), name
        assert grad.abs().max() > 0, f"{name}: zero gradient"
        assert spec.relative_error(grad.numpy(), grads[1][name].numpy()) < 1e-4, name


def test_mlx_gradients_match_torch(seed):
    kwargs = MIXERS["grouped"]
    t, m, _ = mixer_pair(kwargs, seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 19, kwargs["hidden_size"])).astype(np.float32)
    d_out = rng.standard_normal((2, 19, kwargs["hidden_size"])).astype(np.float32)
    x_t = torch.from_numpy(x).requires_grad_(True)
    (t(x_t) * torch.from_numpy(d_out)).sum().backward()

    import mlx.nn as nn

    def loss(module, inp):
        return (module(inp) * mx.array(d_out)).sum()

    _, grads = nn.value_and_grad(m, loss)(m, mx.array(x))
    mlx_grads = dict(tree_flatten(grads))
    for name, p in t.named_parameters():
        assert np.isfinite(np.array(mlx_grads[name])).all(), name
        assert spec.relative_error(np.array(mlx_grads[name]), p.grad.numpy()) < 1e-4, name
    grad_x = mx.grad(lambda inp: loss(m, inp))(mx.array(x))
    assert spec.relative_error(np.array(grad_x), x_t.grad.numpy()) < 1e-4


def _pieces(rng: np.random.Generator, T: int) -> list[tuple[int, int]]:
    """A random prefill length, then single tokens, then a random multi-token piece."""
    prefill = int(rng.integers(1, T // 2))
    middle = int(rng.integers(prefill + 1, T - 2))
    return [(0, prefill)] + [(t, t + 1) for t in range(prefill, middle)] + [(middle, T)]


def test_cache_token_by_token_equals_full_forward_torch(seed):
    rng = np.random.default_rng(seed)
    model = torch_layer.init_weights(torch_layer.GDN2LanguageModel(ModelConfig(**TINY_MODEL)), seed)
    tokens = torch.from_numpy(rng.integers(0, TINY_MODEL["vocab_size"], (2, 29)))
    with torch.no_grad():
        full = model(tokens).numpy()
        cache = model.make_cache()
        pieces = [model(tokens[:, a:b], cache).numpy() for a, b in _pieces(rng, 29)]
    assert cache[0].offset == 29 and cache[0].recurrent_state.shape == (2, 4, 8, 8)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-4, atol=2e-5)


def test_cache_token_by_token_equals_full_forward_mlx(seed):
    rng = np.random.default_rng(seed)
    model = mlx_layer.init_weights(mlx_layer.GDN2LanguageModel(ModelConfig(**TINY_MODEL)), seed)
    tokens = mx.array(rng.integers(0, TINY_MODEL["vocab_size"], (2, 29)))
    full = np.array(model(tokens))
    cache = model.make_cache()
    pieces = [np.array(model(tokens[:, a:b], cache)) for a, b in _pieces(rng, 29)]
    assert cache[1].offset == 29 and tuple(cache[1].recurrent_state.shape) == (2, 4, 8, 8)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_mixer_cache_without_short_conv(framework, seed):
    kwargs = MIXERS["no_conv"]
    t, m, _ = mixer_pair(kwargs, seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 12, kwargs["hidden_size"])).astype(np.float32)
    if framework == "torch":
        run = lambda a, c=None: t(torch.from_numpy(np.ascontiguousarray(a)), cache=c).detach().numpy()  # noqa: E731
        cache = torch_layer.GDN2Cache()
    else:
        run = lambda a, c=None: np.array(m(mx.array(a), cache=c))  # noqa: E731
        cache = mlx_layer.GDN2Cache()
    full = run(x)
    stepped = np.concatenate([run(x[:, i : i + 1], cache) for i in range(12)], axis=1)
    np.testing.assert_allclose(stepped, full, rtol=1e-4, atol=2e-5)


def test_weights_torch_to_mlx_and_back(tmp_path, seed):
    config = ModelConfig(**TINY_MODEL)
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (3, 23))
    # Each model starts from its own framework's random init: equal logits prove the load.
    torch.manual_seed(seed)
    mx.random.seed(seed + 1)
    torch_model, mlx_model = torch_layer.GDN2LanguageModel(config), mlx_layer.GDN2LanguageModel(config)
    with torch.no_grad():
        torch_logits = torch_model(torch.from_numpy(tokens)).numpy()
    assert not np.allclose(np.array(mlx_model(mx.array(tokens))), torch_logits, atol=1e-3)

    torch_layer.save_weights(torch_model, tmp_path / "from_torch.safetensors")
    mlx_layer.load_weights(mlx_model, tmp_path / "from_torch.safetensors")
    np.testing.assert_allclose(np.array(mlx_model(mx.array(tokens))), torch_logits, rtol=1e-4, atol=1e-5)

    # mlx -> torch: new MLX weights, into a fresh torch model.
    mx.random.seed(seed + 2)
    mlx_model = mlx_layer.GDN2LanguageModel(config)
    mlx_logits = np.array(mlx_model(mx.array(tokens)))
    mlx_layer.save_weights(mlx_model, tmp_path / "from_mlx.safetensors")
    loaded = torch_layer.load_model(tmp_path / "from_mlx.safetensors")  # config from the file
    with torch.no_grad():
        np.testing.assert_allclose(loaded(torch.from_numpy(tokens)).numpy(), mlx_logits, rtol=1e-4, atol=1e-5)
    assert loaded.config == config


def test_load_into_wrong_model_names_the_parameter(tmp_path):
    torch_layer.save_weights(torch_layer.GDN2LanguageModel(ModelConfig(**TINY_MODEL)), tmp_path / "w.safetensors")
    other = mlx_layer.GDN2LanguageModel(ModelConfig(**{**TINY_MODEL, "num_layers": 1, "hidden_size": 16}))
    with pytest.raises(ValueError, match="unexpected.*layers.1|wrong shapes: embeddings.weight"):
        mlx_layer.load_weights(other, tmp_path / "w.safetensors")


@pytest.mark.parametrize("module", [torch_layer, mlx_layer], ids=["torch", "mlx"])
def test_bad_arguments_raise_clear_errors(module):
    with pytest.raises(ValueError, match="num_v_heads"):
        module.GatedDeltaNet2(hidden_size=16, head_dim=8, num_heads=2, num_v_heads=3)
    with pytest.raises(ValueError, match="expand_v"):
        module.GatedDeltaNet2(hidden_size=16, head_dim=8, num_heads=2, expand_v=0.3)
    layer = module.GatedDeltaNet2(hidden_size=16, head_dim=8, num_heads=2)
    x = np.ones((1, 3, 16), np.float32)
    array = torch.from_numpy(x) if module is torch_layer else mx.array(x)
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \[B, T\] = \[1, 3\], received \[3, 16\]"):
        layer(array, attention_mask=array[0])
    with pytest.raises(ValueError, match="attention_mask: expected 0/1 values"):
        layer(array, attention_mask=array[..., 0] * 2)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(array[..., :8])
