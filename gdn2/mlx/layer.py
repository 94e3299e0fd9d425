"""The GDN-2 token mixer, its inference cache, and a small causal language model, in MLX.

The same model as ``gdn2.torch.layer`` (see there and ``GatedDeltaNet2`` below for the equations),
with the same parameter names and shapes, so safetensors files move between the two frameworks
unchanged. Two MLX-specific choices keep the names identical:

- ``f_proj`` and ``g_proj`` are plain lists of two ``nn.Linear`` (MLX names them ``f_proj.0``,
  ``f_proj.1`` like PyTorch's ``nn.Sequential``; ``nn.Sequential`` in MLX would add ``layers.``).
- ``ShortConvolution`` stores PyTorch's depthwise ``Conv1d`` weight ``[channels, 1, kernel_size]``
  and computes the causal convolution as a sum of ``kernel_size`` shifted products.

Shapes: ``hidden_states`` ``[B, T, hidden_size]``; recurrent state ``[B, num_v_heads, K, V]``
float32; convolution state of each of q, k, v ``[B, conv_size - 1, channels]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..inputs import check_cache_batch, check_hidden_states, check_token_ids
from ..spec import parse_cu_seqlens
from ..weights import ModelConfig, check_mixer_sizes, check_names, initial_weights, load_numpy, save_numpy
from .ops import chunk_gdn2, recurrent_gdn2

__all__ = [
    "GDN2Cache",
    "ShortConvolution",
    "GatedRMSNorm",
    "GatedDeltaNet2",
    "GatedMLP",
    "GDN2Block",
    "GDN2LanguageModel",
    "save_weights",
    "load_weights",
    "load_model",
    "init_weights",
    "numpy_weights",
    "set_numpy_weights",
]


@dataclass
class GDN2Cache:
    """What one ``GatedDeltaNet2`` carries from one call to the next during inference.

    ``conv_state``: ``(q, k, v)`` convolution states, each ``[B, conv_size - 1, channels]``, or
    None before the first call. ``recurrent_state``: ``[B, num_v_heads, K, V]`` float32 or None.
    ``offset``: tokens seen so far.
    """

    conv_state: tuple[mx.array, mx.array, mx.array] | None = None
    recurrent_state: mx.array | None = None
    offset: int = 0


class ShortConvolution(nn.Module):
    """Causal depthwise convolution over time followed by SiLU.

    Weight ``[channels, 1, kernel_size]`` (PyTorch's layout); ``__call__(x [B, T, D], state)``
    returns ``(y [B, T, D], new_state [B, kernel_size - 1, D])``.
    """

    def __init__(self, hidden_size: int, kernel_size: int = 4, bias: bool = False):
        super().__init__()
        self.hidden_size, self.kernel_size = hidden_size, kernel_size
        bound = 1.0 / math.sqrt(kernel_size)
        self.weight = mx.random.uniform(-bound, bound, (hidden_size, 1, kernel_size))
        if bias:
            self.bias = mx.random.uniform(-bound, bound, (hidden_size,))

    def __call__(
        self, x: mx.array, state: mx.array | None = None, positions: np.ndarray | None = None
    ) -> tuple[mx.array, mx.array]:
        """``positions`` ``[T]``: each token's index inside its packed sequence; a tap that would
        reach back past the start of the token's sequence is left out (no leak across sequences)."""
        B, T, D = x.shape
        width = self.kernel_size
        if state is None:
            state = mx.zeros((B, width - 1, D), dtype=x.dtype)
        joined = mx.concatenate([state.astype(x.dtype), x], axis=1)  # [B, width - 1 + T, D]
        taps = self.weight[:, 0, :]  # [D, width]; tap i multiplies the input width - 1 - i steps back
        y = 0
        for i in range(width):
            term = joined[:, i : i + T] * taps[:, i]
            if positions is not None:
                term = term * mx.array(positions >= width - 1 - i, dtype=x.dtype)[:, None]
            y = y + term
        if "bias" in self:
            y = y + self.bias
        return nn.silu(y), joined[:, joined.shape[1] - (width - 1) :]


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dimension (fla's FusedRMSNormGated)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((hidden_size,))

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        dtype = x.dtype
        x = x.astype(mx.float32)
        x = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.weight.astype(mx.float32)
        return (x * mx.sigmoid(gate.astype(mx.float32))).astype(dtype)


def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (fla's l2norm)."""
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + eps)


class GatedDeltaNet2(nn.Module):
    """Gated DeltaNet-2 token mixer: ``[B, T, hidden_size] -> [B, T, hidden_size]`` (MLX).

    Same equations, arguments, parameter names and shapes as ``gdn2.torch.layer.GatedDeltaNet2``::

        q, k, v = silu(conv(q_proj(x))), silu(conv(k_proj(x))), silu(conv(v_proj(x)))
        g = -exp(A_log) * softplus(f_proj(x) + dt_bias)       per-channel log decay [H, K]
        b = sigmoid(b_proj(x))  (x 2 if allow_neg_eigval)       erase gate [H, K]
        w = sigmoid(w_proj(x))                                 write gate [HV, V]
        o = GDN-2(l2norm(q), l2norm(k), v, g, b, w)            [HV, V]
        out = o_proj(rmsnorm(o) * o_norm.weight * sigmoid(g_proj(x)))
    """

    # gdn2.context_parallel: a ContextParallel of the framework (its ``apply(model)`` sets it) makes
    # each call run this rank's segment of a sequence split along T across ranks (no mask, no cache).
    context_parallel = None

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1.0,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
        path: str | None = None,
    ):
        super().__init__()
        self.num_v_heads, self.head_v_dim, self.groups = check_mixer_sizes(
            hidden_size, expand_v, head_dim, num_heads, num_v_heads, conv_size
        )
        self.hidden_size, self.expand_v, self.head_dim, self.num_heads = hidden_size, expand_v, head_dim, num_heads
        self.use_short_conv, self.allow_neg_eigval = use_short_conv, allow_neg_eigval
        self.conv_size, self.conv_bias, self.norm_eps = conv_size, conv_bias, norm_eps
        self.layer_idx, self.chunk_size, self.path = layer_idx, chunk_size, path
        self.key_dim = num_heads * head_dim
        self.value_dim = self.num_v_heads * self.head_v_dim

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, conv_bias)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, conv_bias)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, conv_bias)
        self.f_proj = [
            nn.Linear(hidden_size, self.head_v_dim, bias=False),
            nn.Linear(self.head_v_dim, self.key_dim, bias=False),
        ]
        self.b_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.w_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.A_log = mx.log(mx.random.uniform(1.0, 16.0, (num_heads,)))
        dt = mx.maximum(mx.exp(mx.random.uniform(math.log(1e-3), math.log(0.1), (self.key_dim,))), 1e-4)
        self.dt_bias = dt + mx.log(-mx.expm1(-dt))
        self.g_proj = [
            nn.Linear(hidden_size, self.head_v_dim, bias=False),
            nn.Linear(self.head_v_dim, self.value_dim, bias=True),
        ]
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def __call__(
        self,
        hidden_states: mx.array,
        attention_mask: mx.array | None = None,
        cache: GDN2Cache | None = None,
        cu_seqlens=None,
    ) -> mx.array:
        """``hidden_states [B, T, hidden_size] -> [B, T, hidden_size]``.

        With ``cache``, the call continues the sequence the cache holds and updates it in place.
        ``attention_mask`` ``[B, T]`` (1 = token, 0 = padding; left or right padding) and
        ``cu_seqlens`` ``[N + 1]`` (B = 1, packed sequences) behave as in ``gdn2.torch``'s layer.
        """
        B, T = check_hidden_states(hidden_states, self.hidden_size, "mlx", attention_mask=attention_mask, cu_seqlens=cu_seqlens)
        if cache is not None:
            check_cache_batch(cache, B)
        mask = padding_mask(attention_mask, B, T, cache)
        if cu_seqlens is not None and cache is not None:
            raise ValueError("cache: not supported with cu_seqlens (packed sequences); pass one or the other")
        cp = self.context_parallel  # None, or this rank's segment of a sequence split across ranks
        if cp is None:
            sequences = None if cu_seqlens is None else parse_cu_seqlens(cu_seqlens, B, T)  # read once
        else:  # the offsets are the whole split sequence's; positions inside its sequences
            sequences = None if cu_seqlens is None else cp.segment(cu_seqlens, hidden_states)
        positions = None if sequences is None else sequences.positions()
        # Padding may hold anything (NaN from an earlier layer): selected away, not multiplied by 0.
        x = hidden_states if mask is None else mx.where(mask[..., None], hidden_states, 0.0)
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim
        f32 = mx.float32

        if cp is not None:  # the short convolutions' left context: the previous rank's last inputs
            x, conv_states = cp.conv_context(self, x, attention_mask, cache)
        if self.use_short_conv:
            conv_q, conv_k, conv_v = conv_states if cp is not None else (
                cache.conv_state if cache is not None and cache.conv_state else (None,) * 3)
            masked = (lambda y: y) if mask is None else (lambda y: y * mask[..., None].astype(y.dtype))
            q, conv_q = self.q_conv1d(masked(self.q_proj(x)), conv_q, positions)
            k, conv_k = self.k_conv1d(masked(self.k_proj(x)), conv_k, positions)
            v, conv_v = self.v_conv1d(masked(self.v_proj(x)), conv_v, positions)
        else:
            q, k, v = nn.silu(self.q_proj(x)), nn.silu(self.k_proj(x)), nn.silu(self.v_proj(x))

        decay_logits = self.f_proj[1](self.f_proj[0](x)).astype(f32)
        g = nn.softplus(decay_logits + self.dt_bias.astype(f32)).reshape(B, T, H, K)
        g = -mx.exp(self.A_log.astype(f32))[:, None] * g
        b = mx.sigmoid(self.b_proj(x).astype(f32)).reshape(B, T, H, K)
        if self.allow_neg_eigval:
            b = b * 2.0
        w = mx.sigmoid(self.w_proj(x).astype(f32)).reshape(B, T, HV, V)
        q = l2_normalize(q.astype(f32).reshape(B, T, H, K))
        k = l2_normalize(k.astype(f32).reshape(B, T, H, K))
        v = v.astype(f32).reshape(B, T, HV, V)
        if self.groups > 1:
            q, k, g, b = (mx.repeat(t, self.groups, axis=2) for t in (q, k, g, b))
        if mask is not None:
            # A padding step with k = 0 and g = 0 leaves the state exactly as it was.
            step = mask[:, :, None, None].astype(f32)
            k, g = k * step, g * step

        state = None if cache is None else cache.recurrent_state
        if cache is not None and T == 1 and state is not None:
            o, state = recurrent_gdn2(q, k, v, g, b, w, initial_state=state, output_final_state=True)
        else:
            o, state = (chunk_gdn2 if cp is None else cp.gdn2)(
                q, k, v, g, b, w, initial_state=state, output_final_state=cache is not None,
                chunk_size=self.chunk_size, path=self.path, cu_seqlens=sequences,
            )
        if cache is not None:
            cache.recurrent_state = state
            cache.conv_state = (conv_q, conv_k, conv_v) if self.use_short_conv else None
            cache.offset += T

        gate = self.g_proj[1](self.g_proj[0](x)).reshape(B, T, HV, V)
        o = self.o_norm(o, gate).reshape(B, T, HV * V).astype(hidden_states.dtype)
        o = self.o_proj(o)
        return o if mask is None else o * mask[..., None].astype(o.dtype)


def padding_mask(attention_mask, B: int, T: int, cache) -> mx.array | None:
    """Check a ``[B, T]`` 0/1 padding mask; return it as a bool array (None: no padding)."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != (B, T):
        raise ValueError(f"attention_mask: expected shape [B, T] = {[B, T]}, received {list(attention_mask.shape)}")
    if not mx.all((attention_mask == 0) | (attention_mask == 1)).item():
        raise ValueError("attention_mask: expected 0/1 values (1 = token, 0 = padding), received other values")
    mask = attention_mask.astype(mx.bool_)
    if cache is not None and not mx.all(mask).item() and (cache.offset > 0 or not mx.all(mask[:, -1]).item()):
        # The convolution state would hold padding: right padding, or padding after cached tokens.
        raise ValueError(
            "attention_mask: with a cache, padding is supported on the first call and on the left only "
            "(the usual layout for batched generation)"
        )
    return mask


class GatedMLP(nn.Module):
    """SwiGLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class GDN2Block(nn.Module):
    """Pre-norm residual block: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GatedDeltaNet2(**config.mixer_kwargs(), layer_idx=layer_idx)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def __call__(self, x: mx.array, cache: GDN2Cache | None = None) -> mx.array:
        x = x + self.attn(self.attn_norm(x), cache=cache)
        return x + self.mlp(self.mlp_norm(x))


class GDN2LanguageModel(nn.Module):
    """Causal language model: embeddings, ``num_layers`` GDN-2 blocks, RMSNorm, linear head.

    ``model(input_ids [B, T] integer, cache=None) -> logits [B, T, vocab_size]``. For generation,
    ``cache = model.make_cache()`` and call with successive pieces of the sequence.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [GDN2Block(config, i) for i in range(config.num_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def make_cache(self) -> list[GDN2Cache]:
        """A fresh, empty cache: one ``GDN2Cache`` per block."""
        return [GDN2Cache() for _ in self.layers]

    def __call__(self, input_ids: mx.array, cache: list[GDN2Cache] | None = None) -> mx.array:
        check_token_ids(input_ids, self.config.vocab_size, "mlx", _token_range)
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache: expected {len(self.layers)} entries (one per layer), received {len(cache)}")
        x = self.embeddings(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, None if cache is None else cache[i])
        return self.lm_head(self.norm(x))


def _token_range(input_ids: mx.array) -> tuple[int, int] | None:
    """``(min, max)`` of the ids (one evaluation). Inside ``mx.compile`` or ``mx.vmap`` values
    cannot be read: the check is skipped there (MLX raises ValueError on the read)."""
    try:
        return mx.min(input_ids).item(), mx.max(input_ids).item()
    except ValueError:
        return None


# ---- weights: numpy in, numpy out, safetensors on disk (shared format with gdn2.torch.layer) ----


def numpy_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter as a float32 numpy array, by its (framework-independent) name."""
    return {name: np.array(p.astype(mx.float32)) for name, p in tree_flatten(model.parameters())}


def set_numpy_weights(model: nn.Module, arrays: dict[str, np.ndarray], source: str = "weights") -> None:
    """Copy ``{name: array}`` into the model's parameters (names and shapes must match exactly)."""
    params = dict(tree_flatten(model.parameters()))
    check_names({name: tuple(p.shape) for name, p in params.items()}, arrays, source)
    model.update(tree_unflatten([(name, mx.array(np.asarray(arrays[name])).astype(p.dtype)) for name, p in params.items()]))
    mx.eval(model.parameters())


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Set the framework-independent initial weights of ``gdn2.weights.initial_weights``."""
    shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    set_numpy_weights(model, initial_weights(shapes, seed), f"initial weights (seed {seed})")
    return model


def save_weights(model: nn.Module, path) -> None:
    """Write the model's parameters as safetensors (readable by ``gdn2.torch.layer.load_weights``)."""
    save_numpy(numpy_weights(model), path, getattr(model, "config", None))


def load_weights(model: nn.Module, path) -> nn.Module:
    """Load a safetensors file written by either framework's ``save_weights``."""
    arrays, _ = load_numpy(path)
    set_numpy_weights(model, arrays, str(path))
    return model


def load_model(path) -> GDN2LanguageModel:
    """Build a ``GDN2LanguageModel`` from the config stored in a checkpoint and load its weights."""
    arrays, config = load_numpy(path)
    if config is None:
        raise ValueError(f"path: {path} holds no gdn2 model config (write it with save_weights of a GDN2LanguageModel)")
    model = GDN2LanguageModel(config)
    set_numpy_weights(model, arrays, str(path))
    return model
