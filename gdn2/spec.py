"""The shared definition of Gated DeltaNet-2: shapes, validation, and the float64 reference.

Per batch element and head, with a state ``S`` of shape ``[K, V]``::

    D       = S_{t-1} * exp(g_t)[:, None]        decay, per key channel
    erased  = (b_t * k_t) @ D                    read along the erase-gated key   [V]
    u       = w_t * v_t - erased                 write-gated value minus what is erased
    S_t     = D + outer(k_t, u)
    o_t     = scale * (q_t @ S_t)                [V]

Layout ``[B, T, H, D]``: q, k, g, b are ``[B, T, H, K]``; v, w are ``[B, T, H, V]``; the state is
``[B, H, K, V]``. Everything in this module is numpy; the reference runs in float64 and is the ground
truth every path of every framework is tested against.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from .packing import SequenceOffsets

KEY_INPUTS = ("q", "k", "g", "b")
VALUE_INPUTS = ("v", "w")
INPUT_NAMES = ("q", "k", "v", "g", "b", "w")
PATHS = ("reference", "chunk", "kernel")


@dataclass(frozen=True)
class Dims:
    """Sizes of one call: batch, time, heads, key dim, value dim, and state rows (N)."""

    B: int
    T: int
    H: int
    K: int
    V: int
    N: int  # rows of initial_state / final_state: B, or the number of packed sequences
    sequences: SequenceOffsets | None = None  # the packed offsets, parsed once (None: not packed)


def _shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def _dtype_name(x) -> str:
    """'float32', 'bfloat16', ... for numpy, torch and mlx arrays alike."""
    return str(x.dtype).rsplit(".", 1)[-1]


ARRAY_TYPES = {"numpy": "numpy.ndarray", "torch": "torch.Tensor", "mlx": "mlx.core.array"}


def array_kind(x) -> str | None:
    """``"numpy"``, ``"torch"`` or ``"mlx"`` for an array of that library; None for anything else.

    The libraries are looked up in ``sys.modules`` only: an array of a library nobody imported
    cannot exist, so nothing is imported here.
    """
    if isinstance(x, np.ndarray):
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    mx = sys.modules.get("mlx.core")
    if mx is not None and isinstance(x, mx.array):
        return "mlx"
    return None


def _type_name(x) -> str:
    kind = array_kind(x)
    return ARRAY_TYPES[kind] if kind is not None else type(x).__name__


def check_array_types(arrays: dict, framework: str | None = None) -> str:
    """Check that every non-None value of ``{name: array}`` is an array of one library; return it.

    ``framework`` (``"numpy"``, ``"torch"`` or ``"mlx"``) is the library the caller works in;
    None takes the library of the first value. Torch tensors must also share the first one's
    device. A mismatch raises ``ValueError`` naming the argument, the expected and the received
    type (or device).
    """
    given = {name: x for name, x in arrays.items() if x is not None}
    first_name, first = next(iter(given.items()))
    expected = framework if framework is not None else array_kind(first)
    if expected is None:
        raise ValueError(
            f"{first_name}: expected an array ({', '.join(ARRAY_TYPES.values())}), received {type(first).__name__}"
        )
    like = "" if framework is not None else f" (the type of {first_name})"
    for name, x in given.items():
        if array_kind(x) != expected:
            raise ValueError(f"{name}: expected {ARRAY_TYPES[expected]}{like}, received {_type_name(x)}")
    if expected == "torch":
        for name, x in given.items():
            if x.device != first.device:
                raise ValueError(
                    f"{name}: expected a tensor on {first.device} (the device of {first_name}), received one on {x.device}"
                )
    return expected


def validate(
    q, k, v, g, b, w, scale=None, initial_state=None, chunk_size: int = 64, cu_seqlens=None, *, framework: str | None = None,
    output_final_state: bool = False,
) -> Dims:
    """Check types, shapes, dtypes and arguments of a GDN-2 call; return its sizes.

    Works on numpy, torch and mlx arrays (it reads ``.shape``, ``.dtype``, torch's ``.device`` and,
    for ``cu_seqlens``, the values). Every array argument must be an array of ``framework``
    (``"numpy"``, ``"torch"`` or ``"mlx"``; None: the library of q), and torch tensors must be on
    q's device. Every mismatch raises a ``ValueError`` that names the argument, the expected and
    the received type, device, shape or dtype.
    """
    arrays = dict(q=q, k=k, v=v, g=g, b=b, w=w)
    unparsed = None if isinstance(cu_seqlens, SequenceOffsets) else cu_seqlens  # parsed offsets have no array type
    check_array_types(dict(arrays, initial_state=initial_state, cu_seqlens=unparsed), framework)
    for name, x in arrays.items():
        if len(x.shape) != 4:
            raise ValueError(f"{name}: expected 4 dimensions [B, T, H, D], received shape {list(_shape(x))}")
        if _dtype_name(x) not in ("float16", "bfloat16", "float32", "float64"):
            raise ValueError(
                f"{name}: expected a floating dtype (float16, bfloat16, float32, float64), received {_dtype_name(x)}"
            )
    B, T, H, K = _shape(q)
    V = _shape(v)[3]
    for name in KEY_INPUTS:
        if _shape(arrays[name]) != (B, T, H, K):
            raise ValueError(
                f"{name}: expected shape [B, T, H, K] = {[B, T, H, K]} (from q), received {list(_shape(arrays[name]))}"
            )
    for name in VALUE_INPUTS:
        if _shape(arrays[name]) != (B, T, H, V):
            raise ValueError(
                f"{name}: expected shape [B, T, H, V] = {[B, T, H, V]} (B, T, H from q, V from v), "
                f"received {list(_shape(arrays[name]))}"
            )
    if T < 1 or B < 1 or H < 1 or K < 1 or V < 1:
        raise ValueError(f"q, v: every dimension must be >= 1, received q {[B, T, H, K]} and v {list(_shape(v))}")
    dtype = _dtype_name(q)
    for name, x in arrays.items():
        if name == "g" and dtype in ("float16", "bfloat16") and _dtype_name(x) == "float32":
            continue  # log decays in float32 beside 16-bit inputs (rounding g to 16 bits moves exp(g) by |g| 2^-8)
        if _dtype_name(x) != dtype:
            also = " or float32" if name == "g" and dtype in ("float16", "bfloat16") else ""
            raise ValueError(f"{name}: expected dtype {dtype} (the dtype of q){also}, received {_dtype_name(x)}")
    if not isinstance(output_final_state, (bool, np.bool_)):  # a truthy string or tensor is not a flag
        raise ValueError(f"output_final_state: expected True or False, received {output_final_state!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an integer >= 1, received {chunk_size!r}")
    if isinstance(scale, (bool, np.bool_)):  # float(True) would be 1.0: a flag passed by mistake
        raise ValueError(f"scale: expected a finite number > 0, received {scale!r}")
    if scale is not None:
        try:
            value = float(scale)
        except (TypeError, ValueError):
            raise ValueError(f"scale: expected a finite number > 0, received {scale!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"scale: expected a finite number > 0, received {scale!r}")
    sequences = None if cu_seqlens is None else parse_cu_seqlens(cu_seqlens, B, T)
    N = B if sequences is None else sequences.count
    if initial_state is not None:
        if _shape(initial_state) != (N, H, K, V):
            rows = "N (sequences in cu_seqlens)" if cu_seqlens is not None else "B"
            raise ValueError(
                f"initial_state: expected shape [{rows}, H, K, V] = {[N, H, K, V]}, received {list(_shape(initial_state))}"
            )
        allowed = ("float32", "float64") if dtype == "float64" else ("float32",)
        if _dtype_name(initial_state) not in allowed:
            raise ValueError(
                f"initial_state: expected dtype {' or '.join(allowed)}, received {_dtype_name(initial_state)}"
            )
    return Dims(B, T, H, K, V, N, sequences)


def parse_cu_seqlens(cu_seqlens, B: int, T: int) -> SequenceOffsets:
    """Check packed-sequence offsets ``[N + 1]`` (0, ..., T, non-decreasing, int32 or int64) and
    read them once; an already parsed ``SequenceOffsets`` is checked against B and T only."""
    if isinstance(cu_seqlens, SequenceOffsets):
        if B != 1:
            raise ValueError(f"q: with cu_seqlens the batch size must be 1 (sequences packed along T), received B={B}")
        if cu_seqlens.total != T:
            raise ValueError(f"cu_seqlens: expected to end at T={T}, received {cu_seqlens.total}")
        return cu_seqlens
    if array_kind(cu_seqlens) is None:
        raise ValueError(f"cu_seqlens: expected an integer array of shape [N + 1], received {type(cu_seqlens).__name__}")
    if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected shape [N + 1] with N >= 1, received {list(_shape(cu_seqlens))}")
    if _dtype_name(cu_seqlens) not in ("int32", "int64"):  # uint8 and int16 would wrap long offsets
        raise ValueError(f"cu_seqlens: expected an integer dtype (int32 or int64), received {_dtype_name(cu_seqlens)}")
    if B != 1:
        raise ValueError(f"q: with cu_seqlens the batch size must be 1 (sequences packed along T), received B={B}")
    offsets = np.asarray(cu_seqlens.tolist(), dtype=np.int64)
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens: expected to start at 0, received {offsets[0]}")
    if offsets[-1] != T:
        raise ValueError(f"cu_seqlens: expected to end at T={T}, received {offsets[-1]}")
    if np.any(np.diff(offsets) < 0):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets, received {offsets.tolist()}")
    return SequenceOffsets(tuple(int(x) for x in offsets))


def default_scale(K: int, scale=None) -> float:
    return float(K) ** -0.5 if scale is None else float(scale)


def reference_forward(q, k, v, g, b, w, scale=None, initial_state=None, cu_seqlens=None):
    """Token-by-token GDN-2 in float64.

    Returns ``(o [B, T, H, V], final_state [B, H, K, V])``, both float64. With ``cu_seqlens``
    (``[N + 1]`` offsets, B = 1) the state restarts at each sequence and the states have N rows.
    """
    if cu_seqlens is not None:
        return _per_sequence(reference_forward, q, k, v, g, b, w, scale, initial_state, cu_seqlens)
    dims = validate(q, k, v, g, b, w, scale, initial_state)
    scale = default_scale(dims.K, scale)
    q, k, v, g, b, w = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, b, w))
    state = _initial(initial_state, dims)
    o = np.empty((dims.B, dims.T, dims.H, dims.V))
    for t in range(dims.T):
        decayed = state * np.exp(g[:, t])[..., None]
        erased = np.einsum("bhk,bhkv->bhv", b[:, t] * k[:, t], decayed)
        state = decayed + k[:, t][..., None] * (w[:, t] * v[:, t] - erased)[:, :, None, :]
        o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], state)
    return o, state


def reference_backward(q, k, v, g, b, w, d_o, scale=None, initial_state=None, d_final_state=None, cu_seqlens=None):
    """Exact gradients of ``sum(o * d_o) + sum(final_state * d_final_state)``, in float64.

    A forward pass keeps every state; a reverse-time pass applies the adjoint of each step.
    Returns a dict with keys q, k, v, g, b, w, initial_state (shapes of the inputs).
    """
    if cu_seqlens is not None:
        return _per_sequence(
            reference_backward, q, k, v, g, b, w, scale, initial_state, cu_seqlens, d_o=d_o, d_final_state=d_final_state
        )
    dims = validate(q, k, v, g, b, w, scale, initial_state)
    scale = default_scale(dims.K, scale)
    q, k, v, g, b, w, d_o = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, b, w, d_o))
    states = [_initial(initial_state, dims)]  # states[t] is S_{t-1} for step t (0-based)
    for t in range(dims.T):
        decayed = states[-1] * np.exp(g[:, t])[..., None]
        erased = np.einsum("bhk,bhkv->bhv", b[:, t] * k[:, t], decayed)
        states.append(decayed + k[:, t][..., None] * (w[:, t] * v[:, t] - erased)[:, :, None, :])
    grads = {name: np.zeros_like(x) for name, x in dict(q=q, k=k, v=v, g=g, b=b, w=w).items()}
    d_state = np.zeros_like(states[0]) if d_final_state is None else np.array(d_final_state, dtype=np.float64)
    for t in reversed(range(dims.T)):
        prev, state = states[t], states[t + 1]
        decay = np.exp(g[:, t])
        decayed = prev * decay[..., None]
        bk = b[:, t] * k[:, t]
        u = w[:, t] * v[:, t] - np.einsum("bhk,bhkv->bhv", bk, decayed)
        # o_t = scale * q_t @ S_t
        grads["q"][:, t] = scale * np.einsum("bhkv,bhv->bhk", state, d_o[:, t])
        d_state = d_state + scale * q[:, t][..., None] * d_o[:, t][:, :, None, :]
        # S_t = D + outer(k, u)
        d_decayed = d_state.copy()
        d_k = np.einsum("bhkv,bhv->bhk", d_state, u)
        d_u = np.einsum("bhk,bhkv->bhv", k[:, t], d_state)
        # u = w * v - bk @ D
        grads["w"][:, t] = d_u * v[:, t]
        grads["v"][:, t] = d_u * w[:, t]
        d_bk = -np.einsum("bhkv,bhv->bhk", decayed, d_u)
        d_decayed -= bk[..., None] * d_u[:, :, None, :]
        grads["b"][:, t] = d_bk * k[:, t]
        grads["k"][:, t] = d_k + d_bk * b[:, t]
        # D = S_{t-1} * exp(g)
        grads["g"][:, t] = np.sum(d_decayed * prev, axis=-1) * decay
        d_state = d_decayed * decay[..., None]
    grads["initial_state"] = d_state
    return grads


def _per_sequence(function, q, k, v, g, b, w, scale, initial_state, cu_seqlens, d_o=None, d_final_state=None):
    """Run ``function`` (forward, or backward when ``d_o`` is given) on each packed sequence alone."""
    dims = validate(q, k, v, g, b, w, scale, initial_state, cu_seqlens=cu_seqlens)
    scale = default_scale(dims.K, scale)
    rows = (dims.N, dims.H, dims.K, dims.V)
    states = np.zeros(rows) if initial_state is None else np.asarray(initial_state, np.float64)
    d_finals = np.zeros(rows) if d_final_state is None else np.asarray(d_final_state, np.float64)
    inputs = {name: np.asarray(x, np.float64) for name, x in dict(q=q, k=k, v=v, g=g, b=b, w=w).items()}
    pieces = []
    for n, (start, end) in enumerate(dims.sequences.spans):
        piece = {name: x[:, start:end] for name, x in inputs.items()}
        if d_o is None:
            if start == end:  # an empty sequence passes its state through
                pieces.append(dict(o=piece["v"], final_state=states[n : n + 1]))
                continue
            o, final_state = function(**piece, scale=scale, initial_state=states[n : n + 1])
            pieces.append(dict(o=o, final_state=final_state))
        elif start == end:  # ... and the final state's gradient back
            pieces.append(dict(piece, initial_state=d_finals[n : n + 1]))
        else:
            pieces.append(function(**piece, d_o=np.asarray(d_o, np.float64)[:, start:end], scale=scale,
                                   initial_state=states[n : n + 1], d_final_state=d_finals[n : n + 1]))
    joined = {name: np.concatenate([p[name] for p in pieces], axis=0 if name in ("final_state", "initial_state") else 1)
              for name in pieces[0]}
    return (joined["o"], joined["final_state"]) if d_o is None else joined


def _initial(initial_state, dims: Dims) -> np.ndarray:
    if initial_state is None:
        return np.zeros((dims.B, dims.H, dims.K, dims.V))
    return np.array(initial_state, dtype=np.float64)


def random_inputs(
    B: int, T: int, H: int, K: int, V: int, seed: int, *, log_decay_range=(-3.0, 0.0), erase_max: float = 1.0
) -> dict[str, np.ndarray]:
    """Fresh random float64 inputs in the regime real layers produce.

    q, k are L2-normalised over K (as the layer does); g is uniform in ``log_decay_range``;
    b is uniform in ``[0, erase_max]``; w in ``[0, 1]``; the initial state is Gaussian.
    """
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    low, high = log_decay_range
    return dict(
        q=unit((B, T, H, K)),
        k=unit((B, T, H, K)),
        v=rng.standard_normal((B, T, H, V)),
        g=rng.uniform(low, high, (B, T, H, K)),
        b=rng.uniform(0.0, erase_max, (B, T, H, K)),
        w=rng.uniform(0.0, 1.0, (B, T, H, V)),
        initial_state=rng.standard_normal((B, H, K, V)),
    )


def relative_error(x, reference) -> float:
    """``||x - reference|| / ||reference||`` in float64 (NaN anywhere gives inf)."""
    x = np.asarray(x, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    if x.shape != reference.shape:
        raise ValueError(f"x: expected shape {list(reference.shape)}, received {list(x.shape)}")
    if not np.all(np.isfinite(x)):
        return math.inf
    norm = np.linalg.norm(reference)
    return float(np.linalg.norm(x - reference) / (norm if norm > 0 else 1.0))
