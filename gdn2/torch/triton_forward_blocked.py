"""A key-blocked variant of ``intra_forward`` (opt-in: ``TUNING["intra_forward_blocked"] = True``).

Same mathematics and outputs as ``triton_forward._intra_forward_kernel``, with every key-sized tile
[64, BKB] (a loop over blocks of ``BKB`` key columns) instead of [64, K], so that far fewer
registers are live (the first version uses 255 registers and spills). ``A`` and ``P`` accumulate
over the key blocks in registers; ``G`` is written per block and read back for ``Wk``.

Not yet run on a GPU (written after the session's device time was spent): verified under the
Triton interpreter against the spec; compiled for sm_90a here for shared memory and spills.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_forward import CHUNK, TUNING, _invert_chunk_in_place


@triton.jit
def _intra_forward_blocked_kernel(
    q, k, v, g, b, w,  # inputs [B, T, H, K] / [B, T, H, V]
    G_out, Wk_out, Uw_out,  # [B, H, N * C, K | K | V] float32
    P_out, inverse_out,  # [B, H, N, C, C] float32
    T, H, K: tl.constexpr, V: tl.constexpr, N,
    BKB: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    rows = tl.arange(0, C)
    cols_c = tl.arange(0, C)
    t = i_n * C + rows
    row_ok = t < T
    key_in = i_b * T * H * K + i_h * K

    A = tl.zeros((C, C), dtype=tl.float32)
    P = tl.zeros((C, C), dtype=tl.float32)
    for k0 in range(0, K, BKB):
        cols_k = k0 + tl.arange(0, BKB)
        k_ok = cols_k < K
        key_offsets = key_in + t[:, None] * (H * K) + cols_k[None, :]
        mask = row_ok[:, None] & k_ok[None, :]
        G = tl.cumsum(tl.load(g + key_offsets, mask=mask, other=0.0).to(tl.float32), 0)
        padded = i_bh * N * C * K + (i_n * C + rows[:, None]) * K + cols_k[None, :]
        tl.store(G_out + padded, G, mask=k_ok[None, :])
        q_tile = tl.load(q + key_offsets, mask=mask, other=0.0).to(tl.float32)
        k_tile = tl.load(k + key_offsets, mask=mask, other=0.0).to(tl.float32)
        bk = tl.load(b + key_offsets, mask=mask, other=0.0).to(tl.float32) * k_tile
        # off-diagonal 16x16 blocks through the anchor row 16 I - 1 (exponents <= 0)
        for I in range(1, C // 16):
            anchor = tl.sum(tl.where(rows[:, None] == I * 16 - 1, G, 0.0), 0)
            in_block = (rows >= I * 16) & (rows < I * 16 + 16)
            before = rows < I * 16
            left = tl.exp(tl.where(in_block[:, None], G - anchor[None, :], float("-inf")))
            right_k = k_tile * tl.exp(tl.where(before[:, None], anchor[None, :] - G, float("-inf")))
            A += tl.dot(bk * left, tl.trans(right_k), input_precision=DOT)
            P += tl.dot(q_tile * left, tl.trans(right_k), input_precision=DOT)
        # diagonal 16x16 blocks by offset d, decays from window sums of g
        window = tl.zeros((C, BKB), dtype=tl.float32)
        for d in range(0, 16):
            if d > 0:
                window += tl.load(
                    g + key_offsets - (d - 1) * (H * K), mask=mask & (rows[:, None] >= d - 1), other=0.0
                ).to(tl.float32)
            same_block = (rows % 16) >= d
            decay = tl.exp(tl.where(same_block[:, None], window, float("-inf")))
            k_before = tl.load(k + key_offsets - d * (H * K), mask=mask & same_block[:, None], other=0.0).to(tl.float32)
            k_decayed = k_before * decay
            on_diagonal = cols_c[None, :] == rows[:, None] - d
            P += tl.where(on_diagonal, tl.sum(q_tile * k_decayed, 1)[:, None], 0.0)
            if d > 0:
                A += tl.where(on_diagonal, tl.sum(bk * k_decayed, 1)[:, None], 0.0)

    chunk_matrix = (i_bh * N + i_n) * C * C + rows[:, None] * C + cols_c[None, :]
    tl.store(P_out + chunk_matrix, P)
    tl.store(inverse_out + chunk_matrix, A)
    tl.debug_barrier()
    _invert_chunk_in_place(inverse_out + (i_bh * N + i_n) * C * C, C)
    tl.debug_barrier()
    inverse = tl.load(inverse_out + chunk_matrix)

    for k0 in range(0, K, BKB):
        cols_k = k0 + tl.arange(0, BKB)
        k_ok = cols_k < K
        key_offsets = key_in + t[:, None] * (H * K) + cols_k[None, :]
        mask = row_ok[:, None] & k_ok[None, :]
        padded = i_bh * N * C * K + (i_n * C + rows[:, None]) * K + cols_k[None, :]
        G = tl.load(G_out + padded, mask=k_ok[None, :], other=0.0)
        bk_decayed = (
            tl.load(b + key_offsets, mask=mask, other=0.0).to(tl.float32)
            * tl.load(k + key_offsets, mask=mask, other=0.0).to(tl.float32)
            * tl.exp(G)
        )
        tl.store(Wk_out + padded, tl.dot(inverse, bk_decayed, input_precision=DOT), mask=k_ok[None, :])
    value_in = i_b * T * H * V + i_h * V
    for v0 in range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        v_mask = row_ok[:, None] & (cols_v < V)[None, :]
        value_offsets = value_in + t[:, None] * (H * V) + cols_v[None, :]
        wv = tl.load(w + value_offsets, mask=v_mask, other=0.0).to(tl.float32) * tl.load(
            v + value_offsets, mask=v_mask, other=0.0
        ).to(tl.float32)
        tl.store(
            Uw_out + i_bh * N * C * V + (i_n * C + rows[:, None]) * V + cols_v[None, :],
            tl.dot(inverse, wv, input_precision=DOT),
            mask=(cols_v < V)[None, :],
        )


def intra_forward_blocked(q, k, v, g, b, w, G, Wk, Uw, P, inverse, dot_precision: str) -> None:
    """Launch the key-blocked in-chunk kernel (same arguments and outputs as ``intra_forward``)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = P.shape[2]
    BKB = min(TUNING.get("blocked_key_block", 16), max(16, triton.next_power_of_2(K)))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    _intra_forward_blocked_kernel[(N, B * H)](
        q, k, v, g, b, w, G, Wk, Uw, P, inverse, T, H, K, V, N,
        BKB=BKB, BV=BV, C=CHUNK, DOT=dot_precision, num_warps=TUNING["intra_forward_warps"], num_stages=1,
    )
