"""Triton forward kernels of the chunked GDN-2 form (see ``gdn2/chunk.py`` for the mathematics).

Two launches:

* ``intra_forward`` (one program per chunk and head, parallel): the cumulative log decay ``G``,
  the erase interactions ``A`` and query-key interactions ``P``, the inverse of ``I + A`` and the
  WY products ``Wk = inverse @ (b * k * exp(G))`` and ``Uw = inverse @ (w * v)``.
* ``state_forward`` (one program per head and block of value columns, sequential over chunks):
  carries the state, writes the state entering each chunk, the new values ``U`` and the output.

Chunks are ``CHUNK = 64`` tokens, split into four sub-chunks of 16 for the in-chunk decays.

Numerics (log decays down to -20 per step, so ``-G`` passes 88 within 5 steps): no exponent in
these kernels is positive. Inside a diagonal 16x16 sub-block the decay ``exp(G_i - G_j)`` is
computed per channel from the window sum ``g_{j+1} + ... + g_i`` (loop over the offset
``d = i - j``); an off-diagonal sub-block I > J is a matrix product through the anchor
``a = G[16 I - 1]``: ``(X_I exp(G_I - a)) @ (Y_J exp(a - G_J))^T``, both factors <= 1.

Internal buffers are head-major and padded to whole chunks: ``[B, H, N * 64, D]`` (rows past T
are zero), chunk matrices ``[B, H, N, 64, 64]``, states ``[B, H, N, K, V]``. Each program finds its
rows from (chunk, head) alone, so packed variable-length batches only need a chunk -> (sequence
start, length) table in place of ``n * 64`` and ``T`` (not implemented yet).
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK = 64

# Launch settings measured on an H200 (bench/RESULTS.md); 8 warps in the sequential passes
# faulted there with Triton 3.6.
INTRA_FORWARD_WARPS = 8
STATE_WARPS = 4
STATE_MIN_PROGRAMS = 256  # value blocks shrink until the sequential passes have this many programs


@triton.jit
def _inverse_unit_lower_16(A):
    """``(I + A)^{-1}`` for a strictly lower 16x16 ``A``, by forward substitution (exact order)."""
    r = tl.arange(0, 16)
    inverse = (r[:, None] == r[None, :]).to(tl.float32)
    for i in range(1, 16):
        a_row = tl.sum(tl.where(r[:, None] == i, A, 0.0), 0)  # A[i, :] indexed by column j
        update = tl.sum(a_row[:, None] * inverse, 0)  # sum_j A[i, j] inverse[j, :]
        inverse = tl.where(r[:, None] == i, inverse - update[None, :], inverse)
    return inverse


@triton.jit
def _load_tile16(base, I: tl.constexpr, J: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, 16)
    return tl.load(base + (I * 16 + r[:, None]) * C + J * 16 + r[None, :])


@triton.jit
def _store_tile16(base, I: tl.constexpr, J: tl.constexpr, C: tl.constexpr, x):
    r = tl.arange(0, 16)
    tl.store(base + (I * 16 + r[:, None]) * C + J * 16 + r[None, :], x)


@triton.jit
def _invert_chunk_in_place(base, C: tl.constexpr):
    """Overwrite the strictly lower ``A`` [64, 64] at ``base`` with ``(I + A)^{-1}``.

    Diagonal 16x16 blocks by forward substitution, then the blocked formula
    ``X_IJ = -X_II sum_{J <= M < I} A_IM X_MJ`` with exact fp32 products (tiny dots).
    The caller puts barriers around this (the matrix goes through memory to be cut into tiles).
    """
    A00 = _load_tile16(base, 0, 0, C)
    A11 = _load_tile16(base, 1, 1, C)
    A22 = _load_tile16(base, 2, 2, C)
    A33 = _load_tile16(base, 3, 3, C)
    A10 = _load_tile16(base, 1, 0, C)
    A20 = _load_tile16(base, 2, 0, C)
    A21 = _load_tile16(base, 2, 1, C)
    A30 = _load_tile16(base, 3, 0, C)
    A31 = _load_tile16(base, 3, 1, C)
    A32 = _load_tile16(base, 3, 2, C)
    X00 = _inverse_unit_lower_16(A00)
    X11 = _inverse_unit_lower_16(A11)
    X22 = _inverse_unit_lower_16(A22)
    X33 = _inverse_unit_lower_16(A33)
    X10 = -tl.dot(X11, tl.dot(A10, X00, input_precision="ieee"), input_precision="ieee")
    X21 = -tl.dot(X22, tl.dot(A21, X11, input_precision="ieee"), input_precision="ieee")
    X20 = -tl.dot(
        X22, tl.dot(A20, X00, input_precision="ieee") + tl.dot(A21, X10, input_precision="ieee"), input_precision="ieee"
    )
    X32 = -tl.dot(X33, tl.dot(A32, X22, input_precision="ieee"), input_precision="ieee")
    X31 = -tl.dot(
        X33, tl.dot(A31, X11, input_precision="ieee") + tl.dot(A32, X21, input_precision="ieee"), input_precision="ieee"
    )
    X30 = -tl.dot(
        X33,
        tl.dot(A30, X00, input_precision="ieee")
        + tl.dot(A31, X10, input_precision="ieee")
        + tl.dot(A32, X20, input_precision="ieee"),
        input_precision="ieee",
    )
    _store_tile16(base, 0, 0, C, X00)
    _store_tile16(base, 1, 1, C, X11)
    _store_tile16(base, 2, 2, C, X22)
    _store_tile16(base, 3, 3, C, X33)
    _store_tile16(base, 1, 0, C, X10)
    _store_tile16(base, 2, 0, C, X20)
    _store_tile16(base, 2, 1, C, X21)
    _store_tile16(base, 3, 0, C, X30)
    _store_tile16(base, 3, 1, C, X31)
    _store_tile16(base, 3, 2, C, X32)


@triton.jit
def _intra_forward_kernel(
    q, k, v, g, b, w,  # inputs [B, T, H, K] / [B, T, H, V]
    G_out, Wk_out, Uw_out,  # [B, H, N * C, K | K | V] float32
    P_out, inverse_out,  # [B, H, N, C, C] float32
    T, H, K: tl.constexpr, V: tl.constexpr, N,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    rows = tl.arange(0, C)
    cols_c = tl.arange(0, C)
    cols_k = tl.arange(0, BK)
    k_ok = cols_k < K
    t = i_n * C + rows
    row_ok = t < T
    key_in = i_b * T * H * K + i_h * K  # + t * H * K + column
    key_offsets = key_in + t[:, None] * (H * K) + cols_k[None, :]
    mask = row_ok[:, None] & k_ok[None, :]

    g_tile = tl.load(g + key_offsets, mask=mask, other=0.0).to(tl.float32)
    G = tl.cumsum(g_tile, 0)
    padded = i_bh * N * C * K + (i_n * C + rows[:, None]) * K + cols_k[None, :]
    tl.store(G_out + padded, G, mask=k_ok[None, :])
    q_tile = tl.load(q + key_offsets, mask=mask, other=0.0).to(tl.float32)
    k_tile = tl.load(k + key_offsets, mask=mask, other=0.0).to(tl.float32)
    bk = tl.load(b + key_offsets, mask=mask, other=0.0).to(tl.float32) * k_tile

    # Off-diagonal 16x16 blocks (rows in sub-chunk I, columns before it) through the anchor row
    # 16 I - 1: both exponents are <= 0.
    A = tl.zeros((C, C), dtype=tl.float32)
    P = tl.zeros((C, C), dtype=tl.float32)
    for I in range(1, C // 16):
        anchor = tl.sum(tl.where(rows[:, None] == I * 16 - 1, G, 0.0), 0)
        in_block = (rows >= I * 16) & (rows < I * 16 + 16)
        before = rows < I * 16
        left = tl.exp(tl.where(in_block[:, None], G - anchor[None, :], float("-inf")))
        right_k = k_tile * tl.exp(tl.where(before[:, None], anchor[None, :] - G, float("-inf")))
        A += tl.dot(bk * left, tl.trans(right_k), input_precision=DOT)
        P += tl.dot(q_tile * left, tl.trans(right_k), input_precision=DOT)

    # Diagonal 16x16 blocks, one offset d = i - j at a time: exp(G_i - G_{i-d}) is
    # exp(g_{i-d+1} + ... + g_i), a window sum of at most 15 log decays, per channel.
    window = tl.zeros((C, BK), dtype=tl.float32)
    for d in range(0, 16):
        if d > 0:
            shifted = tl.load(
                g + key_offsets - (d - 1) * (H * K), mask=mask & (rows[:, None] >= d - 1), other=0.0
            ).to(tl.float32)
            window += shifted
        same_block = (rows % 16) >= d
        decay = tl.exp(tl.where(same_block[:, None], window, float("-inf")))
        k_before = tl.load(k + key_offsets - d * (H * K), mask=mask & (rows[:, None] >= d), other=0.0).to(tl.float32)
        k_decayed = k_before * decay
        on_diagonal = cols_c[None, :] == rows[:, None] - d
        P += tl.where(on_diagonal, tl.sum(q_tile * k_decayed, 1)[:, None], 0.0)
        if d > 0:
            A += tl.where(on_diagonal, tl.sum(bk * k_decayed, 1)[:, None], 0.0)

    chunk_matrix = (i_bh * N + i_n) * C * C + rows[:, None] * C + cols_c[None, :]
    tl.store(P_out + chunk_matrix, P)
    # The inverse goes through memory: A is written, cut into 16x16 tiles, inverted in place.
    tl.store(inverse_out + chunk_matrix, A)
    tl.debug_barrier()
    _invert_chunk_in_place(inverse_out + (i_bh * N + i_n) * C * C, C)
    tl.debug_barrier()
    inverse = tl.load(inverse_out + chunk_matrix)

    Wk = tl.dot(inverse, bk * tl.exp(G), input_precision=DOT)
    tl.store(Wk_out + padded, Wk, mask=k_ok[None, :])
    value_in = i_b * T * H * V + i_h * V
    for v0 in tl.static_range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_mask = row_ok[:, None] & (cols_v < V)[None, :]
        value_offsets = value_in + t[:, None] * (H * V) + cols_v[None, :]
        wv = tl.load(w + value_offsets, mask=v_mask, other=0.0).to(tl.float32) * tl.load(
            v + value_offsets, mask=v_mask, other=0.0
        ).to(tl.float32)
        Uw = tl.dot(inverse, wv, input_precision=DOT)
        tl.store(
            Uw_out + i_bh * N * C * V + (i_n * C + rows[:, None]) * V + cols_v[None, :], Uw, mask=(cols_v < V)[None, :]
        )


def intra_forward(q, k, v, g, b, w, G, Wk, Uw, P, inverse, dot_precision: str) -> None:
    """Launch the in-chunk kernel. Inputs ``[B, T, H, K|V]`` contiguous; outputs preallocated
    (``G, Wk``: ``[B, H, N * 64, K]``, ``Uw``: ``[B, H, N * 64, V]``, ``P, inverse``: ``[B, H, N, 64, 64]``,
    all float32)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = P.shape[2]
    BK = max(16, triton.next_power_of_2(K))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    _intra_forward_kernel[(N, B * H)](
        q, k, v, g, b, w, G, Wk, Uw, P, inverse, T, H, K, V, N,
        BK=BK, BV=BV, C=CHUNK, DOT=dot_precision, num_warps=INTRA_FORWARD_WARPS, num_stages=1,
    )


@triton.jit
def _state_forward_kernel(
    q, k, G, Wk, Uw, P,  # q, k [B, T, H, K]; G, Wk [B, H, N*C, K]; Uw [B, H, N*C, V]; P [B, H, N, C, C]
    initial_state, o, states, U_out, final_state,  # [B,H,K,V], [B,T,H,V], [B,H,N,K,V], [B,H,N*C,V], [B,H,K,V]
    scale, T, H, K: tl.constexpr, V: tl.constexpr, N,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr, DOT: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    rows = tl.arange(0, C)
    cols_c = tl.arange(0, C)
    cols_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    k_ok = cols_k < K
    v_ok = cols_v < V
    state_offsets = cols_k[:, None] * V + cols_v[None, :]
    state_mask = k_ok[:, None] & v_ok[None, :]
    if HAS_INITIAL:
        state = tl.load(initial_state + i_bh * K * V + state_offsets, mask=state_mask, other=0.0)
    else:
        state = tl.zeros((BK, BV), dtype=tl.float32)
    for i_n in range(N):
        tl.store(states + (i_bh * N + i_n) * K * V + state_offsets, state, mask=state_mask)
        t = i_n * C + rows
        row_ok = t < T
        padded_k = i_bh * N * C * K + (i_n * C + rows[:, None]) * K + cols_k[None, :]
        padded_v = i_bh * N * C * V + (i_n * C + rows[:, None]) * V + cols_v[None, :]
        Wk_tile = tl.load(Wk + padded_k, mask=k_ok[None, :], other=0.0)
        U = tl.load(Uw + padded_v, mask=v_ok[None, :], other=0.0) - tl.dot(Wk_tile, state, input_precision=DOT)
        tl.store(U_out + padded_v, U, mask=v_ok[None, :])

        G_tile = tl.load(G + padded_k, mask=k_ok[None, :], other=0.0)
        key_offsets = i_b * T * H * K + t[:, None] * (H * K) + i_h * K + cols_k[None, :]
        key_mask = row_ok[:, None] & k_ok[None, :]
        q_decayed = tl.load(q + key_offsets, mask=key_mask, other=0.0).to(tl.float32) * tl.exp(G_tile)
        P_tile = tl.load(P + (i_bh * N + i_n) * C * C + rows[:, None] * C + cols_c[None, :])
        out = scale * (tl.dot(q_decayed, state, input_precision=DOT) + tl.dot(P_tile, U, input_precision=DOT))
        value_offsets = i_b * T * H * V + t[:, None] * (H * V) + i_h * V + cols_v[None, :]
        tl.store(o + value_offsets, out.to(o.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])

        G_last = tl.load(G + i_bh * N * C * K + (i_n * C + C - 1) * K + cols_k, mask=k_ok, other=0.0)
        k_to_end = tl.load(k + key_offsets, mask=key_mask, other=0.0).to(tl.float32) * tl.exp(G_last[None, :] - G_tile)
        state = state * tl.exp(G_last)[:, None] + tl.dot(tl.trans(k_to_end), U, input_precision=DOT)
    if STORE_FINAL:
        tl.store(final_state + i_bh * K * V + state_offsets, state, mask=state_mask)


def value_block(V: int, programs_per_block: int) -> int:
    """Columns of V per program in the sequential passes: smaller blocks when there are few heads,
    so that the GPU has enough programs (at least about two per multiprocessor)."""
    block = min(64, max(16, triton.next_power_of_2(V)))
    while block > 16 and programs_per_block * triton.cdiv(V, block) < STATE_MIN_PROGRAMS:
        block //= 2
    return block


def state_forward(
    q, k, G, Wk, Uw, P, initial_state, o, states, U, final_state, scale: float, dot_precision: str
) -> None:
    """Launch the sequential pass over chunks (writes ``o``, ``states``, ``U``, ``final_state``)."""
    B, T, H, K = q.shape
    V = o.shape[-1]
    N = states.shape[2]
    BK = max(16, triton.next_power_of_2(K))
    BV = value_block(V, B * H)
    _state_forward_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, G, Wk, Uw, P,
        initial_state if initial_state is not None else states,
        o, states, U, final_state if final_state is not None else states,
        scale, T, H, K, V, N,
        BK=BK, BV=BV, C=CHUNK,
        HAS_INITIAL=initial_state is not None, STORE_FINAL=final_state is not None, DOT=dot_precision,
        num_warps=STATE_WARPS, num_stages=1,
    )
