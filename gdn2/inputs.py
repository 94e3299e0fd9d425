"""Checks of the layer's and the language model's inputs, written once for PyTorch and MLX.

Like ``gdn2.spec.validate`` for the operator: every problem is a ``ValueError`` that names the
argument, the expected and the received. They read shapes, dtypes and types only, except
``check_token_ids``, which needs the smallest and largest id (one reduction, read by the caller's
``value_range``).
"""

from __future__ import annotations

from .packing import SequenceOffsets
from .spec import _dtype_name, check_array_types

TOKEN_DTYPES = {
    # nn.Embedding in torch indexes with int32 or int64 only; MLX takes any integer type.
    "torch": ("int32", "int64"),
    "mlx": ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"),
}


def check_hidden_states(hidden_states, hidden_size: int, framework: str, **others) -> tuple[int, int]:
    """``hidden_states`` ``[B, T, hidden_size]`` with B, T >= 1 of ``framework``, and ``others``
    (attention_mask, cu_seqlens, ... or None) arrays of the same library and device; return (B, T).
    Offsets already parsed (a ``SequenceOffsets``) are plain integers, of no library."""
    arrays = {name: x for name, x in others.items() if not isinstance(x, SequenceOffsets)}
    check_array_types(dict(hidden_states=hidden_states, **arrays), framework)
    shape = [int(d) for d in hidden_states.shape]
    if len(shape) != 3 or shape[-1] != hidden_size:
        raise ValueError(f"hidden_states: expected shape [B, T, {hidden_size}], received {shape}")
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"hidden_states: expected at least one token (B >= 1 and T >= 1), received shape {shape}")
    return shape[0], shape[1]


def cached_batch(cache) -> int | None:
    """How many sequences a layer cache holds (None: an empty cache)."""
    if cache.recurrent_state is not None:
        return int(cache.recurrent_state.shape[0])
    if cache.conv_state:
        return int(cache.conv_state[0].shape[0])
    return None


def check_cache_batch(cache, B: int) -> None:
    """A cache continues the batch it was filled with: the same number of sequences."""
    rows = cached_batch(cache)
    if rows is not None and rows != B:
        raise ValueError(
            f"cache: expected hidden_states of the {rows} sequences it holds (B={rows}), received B={B} "
            "(a new batch needs a new cache)"
        )


def check_token_ids(input_ids, vocab_size: int, framework: str, value_range) -> None:
    """``input_ids`` ``[B, T]`` (B, T >= 1) of integer ids in ``[0, vocab_size - 1]``.

    ``value_range(input_ids)`` returns ``(min, max)``, or None where the values cannot be read
    (inside a compiled graph); then only the type, shape and dtype are checked.
    """
    check_array_types(dict(input_ids=input_ids), framework)
    shape = [int(d) for d in input_ids.shape]
    if len(shape) != 2:
        raise ValueError(f"input_ids: expected shape [B, T], received {shape}")
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"input_ids: expected at least one token (B >= 1 and T >= 1), received shape {shape}")
    allowed = TOKEN_DTYPES[framework]
    if _dtype_name(input_ids) not in allowed:
        raise ValueError(f"input_ids: expected an integer dtype ({', '.join(allowed)}), received {_dtype_name(input_ids)}")
    bounds = value_range(input_ids)
    if bounds is None:
        return
    low, high = (int(x) for x in bounds)
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"input_ids: expected token ids in [0, {vocab_size - 1}] (vocab_size {vocab_size}), "
            f"received min {low}, max {high}"
        )
