"""Triton forward kernels of the chunked GDN-2 form (see ``gdn2/chunk.py`` for the mathematics).

Three launches:

* ``intra_forward`` (one program per chunk and head, parallel): the erase interactions ``A`` and
  query-key interactions ``P`` as 16x16 register tiles, the inverse ``X = (I + A)^{-1}``, the WY
  products ``Wk = X (b * k * exp(G))`` and ``Uw = X (w * v)``, and the decayed keys and queries
  the other two launches use: ``qd = q * exp(G)``, ``kd = k * exp(G_last - G)``,
  ``gamma = exp(G_last)``.
* ``state_forward`` (one program per head and block of value columns, sequential over chunks):
  carries the state ``S``; writes the state entering each chunk and the new values
  ``U = Uw - Wk S``; ``S <- gamma * S + kd^T U``.
* ``output`` (one program per chunk, head and block of value columns, parallel):
  ``o = scale * (qd S + P U)``.

Chunks are ``CHUNK = 64`` tokens, four sub-blocks of 16.

Numerics (log decays down to -20 per step, or a hard reset ``g = -inf``): every exponent is a sum
of log decays over a span, summed directly (never a difference of cumulative sums, which in
float32 would lose the low digits next to a large step), and never positive. With ``L`` the
inclusive prefix sum inside a sub-block, ``R`` the exclusive suffix sum inside it and ``t_M`` the
decay of a whole sub-block:

* an off-diagonal tile (I > J) is a matrix product ``(x_I e^{L_I}) (k_J e^{R_J} prod t_M)^T``
  over the sub-blocks M strictly between, all factors <= 1;
* a diagonal tile is built one column j at a time, ``E_j[i] = E_{j+1}[i] e^{g_{j+1}}`` for
  ``i > j`` (products of per-step decays, one exponential per step and channel);
* ``exp(G_i) = e^{L_i} prod_{M<I} t_M`` and ``exp(G_last - G_j) = e^{R_j} prod_{M>J} t_M``.

Masks are selects (``tl.where``), never multiplications, so ``-inf`` never meets a zero.

Internal buffers are head-major and padded to whole chunks: ``[B, H, N * 64, D]`` (rows past T
are zero), chunk matrices ``[B, H, N, 64, 64]``, states ``[B, H, N, K, V]``, ``gamma``
``[B, H, N, K]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK = 64

# Launch settings (bench/RESULTS.md has the measurements they come from).
INTRA_FORWARD_WARPS = 4
INTRA_FORWARD_KEY_BLOCK = 32
STATE_WARPS = 4
OUTPUT_WARPS = 4
STATE_MIN_PROGRAMS = 256  # value blocks shrink until the sequential passes have this many programs


@triton.jit
def _later_segment_product(a, a_segment, b, b_segment):
    """Combine of a segmented forward product scan: the product of the elements in the segment of
    the later (larger) segment id only. Commutative, so any combine order gives the same result."""
    return tl.where(a_segment == b_segment, a * b, tl.where(a_segment > b_segment, a, b)), tl.maximum(a_segment, b_segment)


@triton.jit
def _earlier_segment_product(a, a_segment, b, b_segment):
    """Combine of a segmented reverse product scan (the earlier, smaller segment id wins)."""
    return tl.where(a_segment == b_segment, a * b, tl.where(a_segment < b_segment, a, b)), tl.minimum(a_segment, b_segment)


@triton.jit
def _segment_prefix(x, segment):
    """Inclusive product of ``x`` down axis 0 inside each segment (rows with the same id)."""
    product, _ = tl.associative_scan((x, segment), 0, _later_segment_product)
    return product


@triton.jit
def _segment_suffix(x, segment):
    """Inclusive product of ``x`` up axis 0 (from the segment's last row) inside each segment."""
    product, _ = tl.associative_scan((x, segment), 0, _earlier_segment_product, reverse=True)
    return product


@triton.jit
def _inverse_diagonal_tile(base, I: tl.constexpr):
    """``(I + A_II)^{-1}`` for the 16x16 diagonal tile I of the strictly lower ``A`` [64, 64] at
    ``base``, by forward substitution; rows of ``A`` are read from memory."""
    r = tl.arange(0, 16)
    X = (r[:, None] == r[None, :]).to(tl.float32)
    for i in range(1, 16):
        a_row = tl.load(base + (I * 16 + i) * 64 + I * 16 + r)  # A[i, j] over j (zero for j >= i)
        update = tl.sum(a_row[:, None] * X, 0)  # sum_j A[i, j] X[j, :]
        X = tl.where(r[:, None] == i, X - update[None, :], X)
    return X


@triton.jit
def _load_tile16(base, I: tl.constexpr, J: tl.constexpr):
    r = tl.arange(0, 16)
    return tl.load(base + (I * 16 + r[:, None]) * 64 + J * 16 + r[None, :])


@triton.jit
def _store_tile16(base, I: tl.constexpr, J: tl.constexpr, x):
    r = tl.arange(0, 16)
    tl.store(base + (I * 16 + r[:, None]) * 64 + J * 16 + r[None, :], x)


@triton.jit
def _ieee(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _invert_chunk_in_place(base):
    """Overwrite the strictly lower ``A`` [64, 64] at ``base`` with ``(I + A)^{-1}``.

    Diagonal 16x16 tiles by forward substitution, then ``X_IJ = -X_II sum_{J <= M < I} A_IM X_MJ``
    with exact float32 products. The caller puts barriers around this (the matrix goes through
    memory to be cut into tiles).
    """
    X00 = _inverse_diagonal_tile(base, 0)
    X11 = _inverse_diagonal_tile(base, 1)
    X22 = _inverse_diagonal_tile(base, 2)
    X33 = _inverse_diagonal_tile(base, 3)
    A10 = _load_tile16(base, 1, 0)
    A20 = _load_tile16(base, 2, 0)
    A21 = _load_tile16(base, 2, 1)
    A30 = _load_tile16(base, 3, 0)
    A31 = _load_tile16(base, 3, 1)
    A32 = _load_tile16(base, 3, 2)
    X10 = -_ieee(X11, _ieee(A10, X00))
    X21 = -_ieee(X22, _ieee(A21, X11))
    X20 = -_ieee(X22, _ieee(A20, X00) + _ieee(A21, X10))
    X32 = -_ieee(X33, _ieee(A32, X22))
    X31 = -_ieee(X33, _ieee(A31, X11) + _ieee(A32, X21))
    X30 = -_ieee(X33, _ieee(A30, X00) + _ieee(A31, X10) + _ieee(A32, X20))
    tl.debug_barrier()  # every A tile is read before X overwrites it
    _store_tile16(base, 0, 0, X00)
    _store_tile16(base, 1, 1, X11)
    _store_tile16(base, 2, 2, X22)
    _store_tile16(base, 3, 3, X33)
    _store_tile16(base, 1, 0, X10)
    _store_tile16(base, 2, 0, X20)
    _store_tile16(base, 2, 1, X21)
    _store_tile16(base, 3, 0, X30)
    _store_tile16(base, 3, 1, X31)
    _store_tile16(base, 3, 2, X32)


@triton.jit
def _intra_forward_kernel(
    q, k, v, g, b, w,  # inputs [B, T, H, K] / [B, T, H, V]
    G_out, qd_out, kd_out, Wk_out,  # [B, H, N * 64, K]
    Uw_out,  # [B, H, N * 64, V]
    gamma_out,  # [B, H, N, K] float32
    P_out, X_out,  # [B, H, N, 64, 64] float32
    T, H, K: tl.constexpr, V: tl.constexpr, N,
    BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    rows = tl.arange(0, 64)
    t = i_n * 64 + rows
    row_ok = t < T
    next_ok = (t + 1 < T) & (rows < 63)
    HK = H * K
    key_rows = i_b * T * HK + i_h * K + t[:, None] * HK  # + column
    padded = i_bh * N * 64 + i_n * 64 + rows[:, None]  # padded row of each token
    matrix = (i_bh * N + i_n) * 64 * 64 + rows[:, None] * 64 + rows[None, :]

    A = tl.zeros((64, 64), dtype=tl.float32)
    P = tl.zeros((64, 64), dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        col_ok = cols < K
        ok = row_ok[:, None] & col_ok[None, :]
        q_tile = tl.load(q + key_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        k_tile = tl.load(k + key_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        bk = tl.load(b + key_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32) * k_tile
        decay = tl.exp(tl.load(g + key_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32))
        decay_next = tl.exp(
            tl.load(g + key_rows + HK + cols[None, :], mask=next_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        )
        # Pairs i > j in the two halves of an aligned block of 2s rows: the decay from j to i is
        # (prefix of the upper half up to i) * (suffix of the lower half after j), both <= 1.
        for level in range(6):  # a runtime loop: one level's tiles live at a time
            shift = 5 - level  # segments of s = 2**shift rows; shifts and masks, no integer division
            segment = (rows >> shift)[:, None] + tl.zeros((64, BK), dtype=tl.int32)
            upper = ((rows >> shift) & 1) == 1
            last = (rows & ((1 << shift) - 1)) == (1 << shift) - 1
            prefix = _segment_prefix(decay, segment)
            suffix = _segment_suffix(tl.where(last[:, None], 1.0, decay_next), segment)
            left = tl.where(upper[:, None], prefix, 0.0)
            right = tl.where(upper[:, None], 0.0, k_tile * suffix)
            pair = ((rows[:, None] >> (shift + 1)) == (rows[None, :] >> (shift + 1))) & upper[:, None] & ~upper[None, :]
            A += tl.where(pair, tl.dot(bk * left, tl.trans(right), input_precision=DOT), 0.0)
            P += tl.where(pair, tl.dot(q_tile * left, tl.trans(right), input_precision=DOT), 0.0)
        P += tl.where(rows[:, None] == rows[None, :], tl.sum(q_tile * k_tile, 1)[:, None], 0.0)

        # Chunk-level decays: exp(G_i), exp(G_last - G_j) and gamma = exp(G_last).
        whole = tl.zeros((64, BK), dtype=tl.int32)
        to_here = _segment_prefix(decay, whole)
        to_end = _segment_suffix(tl.where((rows == 63)[:, None], 1.0, decay_next), whole)
        gamma = tl.reduce(decay, 0, _product)
        tl.store(gamma_out + (i_bh * N + i_n) * K + cols, gamma, mask=col_ok)
        out = padded * K + cols[None, :]
        out_ok = (rows >= 0)[:, None] & col_ok[None, :]
        G = tl.cumsum(tl.load(g + key_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32), 0)
        tl.store(G_out + out, G, mask=out_ok)
        tl.store(qd_out + out, (q_tile * to_here).to(qd_out.dtype.element_ty), mask=out_ok)
        tl.store(kd_out + out, (k_tile * to_end).to(kd_out.dtype.element_ty), mask=out_ok)
        tl.store(Wk_out + out, bk * to_here, mask=out_ok)  # b k exp(G), until X is known

    tl.store(P_out + matrix, P)
    tl.store(X_out + matrix, A)
    tl.debug_barrier()
    _invert_chunk_in_place(X_out + (i_bh * N + i_n) * 64 * 64)
    tl.debug_barrier()
    X = tl.load(X_out + matrix)

    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        out = padded * K + cols[None, :]
        out_ok = (rows >= 0)[:, None] & (cols < K)[None, :]
        bk_decayed = tl.load(Wk_out + out, mask=out_ok, other=0.0)
        tl.debug_barrier()  # read before overwritten (other threads store other elements)
        tl.store(Wk_out + out, tl.dot(X, bk_decayed, input_precision=DOT).to(Wk_out.dtype.element_ty), mask=out_ok)

    value_rows = i_b * T * H * V + i_h * V + t[:, None] * (H * V)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        col_ok = cols < V
        ok = row_ok[:, None] & col_ok[None, :]
        wv = tl.load(w + value_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32) * tl.load(
            v + value_rows + cols[None, :], mask=ok, other=0.0
        ).to(tl.float32)
        out_ok = (rows >= 0)[:, None] & col_ok[None, :]
        tl.store(Uw_out + padded * V + cols[None, :], tl.dot(X, wv, input_precision=DOT).to(Uw_out.dtype.element_ty),
                 mask=out_ok)


@triton.jit
def _product(a, b):
    return a * b


def intra_forward(q, k, v, g, b, w, G, qd, kd, Wk, Uw, gamma, P, X, dot_precision: str) -> None:
    """Launch the in-chunk kernel. Inputs ``[B, T, H, K|V]`` contiguous; outputs preallocated:
    ``G, qd, kd, Wk`` ``[B, H, N * 64, K]``, ``Uw`` ``[B, H, N * 64, V]``, ``gamma``
    ``[B, H, N, K]`` and ``P, X`` ``[B, H, N, 64, 64]``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = P.shape[2]
    BK = min(INTRA_FORWARD_KEY_BLOCK, max(16, triton.next_power_of_2(K)))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    _intra_forward_kernel[(N, B * H)](
        q, k, v, g, b, w, G, qd, kd, Wk, Uw, gamma, P, X, T, H, K, V, N,
        BK=BK, BV=BV, DOT=dot_precision, num_warps=INTRA_FORWARD_WARPS, num_stages=1,
    )


@triton.jit
def _state_forward_kernel(
    Wk, kd, Uw, gamma,  # [B, H, N * 64, K | K | V], [B, H, N, K]
    initial_state, states, U_out, final_state,  # [B, H, K, V], [B, H, N, K, V], [B, H, N * 64, V], [B, H, K, V]
    K: tl.constexpr, V: tl.constexpr, N,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr, DOT: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, 64)
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
        tl.store(states + (i_bh * N + i_n) * K * V + state_offsets, state.to(states.dtype.element_ty), mask=state_mask)
        row0 = i_bh * N * 64 + i_n * 64
        keys = (row0 + rows[:, None]) * K + cols_k[None, :]
        values = (row0 + rows[:, None]) * V + cols_v[None, :]
        Wk_tile = tl.load(Wk + keys, mask=k_ok[None, :], other=0.0)
        kd_tile = tl.load(kd + keys, mask=k_ok[None, :], other=0.0)
        decay = tl.load(gamma + (i_bh * N + i_n) * K + cols_k, mask=k_ok, other=0.0)
        U = tl.load(Uw + values, mask=v_ok[None, :], other=0.0).to(tl.float32)
        U -= tl.dot(Wk_tile, state.to(Wk_tile.dtype), input_precision=DOT)
        U = U.to(U_out.dtype.element_ty)
        tl.store(U_out + values, U, mask=v_ok[None, :])
        state = state * decay[:, None] + tl.dot(tl.trans(kd_tile), U, input_precision=DOT)
    if STORE_FINAL:
        tl.store(final_state + i_bh * K * V + state_offsets, state, mask=state_mask)


def value_block(V: int, programs_per_block: int) -> int:
    """Columns of V per program in the sequential passes: smaller blocks when there are few heads,
    so that the GPU has enough programs (at least about two per multiprocessor)."""
    block = min(64, max(16, triton.next_power_of_2(V)))
    while block > 16 and programs_per_block * triton.cdiv(V, block) < STATE_MIN_PROGRAMS:
        block //= 2
    return block


def state_forward(Wk, kd, Uw, gamma, initial_state, states, U, final_state, dot_precision: str) -> None:
    """Launch the sequential pass over chunks (writes ``states``, ``U`` and ``final_state``)."""
    B, H, N, K, V = states.shape
    BK = max(16, triton.next_power_of_2(K))
    BV = value_block(V, B * H)
    _state_forward_kernel[(triton.cdiv(V, BV), B * H)](
        Wk, kd, Uw, gamma,
        initial_state if initial_state is not None else states,
        states, U, final_state if final_state is not None else states,
        K, V, N, BK=BK, BV=BV,
        HAS_INITIAL=initial_state is not None, STORE_FINAL=final_state is not None, DOT=dot_precision,
        num_warps=STATE_WARPS, num_stages=1,
    )


@triton.jit
def _output_kernel(
    qd, P, states, U, o,  # [B, H, N * 64, K], [B, H, N, 64, 64], [B, H, N, K, V], [B, H, N * 64, V], [B, T, H, V]
    scale, T, H, K: tl.constexpr, V: tl.constexpr, N,
    BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    rows = tl.arange(0, 64)
    cols_v = i_v * BV + tl.arange(0, BV)
    v_ok = cols_v < V
    row0 = i_bh * N * 64 + i_n * 64
    U_tile = tl.load(U + (row0 + rows[:, None]) * V + cols_v[None, :], mask=v_ok[None, :], other=0.0)
    P_tile = tl.load(P + (i_bh * N + i_n) * 64 * 64 + rows[:, None] * 64 + rows[None, :])
    out = tl.dot(P_tile.to(U_tile.dtype), U_tile, input_precision=DOT)
    state_base = (i_bh * N + i_n) * K * V
    for k0 in range(0, K, BK):
        cols_k = k0 + tl.arange(0, BK)
        k_ok = cols_k < K
        qd_tile = tl.load(qd + (row0 + rows[:, None]) * K + cols_k[None, :], mask=k_ok[None, :], other=0.0)
        S = tl.load(states + state_base + cols_k[:, None] * V + cols_v[None, :], mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        out += tl.dot(qd_tile, S.to(qd_tile.dtype), input_precision=DOT)
    t = i_n * 64 + rows
    offsets = i_b * T * H * V + t[:, None] * (H * V) + i_h * V + cols_v[None, :]
    tl.store(o + offsets, (out * scale).to(o.dtype.element_ty), mask=(t < T)[:, None] & v_ok[None, :])


def output(qd, P, states, U, o, scale: float, dot_precision: str) -> None:
    """Launch the output kernel (writes ``o`` ``[B, T, H, V]``)."""
    B, T, H, V = o.shape
    N, K = states.shape[2], states.shape[3]
    BK = min(64, max(16, triton.next_power_of_2(K)))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    _output_kernel[(triton.cdiv(V, BV), N, B * H)](
        qd, P, states, U, o, scale, T, H, K, V, N,
        BK=BK, BV=BV, DOT=dot_precision, num_warps=OUTPUT_WARPS, num_stages=1,
    )
