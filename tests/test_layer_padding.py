"""The layer with padding masks and packed sequences: the same outputs as each sequence alone."""

from __future__ import annotations

import numpy as np
import pytest
from test_layer import MIXERS, mixer_pair

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core")


def run(layer, framework, x, **kwargs):
    if framework == "torch":
        kwargs = {k: (torch.tensor(v) if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
        with torch.no_grad():
            return layer(torch.tensor(x), **kwargs).double().numpy()
    kwargs = {k: (mx.array(v) if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
    return np.array(layer(mx.array(x), **kwargs)).astype(np.float64)


def close(a, b, tolerance=1e-5):
    return np.linalg.norm(a - b) <= tolerance * max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("framework", ["torch", "mlx"])
@pytest.mark.parametrize("mixer", ["plain", "grouped"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_equals_each_sequence_alone(framework, mixer, side, seed):
    layers = dict(zip(["torch", "mlx"], mixer_pair(MIXERS[mixer], seed)[:2]))
    rng = np.random.default_rng(seed)
    B, T, hidden = 3, 19, MIXERS[mixer]["hidden_size"]
    lengths = [T, 1, int(rng.integers(2, T))]
    x = rng.standard_normal((B, T, hidden)).astype(np.float32)
    mask = np.zeros((B, T), dtype=np.int64)
    for row, length in enumerate(lengths):
        tokens = slice(T - length, T) if side == "left" else slice(0, length)
        mask[row, tokens] = 1
    padded = run(layers[framework], framework, x, attention_mask=mask)
    for row, length in enumerate(lengths):
        tokens = slice(T - length, T) if side == "left" else slice(0, length)
        alone = run(layers[framework], framework, x[row : row + 1, tokens])
        assert close(padded[row, tokens], alone[0]), (row, length, seed)
        assert np.all(padded[row][mask[row] == 0] == 0)
    other = run(layers["mlx" if framework == "torch" else "torch"], "mlx" if framework == "torch" else "torch", x, attention_mask=mask)
    assert close(other, padded, 1e-4)


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_left_padded_prefill_then_decode(framework, seed):
    """Batched generation: a left-padded prefill with a cache, then token-by-token steps."""
    torch_layer, mlx_layer, _ = mixer_pair(MIXERS["plain"], seed)
    layer = torch_layer if framework == "torch" else mlx_layer
    module = __import__(f"gdn2.{framework}.layer", fromlist=["GDN2Cache"])
    rng = np.random.default_rng(seed)
    T, steps, hidden = 9, 4, MIXERS["plain"]["hidden_size"]
    x = rng.standard_normal((2, T + steps, hidden)).astype(np.float32)
    mask = np.ones((2, T), dtype=np.int64)
    mask[1, :5] = 0  # row 1 has 4 prompt tokens
    cache = module.GDN2Cache()
    outputs = [run(layer, framework, x[:, :T], attention_mask=mask, cache=cache)]
    for t in range(T, T + steps):
        outputs.append(run(layer, framework, x[:, t : t + 1], cache=cache))
    joined = np.concatenate(outputs, axis=1)
    alone = run(layer, framework, np.concatenate([x[1:2, 5:T], x[1:2, T:]], axis=1))
    assert close(joined[1, 5:], alone[0])
    with pytest.raises(ValueError, match="with a cache, padding is supported on the first call and on the left only"):
        right = np.ones((2, T), dtype=np.int64)
        right[0, -2:] = 0
        run(layer, framework, x[:, :T], attention_mask=right, cache=module.GDN2Cache())


@pytest.mark.parametrize("framework", ["torch", "mlx"])
@pytest.mark.parametrize("mixer", ["plain", "grouped", "no_conv"])
def test_packed_sequences_equal_each_sequence_alone(framework, mixer, seed):
    layers = dict(zip(["torch", "mlx"], mixer_pair(MIXERS[mixer], seed)[:2]))
    rng = np.random.default_rng(seed)
    lengths = [1, int(rng.integers(2, 12)), 3, int(rng.integers(2, 20))]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    x = rng.standard_normal((1, int(offsets[-1]), MIXERS[mixer]["hidden_size"])).astype(np.float32)
    packed = run(layers[framework], framework, x, cu_seqlens=offsets)
    for start, end in zip(offsets[:-1], offsets[1:]):
        alone = run(layers[framework], framework, x[:, start:end])
        assert close(packed[:, start:end], alone), (start, end, seed)
    # Nothing leaks across sequences: changing one sequence leaves the others' outputs as they were.
    changed = x.copy()
    changed[:, offsets[1] : offsets[2]] += 1.0
    again = run(layers[framework], framework, changed, cu_seqlens=offsets)
    outside = np.ones(x.shape[1], dtype=bool)
    outside[offsets[1] : offsets[2]] = False
    assert np.array_equal(again[:, outside], packed[:, outside])
    assert not np.allclose(again[:, offsets[1] : offsets[2]], packed[:, offsets[1] : offsets[2]])


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_packed_sequences_reject_a_cache(framework, seed):
    torch_layer, mlx_layer, _ = mixer_pair(MIXERS["plain"], seed)
    module = __import__(f"gdn2.{framework}.layer", fromlist=["GDN2Cache"])
    x = np.random.default_rng(seed).standard_normal((1, 6, MIXERS["plain"]["hidden_size"])).astype(np.float32)
    layer = torch_layer if framework == "torch" else mlx_layer
    with pytest.raises(ValueError, match="cache: not supported with cu_seqlens"):
        run(layer, framework, x, cu_seqlens=np.array([0, 2, 6]), cache=module.GDN2Cache())
    with pytest.raises(ValueError, match="cu_seqlens: expected to end at T=6, received 5"):
        run(layer, framework, x, cu_seqlens=np.array([0, 2, 5]))
