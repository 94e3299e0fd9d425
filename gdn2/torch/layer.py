"""The GDN-2 token mixer, its inference cache, and a small causal language model, in PyTorch.

``GatedDeltaNet2`` follows the GDN-2 reference layer as flash-linear-attention ships it
(``fla/layers/gdn2.py``, adapted there from NVlabs/GatedDeltaNet-2): same constructor arguments,
same parameter names and shapes, same gates. This file is written from that description, not
copied; differences are listed in the class docstring. ``gdn2.mlx.layer`` is the same model in MLX
with the same parameter names and shapes, so a safetensors file written here loads there.

Shapes: ``hidden_states`` ``[B, T, hidden_size]``; per head, keys have ``head_dim`` (K) channels
and values ``head_dim * expand_v`` (V) channels; the recurrent state is ``[B, num_v_heads, K, V]``
float32; the convolution state of each of q, k, v is ``[B, conv_size - 1, channels]`` (the last
inputs, oldest first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import paths
from ..inputs import check_cache_batch, check_hidden_states, check_token_ids
from ..paths import PathChoice
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
    None before the first call (zeros: the sequence starts here). ``recurrent_state``:
    ``[B, num_v_heads, K, V]`` float32 or None. ``offset``: tokens seen so far.
    """

    conv_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    recurrent_state: torch.Tensor | None = None
    offset: int = 0


class ShortConvolution(nn.Conv1d):
    """Causal depthwise convolution over time followed by SiLU (flash-linear-attention's layout).

    Weight ``[channels, 1, kernel_size]``; ``forward(x [B, T, D], state)`` returns ``(y [B, T, D],
    new_state [B, kernel_size - 1, D])`` where ``state`` holds the previous ``kernel_size - 1``
    inputs (None: zeros).
    """

    def __init__(self, hidden_size: int, kernel_size: int = 4, bias: bool = False):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias)
        self.hidden_size = hidden_size

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None = None, positions: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[T]``: each token's index inside its packed sequence; a tap that would
        reach back past the start of the token's sequence is left out (no leak across sequences)."""
        B, T, D = x.shape
        width = self.kernel_size[0]
        if state is None:
            state = x.new_zeros(B, width - 1, D)
        joined = torch.cat([state.to(x.dtype), x], dim=1)  # [B, width - 1 + T, D]
        if positions is None:
            y = F.conv1d(joined.transpose(1, 2), self.weight, self.bias, groups=D).transpose(1, 2)
        else:
            y = 0
            for tap in range(width):  # tap j reads the input width - 1 - j steps back
                inside = torch.as_tensor(positions >= width - 1 - tap, dtype=x.dtype, device=x.device)[:, None]
                y = y + joined[:, tap : tap + T] * self.weight[:, 0, tap] * inside
            if self.bias is not None:
                y = y + self.bias
        return F.silu(y), joined[:, joined.shape[1] - (width - 1) :]


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dimension (fla's FusedRMSNormGated)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (x * torch.sigmoid(gate.float())).to(dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (fla's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# The dtype in which the layer hands q, k, v, b, w to the operator (g is always float32: a log
# decay rounded to 16 bits moves exp(g) by |g| 2^-8). "projections": the projections' dtype (the
# autocast dtype, else the input's), as flash-linear-attention's layer does; they are computed in
# float32 and rounded once, the operator reads them into float32, and its output, the tensors it
# saves and its gradients of them are then that dtype too (bf16: half the bytes). "float32":
# always float32. H200, hidden 2048, 16 heads x 128, B=4 T=4096, bf16 (bench/RESULTS.md):
# "projections" 17.36 ms forward+backward and 3.25 GiB peak, "float32" 19.45 ms and 4.19 GiB.
OPERATOR_INPUT_DTYPE = "projections"


def _linear_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the layer's linear maps compute in on input ``x``: autocast's, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class GatedDeltaNet2(nn.Module):
    """Gated DeltaNet-2 token mixer: ``[B, T, hidden_size] -> [B, T, hidden_size]``.

    Per token, with ``x`` the input::

        q, k, v = silu(conv(q_proj(x))), silu(conv(k_proj(x))), silu(conv(v_proj(x)))
        g = -exp(A_log) * softplus(f_proj(x) + dt_bias)       per-channel log decay [H, K]
        b = sigmoid(b_proj(x))  (x 2 if allow_neg_eigval)       erase gate [H, K]
        w = sigmoid(w_proj(x))                                 write gate [HV, V]
        o = GDN-2(l2norm(q), l2norm(k), v, g, b, w)            [HV, V]
        out = o_proj(rmsnorm(o) * o_norm.weight * sigmoid(g_proj(x)))

    ``f_proj`` and ``g_proj`` are low rank (``hidden -> V -> ...``). With ``num_v_heads`` a
    multiple of ``num_heads`` (grouped value heads), q, k, g, b of each query-key head are shared
    by ``num_v_heads // num_heads`` consecutive value heads.

    Args mirror flash-linear-attention's ``GatedDeltaNet2`` (``hidden_size, expand_v, head_dim,
    num_heads, num_v_heads, use_short_conv, allow_neg_eigval, conv_size, conv_bias, norm_eps``),
    plus ``chunk_size`` and ``path`` passed to ``chunk_gdn2``. Not supported: fla's ``mode`` (the
    path is chosen by ``gdn2.paths``) and ``safe_gate``.

    ``use_kernels`` (an attribute, settable after construction): the steps around the operator
    (short convolutions with SiLU and the q/k L2 normalisation, the gates, the gated output norm)
    run as fused Triton kernels (``gdn2/torch/triton/conv.py``, ``norm.py``, ``gates.py``) with
    tensors kept in the operator's ``[B, T, H, D]`` layout and the seven projections of the input
    as one matrix product, or as the plain PyTorch code of this
    file (the reference and the CPU path). None: automatic, then the ``GDN2_LAYER_KERNELS``
    environment variable (``1`` or ``0``) decides, else the kernels on CUDA; True: the kernels
    (CPU tensors need ``TRITON_INTERPRET=1``), giving way to the plain code with one warning where
    they cannot run; False: the plain code. ``which_glue(hidden_states)`` says which a call takes.
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
        use_kernels: bool | None = None,
    ):
        super().__init__()
        self.num_v_heads, self.head_v_dim, self.groups = check_mixer_sizes(
            hidden_size, expand_v, head_dim, num_heads, num_v_heads, conv_size
        )
        self.hidden_size, self.expand_v, self.head_dim, self.num_heads = hidden_size, expand_v, head_dim, num_heads
        self.use_short_conv, self.allow_neg_eigval = use_short_conv, allow_neg_eigval
        self.conv_size, self.conv_bias, self.norm_eps = conv_size, conv_bias, norm_eps
        self.layer_idx, self.chunk_size, self.path = layer_idx, chunk_size, path
        if use_kernels not in (None, True, False):
            raise ValueError(f"use_kernels: expected None, True or False, received {use_kernels!r}")
        self.use_kernels = use_kernels
        self.key_dim = num_heads * head_dim
        self.value_dim = self.num_v_heads * self.head_v_dim

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, conv_bias)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, conv_bias)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, conv_bias)
        # Low-rank decay projection hidden -> V -> key_dim, as in the reference layer.
        self.f_proj = nn.Sequential(
            nn.Linear(hidden_size, self.head_v_dim, bias=False),
            nn.Linear(self.head_v_dim, self.key_dim, bias=False),
        )
        self.b_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.w_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        # Decay rate per query-key head in [1, 16], softplus bias so that dt starts in [1e-3, 0.1].
        self.A_log = nn.Parameter(torch.log(torch.empty(num_heads).uniform_(1, 16)))
        dt = torch.exp(torch.rand(self.key_dim) * (np.log(0.1) - np.log(0.001)) + np.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(
            nn.Linear(hidden_size, self.head_v_dim, bias=False),
            nn.Linear(self.head_v_dim, self.value_dim, bias=True),
        )
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: GDN2Cache | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden_states [B, T, hidden_size] -> [B, T, hidden_size]``.

        With ``cache``, the call continues the sequence the cache holds and updates it in place;
        calling token by token gives the outputs of one call over the whole sequence.

        ``attention_mask`` ``[B, T]`` (1 = token, 0 = padding; left or right padding): padding
        steps leave the convolution inputs and the recurrent state untouched, so each row's tokens
        get the outputs of that sequence run alone (outputs at padding are zero).
        ``cu_seqlens`` ``[N + 1]`` (B = 1): sequences packed along T; the short convolutions and the
        recurrence restart at each sequence (no cache).
        """
        B, T = check_hidden_states(hidden_states, self.hidden_size, "torch", attention_mask=attention_mask, cu_seqlens=cu_seqlens)
        if cache is not None:
            check_cache_batch(cache, B)
        mask = padding_mask(attention_mask, B, T, hidden_states, cache)
        if cu_seqlens is not None and cache is not None:
            raise ValueError("cache: not supported with cu_seqlens (packed sequences); pass one or the other")
        cp = self.context_parallel  # None, or this rank's segment of a sequence split across ranks
        if cp is None:
            sequences = None if cu_seqlens is None else parse_cu_seqlens(cu_seqlens, B, T)  # read once
        else:  # the offsets are the whole split sequence's; positions inside its sequences
            sequences = None if cu_seqlens is None else cp.segment(cu_seqlens, hidden_states)
        positions = None if sequences is None else sequences.positions()
        # Padding may hold anything (NaN from an earlier layer): selected away, not multiplied by 0.
        x = hidden_states if mask is None else torch.where(mask[..., None], hidden_states, 0.0)
        HV, V = self.num_v_heads, self.head_v_dim
        conv_states = cache.conv_state if cache is not None and cache.conv_state else (None,) * 3
        if cp is not None:  # the short convolutions' left context: the previous rank's last inputs
            x, conv_states = cp.conv_context(self, x, attention_mask, cache)
        keep_conv_states = cache is not None and self.use_short_conv
        fused = self.which_glue(x).path == "kernels"
        if fused:
            from triton.errors import TritonError

            try:
                q, k, v, g, b, w, conv_states, gate_low = self._fused_inputs(
                    x, mask, conv_states, positions, keep_conv_states
                )
            except TritonError as error:  # compilation, resources or the interpreter: the plain code runs
                _glue_failed(error)
                fused = False
        if not fused:
            q, k, v, g, b, w, conv_states = self._plain_inputs(x, mask, conv_states, positions)
            gate_low = None
        if self.groups > 1:
            q, k, g, b = (t.repeat_interleave(self.groups, dim=2) for t in (q, k, g, b))
        if mask is not None:
            # A padding step with k = 0 and g = 0 leaves the state exactly as it was.
            step = mask[:, :, None, None]
            k, g = k * step.to(k.dtype), g * step.to(g.dtype)

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
            cache.conv_state = conv_states if self.use_short_conv else None
            cache.offset += T

        gate = self.g_proj(x) if gate_low is None else self.g_proj[1](gate_low)
        normed = None
        if fused:
            from triton.errors import TritonError

            from .triton.norm import gated_rms_norm

            # Written straight in the dtype o_proj computes in.
            try:
                normed = gated_rms_norm(o, gate, self.o_norm.weight, eps=self.o_norm.eps, out_dtype=_linear_dtype(x))
            except TritonError as error:
                _glue_failed(error)
        if normed is None:
            normed = self.o_norm(o, gate.view(B, T, HV, V)).to(hidden_states.dtype)
        o = self.o_proj(normed.reshape(B, T, HV * V))
        return o if mask is None else o * mask[..., None].to(o.dtype)

    def which_glue(self, hidden_states: torch.Tensor) -> PathChoice:
        """Whether a call on ``hidden_states`` runs the steps around the operator as fused
        Triton kernels (``path == "kernels"``) or as plain PyTorch (``"plain"``), and why; logged
        once, and warned once where requested kernels cannot run."""
        wanted, source = self.use_kernels, "requested by use_kernels"
        if wanted is None:
            env = os.environ.get("GDN2_LAYER_KERNELS", "").strip()
            if env and env not in ("0", "1"):
                raise ValueError(f"GDN2_LAYER_KERNELS: expected 0 or 1, received {env!r}")
            wanted, source = (None, "automatic") if not env else (env == "1", "requested by GDN2_LAYER_KERNELS")
        if wanted is False:
            choice = PathChoice("plain", source)
        else:
            problem = _glue_kernel_problem(hidden_states)
            if problem is None and wanted is None and hidden_states.device.type != "cuda":
                problem = f"tensors on {hidden_states.device.type} (the Triton interpreter runs only when asked for)"
            if problem is None:
                choice = PathChoice("kernels", source)
            elif wanted:
                choice = PathChoice("plain", f"fused kernels requested but unavailable: {problem}", gave_way=True)
            else:
                choice = PathChoice("plain", f"automatic; fused kernels not used: {problem}")
        if not torch.compiler.is_compiling():
            paths.announce("torch.GatedDeltaNet2 glue", choice, stacklevel=3)
        return choice

    def _plain_inputs(self, x, mask, conv_states, positions):
        """q, k, v, g, b, w for the operator (``[B, T, heads, D]``; g float32, the others in
        ``OPERATOR_INPUT_DTYPE``'s choice) and the new convolution states, in plain PyTorch."""
        B, T, _ = x.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim
        if self.use_short_conv:
            conv_q, conv_k, conv_v = conv_states
            masked = (lambda y: y) if mask is None else (lambda y: y * mask[..., None].to(y.dtype))
            q, conv_q = self.q_conv1d(masked(self.q_proj(x)), conv_q, positions)
            k, conv_k = self.k_conv1d(masked(self.k_proj(x)), conv_k, positions)
            v, conv_v = self.v_conv1d(masked(self.v_proj(x)), conv_v, positions)
            conv_states = (conv_q, conv_k, conv_v)
        else:
            q, k, v = F.silu(self.q_proj(x)), F.silu(self.k_proj(x)), F.silu(self.v_proj(x))

        # Gates in float32: the cumulative sums of g downstream need the precision.
        g = F.softplus(self.f_proj(x).float() + self.dt_bias.float()).view(B, T, H, K)
        g = -self.A_log.float().exp()[:, None] * g
        b = torch.sigmoid(self.b_proj(x).float()).view(B, T, H, K)
        if self.allow_neg_eigval:
            b = b * 2.0
        w = torch.sigmoid(self.w_proj(x).float()).view(B, T, HV, V)
        q = l2_normalize(q.float().view(B, T, H, K))
        k = l2_normalize(k.float().view(B, T, H, K))
        v = v.float().view(B, T, HV, V)
        if OPERATOR_INPUT_DTYPE != "float32":  # the projections' dtype, as the fused glue writes them
            q, k, v, b, w = (t.to(_linear_dtype(x)) for t in (q, k, v, b, w))
        return q, k, v, g, b, w, conv_states

    def _fused_inputs(self, x, mask, conv_states, positions, keep_conv_states: bool):
        """As ``_plain_inputs``, through the fused Triton kernels: each result is written once, in
        the operator's layout (no transposes, casts or copies around it); g in float32, q, k, v,
        b, w in ``OPERATOR_INPUT_DTYPE``'s choice. Also returns ``g_proj[0](x)``, computed here
        with the other projections."""
        from .triton.conv import short_convolution
        from .triton.gates import decay_gate, sigmoid_gate
        from .triton.norm import l2_normalize as l2_normalize_kernel

        B, T, _ = x.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim
        # The seven projections of x as one matrix product: x cast once under autocast (not once
        # per projection), one product for its gradient (no sum of seven), larger products. Each
        # projection is a channel slice of the result; the kernels read the slices in place.
        projections = (self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.w_proj, self.f_proj[0], self.g_proj[0])
        device = x.device.type
        low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        weight = torch.cat([p.weight if low is None else p.weight.to(low) for p in projections])
        projected = F.linear(x, weight)
        q_in, k_in, v_in, b_in, w_in, f_low, gate_low = torch.split(
            projected, [p.out_features for p in projections], dim=-1
        )
        store = torch.float32 if OPERATOR_INPUT_DTYPE == "float32" else projected.dtype
        if self.use_short_conv:
            where = None if positions is None else torch.as_tensor(positions, dtype=torch.int32, device=x.device)[None]
            convolved, new_states = [], []
            for conv, inputs, state, head_dim in (
                (self.q_conv1d, q_in, conv_states[0], K),
                (self.k_conv1d, k_in, conv_states[1], K),
                (self.v_conv1d, v_in, conv_states[2], None),
            ):
                convolved.append(short_convolution(
                    inputs, conv.weight, conv.bias, state, where, mask, head_dim=head_dim, out_dtype=store,
                ))
                if keep_conv_states:
                    new_states.append(_conv_tail(inputs, state, mask, self.conv_size))
            q, k, v = convolved
            conv_states = tuple(new_states) if keep_conv_states else conv_states
        else:
            q = l2_normalize_kernel(q_in, K, silu=True, out_dtype=store)
            k = l2_normalize_kernel(k_in, K, silu=True, out_dtype=store)
            v = F.silu(v_in.to(store))
        g = decay_gate(self.f_proj[1](f_low), self.A_log, self.dt_bias)
        b = sigmoid_gate(b_in, 2.0 if self.allow_neg_eigval else 1.0, out_dtype=store)
        w = sigmoid_gate(w_in, out_dtype=store)
        q, k, g, b = (t.view(B, T, H, K) for t in (q, k, g, b))
        return q, k, v.view(B, T, HV, V), g, b, w.view(B, T, HV, V), conv_states, gate_low


_glue_failure: str | None = None  # why the fused kernels failed in this process (then not tried again)


def _glue_failed(error: BaseException) -> None:
    """Record a kernel failure and warn once; this call and the next ones run the plain code."""
    global _glue_failure
    _glue_failure = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    paths.announce("torch.GatedDeltaNet2 glue", PathChoice("plain", f"fused kernels failed: {_glue_failure}", gave_way=True))


def _glue_kernel_problem(x: torch.Tensor) -> str | None:
    """None when the fused glue kernels can run on ``x``'s device and dtype, else why not."""
    if _glue_failure is not None:
        return f"they failed earlier in this process ({_glue_failure})"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {str(x.dtype).rsplit('.', 1)[-1]} (the kernels compute in float32)"
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting):
        return f"tensors on {x.device.type}; Triton needs CUDA or TRITON_INTERPRET=1"
    try:
        from .triton import conv, gates, norm  # noqa: F401
    except ImportError as error:
        return f"Triton cannot be imported ({error})"
    return None


def _conv_tail(inputs: torch.Tensor, state: torch.Tensor | None, mask, width: int) -> torch.Tensor:
    """The new convolution state: the last ``width - 1`` inputs of ``cat(state, inputs)`` (padding
    read as zero), as ``ShortConvolution`` returns it."""
    B, T, D = inputs.shape
    if mask is not None:
        inputs = inputs * mask[..., None].to(inputs.dtype)
    if state is None:
        state = inputs.new_zeros(B, width - 1, D)
    joined = torch.cat([state.to(inputs.dtype), inputs[:, max(0, T - (width - 1)):]], dim=1)
    return joined[:, joined.shape[1] - (width - 1):]


def padding_mask(attention_mask, B: int, T: int, like: torch.Tensor, cache) -> torch.Tensor | None:
    """Check a ``[B, T]`` 0/1 padding mask; return it as a bool tensor (None: no padding)."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != (B, T):
        raise ValueError(f"attention_mask: expected shape [B, T] = {[B, T]}, received {list(attention_mask.shape)}")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask: expected 0/1 values (1 = token, 0 = padding), received other values")
    mask = attention_mask.to(device=like.device, dtype=torch.bool)
    if cache is not None and not bool(mask.all()) and (cache.offset > 0 or not bool(mask[:, -1].all())):
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GDN2Block(nn.Module):
    """Pre-norm residual block: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GatedDeltaNet2(**config.mixer_kwargs(), layer_idx=layer_idx)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cache: GDN2Cache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache=cache)
        return x + self.mlp(self.mlp_norm(x))


class GDN2LanguageModel(nn.Module):
    """Causal language model: embeddings, ``num_layers`` GDN-2 blocks, RMSNorm, linear head.

    ``forward(input_ids [B, T] integer, cache=None) -> logits [B, T, vocab_size]``. For generation,
    ``cache = model.make_cache()`` and call with successive pieces of the sequence.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GDN2Block(config, i) for i in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def make_cache(self) -> list[GDN2Cache]:
        """A fresh, empty cache: one ``GDN2Cache`` per block."""
        return [GDN2Cache() for _ in self.layers]

    def forward(self, input_ids: torch.Tensor, cache: list[GDN2Cache] | None = None) -> torch.Tensor:
        check_token_ids(input_ids, self.config.vocab_size, "torch", _token_range)
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache: expected {len(self.layers)} entries (one per layer), received {len(cache)}")
        x = self.embeddings(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, None if cache is None else cache[i])
        return self.lm_head(self.norm(x))


def _token_range(input_ids: torch.Tensor) -> tuple[int, int] | None:
    """``(min, max)`` of the ids: one reduction, and on CUDA one device sync per call. Under
    ``torch.compile`` the check is skipped (reading values would break the graph); an id out of
    range there is caught by the embedding's own bounds check (a device-side assert on CUDA)."""
    if torch.compiler.is_compiling():
        return None
    low, high = torch.aminmax(input_ids)
    return int(low), int(high)


# ---- weights: numpy in, numpy out, safetensors on disk (shared format with gdn2.mlx.layer) ----


def numpy_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter as a float32 numpy array, by its (framework-independent) name."""
    return {name: p.detach().to("cpu", torch.float32).numpy().copy() for name, p in model.named_parameters()}


def set_numpy_weights(model: nn.Module, arrays: dict[str, np.ndarray], source: str = "weights") -> None:
    """Copy ``{name: array}`` into the model's parameters (names and shapes must match exactly)."""
    params = dict(model.named_parameters())
    check_names({name: tuple(p.shape) for name, p in params.items()}, arrays, source)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(torch.from_numpy(np.asarray(arrays[name])).to(p.dtype))


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Set the framework-independent initial weights of ``gdn2.weights.initial_weights``."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    set_numpy_weights(model, initial_weights(shapes, seed), f"initial weights (seed {seed})")
    return model


def save_weights(model: nn.Module, path) -> None:
    """Write the model's parameters as safetensors (readable by ``gdn2.mlx.layer.load_weights``)."""
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
