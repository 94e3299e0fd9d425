"""Triton backward kernels of the chunked GDN-2 form: the exact adjoint of ``forward.py``
(the equations are those of ``gdn2.algorithm.backward``). Four steps:

* ``state_backward`` (one program per head and block of value columns, reverse over chunks):
  the gradient of the state leaving each chunk, ``d_leaving``, and the full gradient of the new
  values ``d_U = scale P^T dO + kd d_leaving``; finally the gradient of the initial state. It
  reads the decayed queries and keys and ``gamma`` that the forward saved (no exponentials here),
  and holds the state's gradient in blocks of key rows; with bfloat16 buffers at K <= 128 its
  products take bfloat16 operands (``STATE_BACKWARD_ROUNDED``).
* ``intra_backward_contract`` (chunk x head x block of key columns): the state-sized contractions
  ``d_qd = scale dO S^T``, ``d_kd = U d_leaving^T``, ``d_bkd = -X^T (dU S^T)`` and ``d_gamma``.
* ``intra_backward_values`` (chunk x head): ``dP = scale dO U^T``, ``d(wv) = X^T dU`` (dv, dw) and
  ``dA = -(d(wv) Uw^T + d_bkd Wk^T)``; dA and dP go to memory, where the key launch reads rows,
  columns and 16x16 tiles of them.
* ``intra_backward_keys`` (16-row sub-block x head x block of key columns, then chunk x head x
  block of key columns): the WY adjoint and the adjoints of the gated bilinear forms ``A`` and
  ``P`` (span sums through the row before a sub-block off the diagonal, products of per-step
  decays inside it), then dg's sums over the chunk. P's diagonal and the k-to-end and gamma terms
  go straight to dq, dk and dg (they cancel in dG only to rounding). The pairs inside a sub-block
  go one row (keys' side) and one column (rows' side) per step, in one loop, each step's rows
  loaded one step ahead: a step's arithmetic is short, and without the prefetch each step waits
  for its own loads (H200: 13.20 ms forward+backward with two loops and no prefetch, 12.36 so).
  Every pair at once as [16, 16, key block] tensors, or in two or four pieces of rows, took half
  the instructions and made forward+backward 1.1x to 1.5x slower (bench/RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .forward import (CHUNK, _chunk_matrix, _chunk_span, _exclusive_suffix, _exp, _load_chunk_matrix,
                      _load_chunk_matrix_transposed, _load_uw, _sequence_chunks, _shared_per_block, _split_dot, _table,
                      chunk_value_block, register_cap, value_block)


# The reverse state pass: programs of STATE_BACKWARD_WARPS warps, the state's gradient in blocks of
# STATE_BACKWARD_KEY_BLOCK key rows (STATE_BACKWARD_ROUNDED_KEY_BLOCK in the rounded form, below),
# value blocks shrunk until there are STATE_BACKWARD_MIN_PROGRAMS programs. sm_90a, Triton 3.6
# (bench/kernel_resources.py, bf16 buffers, K = V = 128): the TF32 loop in one block of 128 rows
# takes 1,293 instructions a chunk and 376 B of spills (blocks of 64: more spills); at K = 256 one block
# needs 128 KiB of shared memory (one program a multiprocessor), two blocks of 128 the 112 KiB of
# the form before (two) with 2,892 instructions a chunk against 3,225. 128 programs at least, not
# 256: at B=2 H=16 K=V=128 the rounded loop (one program a multiprocessor) then takes 32 value
# columns a program in one wave instead of 16 in two (H100 2026-12-06: the pass 1.128 -> 0.722 ms,
# bit-identical; the value blocks at the other two benchmark shapes unchanged).
STATE_BACKWARD_WARPS = 4
STATE_BACKWARD_KEY_BLOCK = 128
STATE_BACKWARD_MIN_PROGRAMS = 128
# Every product of the loop on bfloat16 operands where qd, kd, Wk and dO are bfloat16 and K <=
# STATE_BACKWARD_ROUNDED_MAX_K (qd^T, Wk^T and P^T read transposed from memory; dU rounded for
# its products; the state's gradient split into two bfloat16 parts for kd dS,
# STATE_BACKWARD_SPLIT_DS), in blocks of 64 key rows loading chunks ahead (below). sm_90a, K = V =
# 128, one chunk ahead: 1,170 instructions a chunk against the TF32 loop's 1,293, 28 B of spills
# against 376, 152.5 KiB of shared memory (one program a multiprocessor, as
# flash-linear-attention's pass). H100
# (2026-12-06, three processes, bench/RESULTS.md): the pass 0.739 -> 0.499 ms at B=8 T=4096 H=16
# K=V=128, forward+backward 8.39 -> 8.15 ms there and 8.00 -> 7.88 at B=16 T=2048 H=32 K=V=64;
# the gradients within 2e-3 of the TF32 loop's at 16, 32 and 64 value columns, every bit
# repeated, every check shape right. The state's gradient rounded once instead (SPLIT_DS off;
# H200: the pass 0.43 ms) raised the worst bfloat16 gradient error above
# flash-linear-attention's at one of 18 CPU draws (db 1.36e-2 against 8.75e-3; split 7.82e-3, the
# TF32 loop 8.16e-3) and on the GPU (1.26e-2 against the split form's 7.82e-3 on one draw). At
# K = 256 (four blocks of 64 rows) the split form made an illegal memory access (H100, Triton
# 3.6): the TF32 loop runs there. Off, or with float32 buffers: the loop's products in TF32.
STATE_BACKWARD_ROUNDED = True
STATE_BACKWARD_SPLIT_DS = True
STATE_BACKWARD_ROUNDED_MAX_K = 128
STATE_BACKWARD_ROUNDED_KEY_BLOCK = 64
# Chunks whose loads Triton issues ahead (asynchronous copies to shared memory; 1: none), where
# ``state_backward_stages`` allows it: bfloat16 saved buffers, at K <= STATE_BACKWARD_MAX_STAGED_K
# in the TF32 loop and K <= STATE_BACKWARD_ROUNDED_MAX_STAGED_K in the rounded one. The TF32 loop
# at K = 64, H200: forward+backward at B=16 T=2048 H=32 K=V=64 8.160 -> 8.113 ms (2026-12-05) and
# 7.586 -> 7.547 (a later run), results bit-identical to the loop without loads ahead at 16, 32
# and 64 value columns, K = 48 and 64, packed sequences too (bench/RESULTS.md). At K = 128 it
# lost: one block of 128 key rows takes 120.5 KiB of shared memory (one program a
# multiprocessor: 8.554 -> 9.215 ms at B=8 T=4096 H=16), two blocks of 64 spill 516 B (8.656).
# The rounded loop loads two chunks ahead (STATE_BACKWARD_ROUNDED_STAGES; sm_90a at K = V = 128:
# 217 KiB of shared memory against 152.5, 32 B of spills against 24). H100 (2026-12-06), against
# one chunk ahead, bit-identical: the pass 0.483 -> 0.399 ms at B=8 T=4096 H=16 K=V=128, 0.715 ->
# 0.483 at B=2 T=16384, 0.357 -> 0.354 at B=16 T=2048 H=32 K=V=64. The TF32 loop stays at one
# (two ahead at K = 64: 184 B of spills against none). Two ahead only on devices whose blocks may
# take STATE_BACKWARD_ROUNDED_STAGES_SHARED bytes (the H100 and H200 227 KiB; an A100 163 KiB,
# an RTX 4090 or L40 99 KiB: one chunk ahead there, else the launch could not start). Compiled
# for those (bench/kernel_resources.py --arch 80 / 86 / 89 / 120, Triton 3.6), every launch fits
# at K = V = 64, 128 and 256 with either input dtype, the widest the reverse pass at one chunk
# ahead (88.5 KiB at K = V = 128; two ahead on sm_89: 153 KiB); not run on such a GPU.
STATE_BACKWARD_STAGES = 2
STATE_BACKWARD_ROUNDED_STAGES = 3
STATE_BACKWARD_ROUNDED_STAGES_SHARED = 217 * 1024
STATE_BACKWARD_MAX_STAGED_K = 64
STATE_BACKWARD_ROUNDED_MAX_STAGED_K = 128
# Tried on the H200 (bench/RESULTS.md) and removed: products on bfloat16 operands beside TF32 ones
# in the loop (dU, P or the state's gradient rounded, or dS split in two bfloat16 parts) ended in
# an illegal memory access or non-finite results (Triton 3.6), with or without loads ahead; the
# loads a chunk ahead on float32 saved buffers gave non-finite results; L2 prefetches of the next
# chunk (``prefetch.global.L2``) made it slower. Every product on bfloat16 operands ran right at
# K <= 128 (STATE_BACKWARD_ROUNDED).


@triton.jit
def _state_rows(state, b: tl.constexpr, KB: tl.constexpr, K: tl.constexpr, V: tl.constexpr, cols_v, v_ok):
    """Key rows ``b KB .. (b + 1) KB`` of a [K, V] float32 state (``state`` at its first entry)."""
    cols_k = b * KB + tl.arange(0, KB)
    return tl.load(state + cols_k[:, None] * V + cols_v[None, :], mask=(cols_k < K)[:, None] & v_ok[None, :], other=0.0)


@triton.jit
def _store_state_rows(state, b: tl.constexpr, KB: tl.constexpr, K: tl.constexpr, V: tl.constexpr, cols_v, v_ok, rows):
    cols_k = b * KB + tl.arange(0, KB)
    tl.store(state + cols_k[:, None] * V + cols_v[None, :], rows.to(state.dtype.element_ty),
             mask=(cols_k < K)[:, None] & v_ok[None, :])


@triton.jit
def _key_columns(x, row0, b: tl.constexpr, KB: tl.constexpr, K: tl.constexpr):
    """Key columns ``b KB .. (b + 1) KB`` of a chunk's 64 rows of a ``[.., N * 64, K]`` buffer
    (``row0``: the chunk's first row), as stored."""
    rows = tl.arange(0, 64)
    cols_k = b * KB + tl.arange(0, KB)
    return tl.load(x + (row0 + rows[:, None]) * K + cols_k[None, :], mask=(cols_k < K)[None, :], other=0.0)


@triton.jit
def _store_state_blocks(state, d0, d1, d2, d3, BLOCKS: tl.constexpr, KB: tl.constexpr, K: tl.constexpr,
                        V: tl.constexpr, cols_v, v_ok):
    """Store the first BLOCKS of the blocks of key rows ``d0`` .. ``d3`` of a [K, V] state."""
    _store_state_rows(state, 0, KB, K, V, cols_v, v_ok, d0)
    if BLOCKS > 1:
        _store_state_rows(state, 1, KB, K, V, cols_v, v_ok, d1)
    if BLOCKS > 2:
        _store_state_rows(state, 2, KB, K, V, cols_v, v_ok, d2)
        _store_state_rows(state, 3, KB, K, V, cols_v, v_ok, d3)


@triton.jit
def _key_rows(x, row0, b: tl.constexpr, KB: tl.constexpr, K: tl.constexpr):
    """``_key_columns`` transposed, read so from memory ([KB, 64]): a bfloat16 tensor-core
    operand then reaches shared memory as it is read, with no transpose in registers."""
    rows = tl.arange(0, 64)
    cols_k = b * KB + tl.arange(0, KB)
    return tl.load(x + (row0 + rows[None, :]) * K + cols_k[:, None], mask=(cols_k < K)[:, None], other=0.0)


@triton.jit
def _decays(gamma, chunk, b: tl.constexpr, KB: tl.constexpr, K: tl.constexpr):
    cols_k = b * KB + tl.arange(0, KB)
    return tl.load(gamma + chunk * K + cols_k, mask=cols_k < K, other=0.0)


@triton.jit
def _add_kd_times_dS(kd_tile, d_state, dU, DOT: tl.constexpr):
    """``dU + kd dS`` for one block of key columns of kd (as stored, widened) and rows of dS."""
    return tl.dot(kd_tile.to(tl.float32), d_state, dU, input_precision=DOT)


@triton.jit
def _add_kd_times_dS_bfloat16(kd_tile, d_state, dU, SPLIT: tl.constexpr):
    """``dU + kd dS`` on bfloat16 operands: kd as stored, dS in two bfloat16 parts (``SPLIT``:
    ``_split_dot``) or rounded once (flash-linear-attention's product)."""
    if SPLIT:
        return _split_dot(kd_tile, d_state, dU)
    return tl.dot(kd_tile, d_state.to(kd_tile.dtype), dU)


@triton.jit
def _entering_gradient_rounded(d_state, decay, qd_rows, Wk_rows, d_o_tile, dU_rounded, scale):
    """``_entering_gradient`` on bfloat16 operands: qd^T and Wk^T as read (``_key_rows``), dO as
    stored (the scale on the product), dU rounded."""
    return (d_state * decay[:, None] + tl.dot(qd_rows, d_o_tile) * scale - tl.dot(Wk_rows, dU_rounded))


@triton.jit
def _entering_gradient(d_state, decay, qd_tile, Wk_tile, d_out, dU, DOT: tl.constexpr):
    """Key rows of the gradient of the state entering a chunk: ``gamma dS + qd^T dO - Wk^T dU``
    (``d_out``: dO scaled, float32)."""
    return (d_state * decay[:, None] + tl.dot(tl.trans(qd_tile.to(tl.float32)), d_out, input_precision=DOT)
            - tl.dot(tl.trans(Wk_tile.to(tl.float32)), dU, input_precision=DOT))


@triton.jit
def _state_backward_kernel(
    qd, kd, Wk, gamma, P, d_o,  # [B, H, N * 64, K] x3, [B, H, N, K], [B, H, N, 10, 16, 16], [B, T, H, V]
    d_final, d_leaving, d_U, d_initial,  # [B, H, K, V], [B, H, N, K, V], [B, H, N * 64, V], [B, H, K, V]
    chunk_table, sequence_chunks, scale, T, H, K: tl.constexpr, V: tl.constexpr, N,
    KB: tl.constexpr, BV: tl.constexpr,
    HAS_FINAL: tl.constexpr, STORE_INITIAL: tl.constexpr, DOT: tl.constexpr, PACKED: tl.constexpr,
    STAGES: tl.constexpr, LOCAL_DU: tl.constexpr, ROUNDED: tl.constexpr, SPLIT_DS: tl.constexpr,
):
    """The state's gradient as up to four blocks of KB key rows (``d0`` .. ``d3``, as many as K
    needs), each block's [64, KB] tiles of kd, qd and Wk read where they are used."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)  # the state's row: batch row (or sequence) and head
    chunk_first, chunk_end, head = _sequence_chunks(sequence_chunks, i_bh, H, N, PACKED)
    i_b = i_bh // H
    if PACKED:
        i_b = i_b * 0  # packed tokens are one batch row
    i_h = i_bh % H
    BLOCKS: tl.constexpr = (K + KB - 1) // KB  # 1, 2 or 4
    rows = tl.arange(0, 64)
    cols_v = i_v * BV + tl.arange(0, BV)
    v_ok = cols_v < V
    d0 = tl.zeros((KB, BV), dtype=tl.float32)
    d1 = tl.zeros((KB, BV), dtype=tl.float32)
    d2 = tl.zeros((KB, BV), dtype=tl.float32)
    d3 = tl.zeros((KB, BV), dtype=tl.float32)
    if HAS_FINAL:
        d0 = _state_rows(d_final + i_bh * K * V, 0, KB, K, V, cols_v, v_ok)
        if BLOCKS > 1:
            d1 = _state_rows(d_final + i_bh * K * V, 1, KB, K, V, cols_v, v_ok)
        if BLOCKS > 2:
            d2 = _state_rows(d_final + i_bh * K * V, 2, KB, K, V, cols_v, v_ok)
            d3 = _state_rows(d_final + i_bh * K * V, 3, KB, K, V, cols_v, v_ok)
    for step in tl.range(0, chunk_end - chunk_first, num_stages=STAGES):
        i_n = chunk_end - 1 - step
        chunk = head * N + i_n
        first, end = _chunk_span(chunk_table, i_n, T, PACKED)
        t = first + rows
        row0 = chunk * 64
        leaving = d_leaving + chunk * K * V
        _store_state_blocks(leaving, d0, d1, d2, d3, BLOCKS, KB, K, V, cols_v, v_ok)
        value_offsets = i_b * T * H * V + t[:, None] * (H * V) + i_h * V + cols_v[None, :]
        d_o_tile = tl.load(d_o + value_offsets, mask=(t < end)[:, None] & v_ok[None, :], other=0.0)
        d_out = d_o_tile.to(tl.float32) * scale
        if ROUNDED and not LOCAL_DU:  # P^T as read (float32 as stored), rounded for its product
            P_rows = _load_chunk_matrix_transposed(_chunk_matrix(P, chunk)).to(d_o_tile.dtype)
        elif not LOCAL_DU:
            P_tile = _load_chunk_matrix(_chunk_matrix(P, chunk))
        kd0 = _key_columns(kd, row0, 0, KB, K)
        if BLOCKS > 1:
            kd1 = _key_columns(kd, row0, 1, KB, K)
        if BLOCKS > 2:
            kd2 = _key_columns(kd, row0, 2, KB, K)
            kd3 = _key_columns(kd, row0, 3, KB, K)
        if LOCAL_DU:  # scale P^T dO is in d_U already (_local_values_gradient_kernel)
            dU = tl.load(d_U + (row0 + rows[:, None]) * V + cols_v[None, :], mask=v_ok[None, :], other=0.0).to(tl.float32)
        elif ROUNDED:
            dU = tl.dot(P_rows, d_o_tile) * scale
        else:
            dU = tl.dot(tl.trans(P_tile), d_out, input_precision=DOT)
        if ROUNDED:
            dU = _add_kd_times_dS_bfloat16(kd0, d0, dU, SPLIT_DS)
            if BLOCKS > 1:
                dU = _add_kd_times_dS_bfloat16(kd1, d1, dU, SPLIT_DS)
            if BLOCKS > 2:
                dU = _add_kd_times_dS_bfloat16(kd2, d2, dU, SPLIT_DS)
                dU = _add_kd_times_dS_bfloat16(kd3, d3, dU, SPLIT_DS)
        else:
            dU = _add_kd_times_dS(kd0, d0, dU, DOT)
            if BLOCKS > 1:
                dU = _add_kd_times_dS(kd1, d1, dU, DOT)
            if BLOCKS > 2:
                dU = _add_kd_times_dS(kd2, d2, dU, DOT)
                dU = _add_kd_times_dS(kd3, d3, dU, DOT)
        tl.store(d_U + (row0 + rows[:, None]) * V + cols_v[None, :], dU.to(d_U.dtype.element_ty), mask=v_ok[None, :])
        if ROUNDED:  # dO bfloat16 as stored (the launch asks for it)
            dU_rounded = dU.to(qd.dtype.element_ty)
            d0 = _entering_gradient_rounded(d0, _decays(gamma, chunk, 0, KB, K), _key_rows(qd, row0, 0, KB, K),
                                            _key_rows(Wk, row0, 0, KB, K), d_o_tile, dU_rounded, scale)
            if BLOCKS > 1:
                d1 = _entering_gradient_rounded(d1, _decays(gamma, chunk, 1, KB, K), _key_rows(qd, row0, 1, KB, K),
                                                _key_rows(Wk, row0, 1, KB, K), d_o_tile, dU_rounded, scale)
            if BLOCKS > 2:
                d2 = _entering_gradient_rounded(d2, _decays(gamma, chunk, 2, KB, K), _key_rows(qd, row0, 2, KB, K),
                                                _key_rows(Wk, row0, 2, KB, K), d_o_tile, dU_rounded, scale)
                d3 = _entering_gradient_rounded(d3, _decays(gamma, chunk, 3, KB, K), _key_rows(qd, row0, 3, KB, K),
                                                _key_rows(Wk, row0, 3, KB, K), d_o_tile, dU_rounded, scale)
        else:
            qd0, Wk0 = _key_columns(qd, row0, 0, KB, K), _key_columns(Wk, row0, 0, KB, K)
            if BLOCKS > 1:
                qd1, Wk1 = _key_columns(qd, row0, 1, KB, K), _key_columns(Wk, row0, 1, KB, K)
            if BLOCKS > 2:
                qd2, Wk2 = _key_columns(qd, row0, 2, KB, K), _key_columns(Wk, row0, 2, KB, K)
                qd3, Wk3 = _key_columns(qd, row0, 3, KB, K), _key_columns(Wk, row0, 3, KB, K)
            d0 = _entering_gradient(d0, _decays(gamma, chunk, 0, KB, K), qd0, Wk0, d_out, dU, DOT)
            if BLOCKS > 1:
                d1 = _entering_gradient(d1, _decays(gamma, chunk, 1, KB, K), qd1, Wk1, d_out, dU, DOT)
            if BLOCKS > 2:
                d2 = _entering_gradient(d2, _decays(gamma, chunk, 2, KB, K), qd2, Wk2, d_out, dU, DOT)
                d3 = _entering_gradient(d3, _decays(gamma, chunk, 3, KB, K), qd3, Wk3, d_out, dU, DOT)
    if STORE_INITIAL:
        _store_state_blocks(d_initial + i_bh * K * V, d0, d1, d2, d3, BLOCKS, KB, K, V, cols_v, v_ok)


@triton.jit
def _local_values_gradient_kernel(
    P, d_o, d_U,  # [B, H, N, 10, 16, 16], [B, T, H, V], [B, H, N * 64, V] (written)
    chunk_table, scale, T, H, V: tl.constexpr, N, BV: tl.constexpr, DOT: tl.constexpr, PACKED: tl.constexpr,
):
    """The in-chunk part of d_U, ``scale P^T dO``, of one chunk, head and block of value columns,
    for the reverse state pass to add ``kd d_leaving`` to (``STATE_BACKWARD_LOCAL_DU``)."""
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    rows = tl.arange(0, 64)
    cols_v = i_v * BV + tl.arange(0, BV)
    v_ok = cols_v < V
    first, end = _chunk_span(chunk_table, i_n, T, PACKED)
    t = first + rows
    d_out = tl.load(d_o + i_b * T * H * V + t[:, None] * (H * V) + i_h * V + cols_v[None, :],
                    mask=(t < end)[:, None] & v_ok[None, :], other=0.0).to(tl.float32) * scale
    P_tile = _load_chunk_matrix(_chunk_matrix(P, i_bh * N + i_n))
    local = tl.dot(tl.trans(P_tile), d_out, input_precision=DOT)
    tl.store(d_U + (i_bh * N * 64 + i_n * 64 + rows[:, None]) * V + cols_v[None, :], local.to(d_U.dtype.element_ty),
             mask=v_ok[None, :])


# A variant to time (off): scale P^T dO made by a parallel launch before the reverse pass, which
# then reads it from d_U in place of P and dO's product (as flash-linear-attention's pass takes its
# dv). H100 (2026-12-05): with the rounded loop the pass 0.743 -> 0.503 ms, but the launch took
# 0.23 ms: forward+backward unchanged.
STATE_BACKWARD_LOCAL_DU = False


def state_backward(qd, kd, Wk, gamma, P, d_o, d_final, d_leaving, d_U, d_initial, scale: float, dot_precision: str,
                   chunk_table=None, sequence_chunks=None) -> None:
    """Launch the reverse pass over chunks (writes ``d_leaving``, ``d_U`` and ``d_initial``), one
    program per state row (batch row, or sequence with packed sequences) and head; with
    ``STATE_BACKWARD_LOCAL_DU``, ``_local_values_gradient_kernel`` before it."""
    B, T, H, V = d_o.shape
    N, K = d_leaving.shape[2], d_leaving.shape[3]
    if STATE_BACKWARD_LOCAL_DU:
        block = chunk_value_block(V)
        _local_values_gradient_kernel[(triton.cdiv(V, block), N, B * H)](
            P, d_o, d_U, _table(chunk_table, d_o), scale, T, H, V, N, BV=block, DOT=dot_precision,
            PACKED=chunk_table is not None, num_warps=4, num_stages=1, **register_cap("local_values_gradient"),
        )
    rows = B if sequence_chunks is None else sequence_chunks.shape[0] - 1
    bfloat16 = qd.dtype == kd.dtype == Wk.dtype == torch.bfloat16
    rounded = state_backward_rounded(bfloat16, d_o.dtype, K, N)
    KB = state_backward_key_block(K, rounded)
    BV = value_block(V, rows * H, STATE_BACKWARD_MIN_PROGRAMS)
    _state_backward_kernel[(triton.cdiv(V, BV), rows * H)](
        qd, kd, Wk, gamma, P, d_o,
        d_final if d_final is not None else d_leaving, d_leaving, d_U,
        d_initial if d_initial is not None else d_leaving,
        _table(chunk_table, d_o), _table(sequence_chunks, d_o), scale, T, H, K, V, N, KB=KB, BV=BV,
        HAS_FINAL=d_final is not None, STORE_INITIAL=d_initial is not None, DOT=dot_precision,
        PACKED=chunk_table is not None,
        STAGES=state_backward_stages(K, N, bfloat16, rounded, _shared_per_block(d_o.device)),
        LOCAL_DU=STATE_BACKWARD_LOCAL_DU, ROUNDED=rounded, SPLIT_DS=STATE_BACKWARD_SPLIT_DS,
        num_warps=STATE_BACKWARD_WARPS, num_stages=1, **register_cap("state_backward"),
    )


def state_backward_rounded(bfloat16: bool, d_o_dtype: torch.dtype, K: int, N: int) -> bool:
    """Whether the reverse pass runs its products on bfloat16 operands (``STATE_BACKWARD_ROUNDED``):
    qd, kd and Wk saved in bfloat16 (``bfloat16``), dO bfloat16, K <=
    ``STATE_BACKWARD_ROUNDED_MAX_K``, and only with its loads a chunk ahead
    (``state_backward_stages``), as the state forward's split products. Without them (over one
    chunk: Triton makes N = 1 a constant) Triton 3.6 builds the rounded loop wrong for the H100:
    gradients whose bits change between calls at B=1 T=1 H=2 K=48 V=80 and an illegal memory
    access at T=64 K=V=128 (bench/RESULTS.md), where the TF32 loop is right."""
    return (STATE_BACKWARD_ROUNDED and bfloat16 and d_o_dtype == torch.bfloat16 and K <= STATE_BACKWARD_ROUNDED_MAX_K
            and state_backward_stages(K, N, bfloat16, rounded=True) > 1)


def state_backward_stages(K: int, N: int, bfloat16: bool, rounded: bool, shared_per_block: int | None = None) -> int:
    """The reverse pass's ``STAGES``: loads chunks ahead (``STATE_BACKWARD_STAGES``,
    ``STATE_BACKWARD_ROUNDED_STAGES`` in the rounded loop) only with
    qd, kd and Wk saved in bfloat16 (with float32 buffers Triton 3.6 builds the loop wrong for the
    H200: non-finite results), at K <= ``STATE_BACKWARD_MAX_STAGED_K`` in the TF32 loop (above, it
    was slower) or ``STATE_BACKWARD_ROUNDED_MAX_STAGED_K`` in the rounded one (``rounded``), and
    over more than one chunk (Triton makes N = 1 a constant: nothing to load ahead). The rounded
    loop takes at most two stages (one chunk ahead) where ``shared_per_block``, the bytes of shared
    memory a block may take on the device (None: no limit, as under the interpreter), is below
    ``STATE_BACKWARD_ROUNDED_STAGES_SHARED``."""
    most = STATE_BACKWARD_ROUNDED_MAX_STAGED_K if rounded else STATE_BACKWARD_MAX_STAGED_K
    stages = STATE_BACKWARD_ROUNDED_STAGES if rounded else STATE_BACKWARD_STAGES
    if rounded and shared_per_block is not None and shared_per_block < STATE_BACKWARD_ROUNDED_STAGES_SHARED:
        stages = min(stages, 2)
    return stages if bfloat16 and K <= most and N > 1 else 1


def state_backward_key_block(K: int, rounded: bool) -> int:
    """Key rows of the state per block in the reverse pass (``STATE_BACKWARD_KEY_BLOCK``, or
    ``STATE_BACKWARD_ROUNDED_KEY_BLOCK`` in the rounded loop; at most the padded K; four blocks at
    most)."""
    setting = STATE_BACKWARD_ROUNDED_KEY_BLOCK if rounded else STATE_BACKWARD_KEY_BLOCK
    BK = max(16, triton.next_power_of_2(K))
    KB = min(setting, BK)
    if BK > 4 * KB:
        name = "STATE_BACKWARD_ROUNDED_KEY_BLOCK" if rounded else "STATE_BACKWARD_KEY_BLOCK"
        raise ValueError(f"{name}: expected at least {BK // 4} for K={K}, received {setting}")
    return KB


# Launch settings measured on an H200 (bench/RESULTS.md): 32 key columns per block (16 was
# slower); 8 warps (16 faulted with Triton 3.6).
INTRA_BACKWARD_KEY_BLOCK = 32
INTRA_BACKWARD_VALUE_BLOCK = 32
INTRA_BACKWARD_WARPS = 8
INTRA_BACKWARD_KEYS_WARPS = 2  # more of each tile a thread: 9.636 -> 8.762 ms forward+backward (MAX_REGISTERS)
INTRA_BACKWARD_KEYS_BLOCK = 32  # key columns per program of the keys launch (64 was slower)
# Loop steps whose loads Triton issues this many steps ahead, as asynchronous copies to shared
# memory (1: none): the contraction's and the value launch's value (and key) blocks, the keys
# launch's loops over the other sub-blocks (H200, forward+backward ms).
CONTRACT_STAGES = 3  # 10.876 -> 10.656 (2: 10.861); float32 states: CONTRACT_FLOAT32_STAGES
VALUES_STAGES = 2  # 10.876 -> 10.802 (3: 10.650 against 10.523)
KEYS_STAGES = 2  # 10.532 -> 10.476
# The contraction and value launches' products whose operands are both bfloat16 as stored (the
# saved states and U, dO, and d_leaving and d_U with GRADIENTS_IN_BFLOAT16) on them as stored
# (``_product``): exact products, as the widened TF32 ones are, without the widening and with half
# the shared memory a tile; dO's scale then goes on the sums (widened, it is on dO, rounded to
# TF32: dq moved by 1.4e-3 at K = 128, where the scale is not a power of two). H200, forward+backward
# at B=8 T=4096 H=16 K=V=128 / B=16 T=2048 H=32 K=V=64: 8.284 / 7.912 -> 8.131 / 7.862 ms alone,
# 8.327 / 7.952 -> 8.027 / 7.720 with d_leaving in bfloat16 (sm_90a, the contraction then 88
# registers against 125, 0.226 G warp-instructions a launch against 0.289 at K = V = 128).
INTRA_BACKWARD_BFLOAT16_PRODUCTS = True


# The contraction's STAGES with float32 states (float32 or float16 inputs): one, no loads ahead.
# Its loads-ahead builds changed bits from call to call until the mend ``contract_stages``
# describes; since, three stages repeat their bits (H100, 2026-12-06), not yet timed.
CONTRACT_FLOAT32_STAGES = 1


def contract_stages(bfloat16: bool) -> int:
    """The contraction launch's ``STAGES``: ``CONTRACT_STAGES`` with the states saved in bfloat16
    (bfloat16 inputs), ``CONTRACT_FLOAT32_STAGES`` otherwise. Triton (3.6 to 3.9) gives a load
    that registers read as well as an asynchronous product one buffer too few; while gamma's
    gradient read S and dS from the products' loads, the copy of the value block STAGES - 1 ahead
    went into the slot this step's products still read whenever their wait left them in flight:
    with float32 inputs (d_bkd's bits changed between calls on the H100 and H200 at two stages or
    three; neither ptxas 12.9 or 13.0 nor a proxy fence changed that) and with d_U in bfloat16
    (2026-12-06), not with the default bfloat16 launch, whose float32 d_U product waits for
    every product each step. Gamma's gradient now has loads of its own.
    ``overwritten_while_read`` in bench/kernel_resources.py finds such loops in the compiled code;
    bench/RESULTS.md."""
    return CONTRACT_STAGES if bfloat16 else CONTRACT_FLOAT32_STAGES


# The value launch's barrier after d(wv)'s product: None where ``warpgroup_barrier`` says, or forced
# on or off (off at two warpgroups with Triton < 3.9 leaves the hazard below: a speed reference only).
VALUES_WARPGROUP_BARRIER: bool | None = None


def warpgroup_barrier(num_warps: int, version: str | None = None) -> bool:
    """Whether the value launch needs its own barrier after ``d(wv)``'s product: at more than four
    warps (two warpgroups) with a Triton before 3.9. Those (3.6, 3.8 compiled for sm_90a) wait
    for a warpgroup's own asynchronous products and then, without a barrier, store into shared
    memory that the other warpgroup's products may still read (triton-lang/triton#11047, fixed in
    #11056; Triton 3.9 puts a barrier there). Not the cause of the float32 results that changed
    from call to call (``contract_stages``): with or without it the value launch repeated its bits
    on the H200. It costs that loop its loads ahead (0.12 ms of forward+backward at the first
    shape, bench/RESULTS.md)."""
    major, minor = (int(part) for part in (version or triton.__version__).split(".")[:2])
    return num_warps > 4 and (major, minor) < (3, 9)


def values_warpgroup_barrier() -> bool:
    """The value launch's ``WARPGROUP_BARRIER``: ``VALUES_WARPGROUP_BARRIER`` where set, else
    ``warpgroup_barrier`` at its warps."""
    if VALUES_WARPGROUP_BARRIER is not None:
        return VALUES_WARPGROUP_BARRIER
    return warpgroup_barrier(INTRA_BACKWARD_WARPS)


@triton.jit
def _with_key_block(K: tl.constexpr, BKB: tl.constexpr):
    """A program's place on grid axis 0, laid out with the key block fastest: ``(index, first key
    column)``, the index counting what the key blocks split (chunks, or sub-blocks)."""
    key_blocks: tl.constexpr = (K + BKB - 1) // BKB
    return tl.program_id(0) // key_blocks, tl.program_id(0) % key_blocks * BKB


@triton.jit
def _product(a, b, acc, DOT: tl.constexpr):
    """``acc + a b``: on a and b as stored where both are bfloat16 (an exact product, as the
    widened one is: a bfloat16 value is a TF32 value), else on both widened to float32 in ``DOT``."""
    if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT)


@triton.jit
def _intra_backward_contract_kernel(
    states, U, d_o, d_leaving, d_U, inverse,  # saved / from state_backward
    d_qd, d_kd, d_bkd, d_gamma,  # outputs: [B, H, N * C, K] x3, [B, H, N, K] float32
    chunk_table, scale, T, H, K: tl.constexpr, V: tl.constexpr, N,
    BKB: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT: tl.constexpr, PACKED: tl.constexpr,
    STAGES: tl.constexpr, STORED: tl.constexpr,
):
    """The state-sized contractions for one block of key columns: the gradients of the decayed
    queries (o = scale qd S), of the keys decayed to the chunk end (S' = gamma S + kd^T U), of
    ``b k exp(G)`` through ``Wk = X (b k exp(G))`` and ``U = Uw - Wk S``, and of gamma."""
    # The key blocks of a chunk are adjacent programs, so that U, dU, dO and X come from L2 after
    # the first (with the key block the slowest axis, each was read from memory once per block).
    i_n, k0 = _with_key_block(K, BKB)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    rows = tl.arange(0, C)
    first, end = _chunk_span(chunk_table, i_n, T, PACKED)
    t = first + rows
    row_ok = t < end
    cols_k = k0 + tl.arange(0, BKB)
    k_ok = cols_k < K
    state_base = (i_bh * N + i_n) * K * V
    value_in = i_b * T * H * V + i_h * V
    d_q_decayed = tl.zeros((C, BKB), dtype=tl.float32)
    d_k_to_end = tl.zeros((C, BKB), dtype=tl.float32)
    d_Wk = tl.zeros((C, BKB), dtype=tl.float32)
    d_decay = tl.zeros((BKB,), dtype=tl.float32)
    for v0 in tl.range(0, V, BV, num_stages=STAGES):
        cols_v = v0 + tl.arange(0, BV)
        v_ok = cols_v < V
        state_offsets = state_base + cols_k[:, None] * V + cols_v[None, :]
        state_mask = k_ok[:, None] & v_ok[None, :]
        S = tl.load(states + state_offsets, mask=state_mask, other=0.0)
        dS = tl.load(d_leaving + state_offsets, mask=state_mask, other=0.0)
        padded_v = i_bh * N * C * V + (i_n * C + rows[:, None]) * V + cols_v[None, :]
        U_tile = tl.load(U + padded_v, mask=v_ok[None, :], other=0.0)
        dU_tile = tl.load(d_U + padded_v, mask=v_ok[None, :], other=0.0)
        value_offsets = value_in + t[:, None] * (H * V) + cols_v[None, :]
        d_out = tl.load(d_o + value_offsets, mask=row_ok[:, None] & v_ok[None, :], other=0.0)
        if STORED:  # dO's scale and d_Wk's sign go on the sums
            d_q_decayed = _product(d_out, tl.trans(S), d_q_decayed, DOT)
            d_k_to_end = _product(U_tile, tl.trans(dS), d_k_to_end, DOT)
            d_Wk = _product(dU_tile, tl.trans(S), d_Wk, DOT)
        else:
            S, dS, U_tile, dU_tile = S.to(tl.float32), dS.to(tl.float32), U_tile.to(tl.float32), dU_tile.to(tl.float32)
            d_q_decayed += tl.dot(d_out.to(tl.float32) * scale, tl.trans(S), input_precision=DOT)
            d_k_to_end += tl.dot(U_tile, tl.trans(dS), input_precision=DOT)
            d_Wk -= tl.dot(dU_tile, tl.trans(S), input_precision=DOT)
        # gamma's gradient from loads of its own, so that only the products read S's and dS's
        # slots (Triton's fault with loads that both read: contract_stages). The cache modifier
        # keeps the compiler from merging these loads with the two above.
        S_rows = tl.load(states + state_offsets, mask=state_mask, other=0.0, cache_modifier=".cg")
        dS_rows = tl.load(d_leaving + state_offsets, mask=state_mask, other=0.0, cache_modifier=".cg")
        d_decay += tl.sum(dS_rows.to(tl.float32) * S_rows.to(tl.float32), 1)
    if STORED:
        d_q_decayed *= scale
        d_Wk = -d_Wk
    d_bk_decayed = tl.dot(tl.trans(_load_chunk_matrix(_chunk_matrix(inverse, i_bh * N + i_n))), d_Wk, input_precision=DOT)
    padded_k = i_bh * N * C * K + (i_n * C + rows[:, None]) * K + cols_k[None, :]
    out_ok = (rows >= 0)[:, None] & k_ok[None, :]
    tl.store(d_qd + padded_k, d_q_decayed, mask=out_ok)
    tl.store(d_kd + padded_k, d_k_to_end, mask=out_ok)
    tl.store(d_bkd + padded_k, d_bk_decayed, mask=out_ok)
    tl.store(d_gamma + (i_bh * N + i_n) * K + cols_k, d_decay, mask=k_ok)


@triton.jit
def _intra_backward_values_kernel(
    v, w,  # inputs [B, T, H, V]
    Wk, Uw, Uw_scale, inverse, U, d_o, d_U, d_bkd,  # saved / from the earlier launches
    d_A_scratch, d_P_scratch,  # [B, H, N, C, C] float32, written here
    dv, dw,  # outputs, shapes and dtypes of v and w
    chunk_table, scale, T, H, K: tl.constexpr, V: tl.constexpr, N,
    BKB: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT: tl.constexpr, PACKED: tl.constexpr,
    STAGES: tl.constexpr, STORED: tl.constexpr, WARPGROUP_BARRIER: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    rows = tl.arange(0, C)
    cols_c = tl.arange(0, C)
    first, end = _chunk_span(chunk_table, i_n, T, PACKED)
    t = first + rows
    row_ok = t < end
    chunk_base = (i_bh * N + i_n) * C * C
    chunk_matrix = chunk_base + rows[:, None] * C + cols_c[None, :]
    inverse_tile = _load_chunk_matrix(_chunk_matrix(inverse, i_bh * N + i_n))
    value_in = i_b * T * H * V + i_h * V

    # 1. Value side: dP = scale dO U^T, dA = -(d_wv Uw^T), dv, dw.
    d_P = tl.zeros((C, C), dtype=tl.float32)
    d_A = tl.zeros((C, C), dtype=tl.float32)
    for v0 in tl.range(0, V, BV, num_stages=STAGES):
        cols_v = v0 + tl.arange(0, BV)
        v_ok = cols_v < V
        padded_v = i_bh * N * C * V + (i_n * C + rows[:, None]) * V + cols_v[None, :]
        U_tile = tl.load(U + padded_v, mask=v_ok[None, :], other=0.0)
        dU_tile = tl.load(d_U + padded_v, mask=v_ok[None, :], other=0.0).to(tl.float32)
        Uw_tile = _load_uw(Uw + padded_v, Uw_scale + (i_bh * N + i_n) * V + cols_v, v_ok)
        value_offsets = value_in + t[:, None] * (H * V) + cols_v[None, :]
        value_mask = row_ok[:, None] & v_ok[None, :]
        d_out = tl.load(d_o + value_offsets, mask=value_mask, other=0.0)
        if STORED:  # dO's scale goes on the sum
            d_P = _product(d_out, tl.trans(U_tile), d_P, DOT)
        else:
            d_P += tl.dot(d_out.to(tl.float32) * scale, tl.trans(U_tile.to(tl.float32)), input_precision=DOT)
        d_wv = tl.dot(tl.trans(inverse_tile), dU_tile, input_precision=DOT)
        if WARPGROUP_BARRIER:  # before d(wv)'s layout change reuses what its product read (warpgroup_barrier)
            tl.debug_barrier()
        v_tile = tl.load(v + value_offsets, mask=value_mask, other=0.0).to(tl.float32)
        w_tile = tl.load(w + value_offsets, mask=value_mask, other=0.0).to(tl.float32)
        tl.store(dw + value_offsets, (d_wv * v_tile).to(dw.dtype.element_ty), mask=value_mask)
        tl.store(dv + value_offsets, (d_wv * w_tile).to(dv.dtype.element_ty), mask=value_mask)
        d_A -= tl.dot(d_wv, tl.trans(Uw_tile), input_precision=DOT)

    # 2. Key side of dA: -(inverse^T dWk) Wk^T, with inverse^T dWk from the contraction launch.
    for k0 in tl.range(0, K, BKB, num_stages=STAGES):
        cols_k = k0 + tl.arange(0, BKB)
        padded_k = i_bh * N * C * K + (i_n * C + rows[:, None]) * K + cols_k[None, :]
        k_ok = (rows >= 0)[:, None] & (cols_k < K)[None, :]
        d_bk_decayed = tl.load(d_bkd + padded_k, mask=k_ok, other=0.0)
        Wk_tile = tl.load(Wk + padded_k, mask=k_ok, other=0.0).to(tl.float32)
        d_A -= tl.dot(d_bk_decayed, tl.trans(Wk_tile), input_precision=DOT)
    d_A = tl.where(cols_c[None, :] < rows[:, None], d_A, 0.0)
    if STORED:
        d_P *= scale
    d_P = tl.where(cols_c[None, :] <= rows[:, None], d_P, 0.0)  # with its diagonal (read apart)
    # the keys launch reads the diagonal tiles and those below only
    block_lower = rows[:, None] // 16 >= cols_c[None, :] // 16
    tl.store(d_A_scratch + chunk_matrix, d_A, mask=block_lower)
    tl.store(d_P_scratch + chunk_matrix, d_P, mask=block_lower)


@triton.jit
def _rows(x, first, end, HK, cols_k, k_ok):
    """Rows ``first .. first + 15`` of an input (``x`` at this batch element and head) as float32
    [16, BKB], zero past ``end`` (the chunk's end). Offsets inside a sequence are 32-bit; the base
    pointer carries the 64-bit part."""
    t = first + tl.arange(0, 16)
    return tl.load(x + t[:, None] * HK + cols_k[None, :], mask=(t < end)[:, None] & k_ok[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _row_step_inputs(q, k, g, b, d_A_scratch, d_P_scratch, first, end, HK, cols_k, k_ok, r, I, i):
    """Row ``i`` of the sub-block's g, q, b, k (the inputs' dtype) and row ``i`` of dA's and dP's
    diagonal block at columns ``j < i``; zeros at ``i = 16`` (a prefetch one past the last row)."""
    t_i = first + i + 0 * cols_k  # a vector: the interpreter needs one for masks
    row = t_i * HK + cols_k
    row_ok = k_ok & (t_i < end) & (i < 16)
    g_i = tl.load(g + row, mask=row_ok, other=0.0)
    q_i = tl.load(q + row, mask=row_ok, other=0.0)
    b_i = tl.load(b + row, mask=row_ok, other=0.0)
    k_i = tl.load(k + row, mask=row_ok, other=0.0)
    entries = (I * 16 + i) * 64 + I * 16 + r
    below = (r < i) & (i < 16)
    d_A_row = tl.load(d_A_scratch + entries, mask=below, other=0.0)
    d_P_row = tl.load(d_P_scratch + entries, mask=below, other=0.0)
    return g_i, q_i, b_i, k_i, d_A_row, d_P_row


@triton.jit
def _row_step(E, d_k_pair, r, i, g_i, q_i, b_i, k_i, d_A_row, d_P_row):
    """The keys' side of row ``i``: ``E[j] = exp(g_{j+1} + ... + g_i)`` for ``j < i`` (the previous
    row's times ``exp(g_i)``; 1 at ``j = i``, 0 after), and row i's pairs added to ``d_k_pair``."""
    step_decay = _exp(g_i.to(tl.float32))
    bk_i = b_i.to(tl.float32) * k_i.to(tl.float32)
    E = tl.where(r[:, None] < i, E * step_decay[None, :], tl.where(r[:, None] == i, 1.0, 0.0))
    d_k_pair += E * (d_A_row[:, None] * bk_i[None, :] + d_P_row[:, None] * q_i.to(tl.float32)[None, :])
    return E, d_k_pair


@triton.jit
def _column_step_inputs(k, g, d_A_scratch, d_P_scratch, first, end, HK, cols_k, k_ok, r, I, j):
    """Row ``j + 1`` of the sub-block's g (zero past its last row), row ``j`` of k, and column ``j``
    of dA's and dP's diagonal block at rows ``i > j``; zeros at ``j = -1`` (a prefetch one past
    the first column)."""
    t_next = first + j + 1 + 0 * cols_k
    next_ok = k_ok & (t_next < end) & (t_next < first + 16) & (j >= 0)
    g_next = tl.load(g + t_next * HK + cols_k, mask=next_ok, other=0.0)
    t_j = first + j + 0 * cols_k
    k_j = tl.load(k + t_j * HK + cols_k, mask=k_ok & (t_j < end) & (j >= 0), other=0.0)
    entries = (I * 16 + r) * 64 + I * 16 + j
    below = (r > j) & (j >= 0)
    d_A_column = tl.load(d_A_scratch + entries, mask=below, other=0.0)
    d_P_column = tl.load(d_P_scratch + entries, mask=below, other=0.0)
    return g_next, k_j, d_A_column, d_P_column


@triton.jit
def _column_step(F, d_bk_A, d_q_P, r, j, g_next, k_j, d_A_column, d_P_column):
    """The rows' side of column ``j``: ``F[i] = exp(g_{j+1} + ... + g_i)`` for ``i > j`` (the next
    column's times ``exp(g_{j+1})``, 0 at and before ``j``), and column j's pairs added to
    ``d_bk_A`` and ``d_q_P``."""
    next_decay = _exp(g_next.to(tl.float32))
    F = tl.where(r[:, None] > j, tl.where(r[:, None] == j + 1, 1.0, F) * next_decay[None, :], 0.0)
    k_F = F * k_j.to(tl.float32)[None, :]
    d_bk_A += d_A_column[:, None] * k_F
    d_q_P += d_P_column[:, None] * k_F
    return F, d_bk_A, d_q_P


@triton.jit
def _intra_backward_keys_kernel(
    q, k, g, b,  # inputs [B, T, H, K]
    d_qd, d_kd, d_bkd,  # from the contraction launch, [B, H, N * 64, K]; d_qd's rows get dg's partial sums
    sub_block_sums,  # [B, H, N, 2, 4, K] float32, written here: per sub-block, the sums of d_G and of the k-to-end terms
    d_A_scratch, d_P_scratch,  # [B, H, N, 64, 64] float32 from _intra_backward_values_kernel
    dq, dk, db,  # outputs, shapes and dtypes of the inputs
    chunk_table, T, H, K: tl.constexpr, N,
    BKB: tl.constexpr, DOT: tl.constexpr, PACKED: tl.constexpr, STAGES: tl.constexpr,
):
    """One 16-row sub-block I of one chunk and key block: the row-local terms, the pairs with
    earlier sub-blocks J (matrix products through the row before I: left = exp of the span from
    I's first row to i, right = exp of the span from j + 1 to the row before I), the pairs with
    later sub-blocks, and the pairs inside I one row i at a time (``E[j] = exp(g_{j+1} + ... +
    g_i)``, the previous row's times ``exp(g_i)``). Every exponent is a span sum, never positive.
    dg needs sums over the whole chunk: this launch leaves the sub-block's part in d_qd's rows and
    its two sums in ``sub_block_sums``; ``_gate_gradient_kernel`` adds the rest."""
    # The key blocks of a sub-block are adjacent programs (they read the same tiles of dA and dP),
    # and the sub-blocks of a chunk near each other (each reads the others' rows).
    i_s, k0 = _with_key_block(K, BKB)
    i_bh = tl.program_id(1).to(tl.int64)
    i_n = i_s // 4
    I = i_s % 4
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, 16)
    cols_k = k0 + tl.arange(0, BKB)
    k_ok = cols_k < K
    HK = H * K
    sequence = i_b * T * HK + i_h * K  # 64-bit; offsets inside the sequence are 32-bit
    q += sequence
    k += sequence
    g += sequence
    b += sequence
    chunk_first, end = _chunk_span(chunk_table, i_n, T, PACKED)  # tokens
    first = chunk_first + I * 16
    chunk_base = (i_bh * N + i_n) * 64 * 64
    d_A_scratch += chunk_base
    d_P_scratch += chunk_base
    saved = i_bh * N * 64 * K + (i_n * 64 + I * 16 + r)[:, None] * K + cols_k[None, :]  # padded rows

    # Live tiles are few on purpose (registers decide the occupancy): each accumulator starts
    # from its off-diagonal part and the row loop adds to it; the row-local inputs are read after.
    # Pairs with earlier sub-blocks J (through the row before I).
    from_earlier_A = tl.zeros((16, BKB), dtype=tl.float32)
    from_earlier_P = tl.zeros((16, BKB), dtype=tl.float32)
    between = tl.full((BKB,), 1.0, tl.float32)
    for J_step in tl.range(0, I, num_stages=STAGES):
        J = I - 1 - J_step
        k_J = _rows(k, chunk_first + J * 16, end, HK, cols_k, k_ok)
        g_J = _rows(g, chunk_first + J * 16, end, HK, cols_k, k_ok)
        k_right = k_J * _exp(_exclusive_suffix(g_J)) * between[None, :]
        tile = (I * 16 + r)[:, None] * 64 + J * 16 + r[None, :]
        from_earlier_A += tl.dot(tl.load(d_A_scratch + tile), k_right, input_precision=DOT)
        from_earlier_P += tl.dot(tl.load(d_P_scratch + tile), k_right, input_precision=DOT)
        between = between * _exp(tl.sum(g_J, 0))
    before = between  # the decay of every sub-block before I
    g_I = _rows(g, first, end, HK, cols_k, k_ok)
    left = _exp(tl.cumsum(g_I, 0))  # g_{16 I} + ... + g_i
    d_bk_A = left * from_earlier_A
    d_q_P = left * from_earlier_P

    # Pairs with later sub-blocks I2 (through the row before I2); ``between`` ends as the decay
    # of every sub-block after I.
    to_later = tl.zeros((16, BKB), dtype=tl.float32)
    between = tl.full((BKB,), 1.0, tl.float32)
    for I2 in tl.range(I + 1, 4, num_stages=STAGES):
        first2 = chunk_first + I2 * 16
        g2 = _rows(g, first2, end, HK, cols_k, k_ok)
        left2 = _exp(tl.cumsum(g2, 0)) * between[None, :]
        q2 = _rows(q, first2, end, HK, cols_k, k_ok)
        bk2 = _rows(b, first2, end, HK, cols_k, k_ok) * _rows(k, first2, end, HK, cols_k, k_ok)
        tile_T = (I2 * 16 + r)[None, :] * 64 + I * 16 + r[:, None]  # (dA[I2, I])^T
        to_later += tl.dot(tl.load(d_A_scratch + tile_T), bk2 * left2, input_precision=DOT)
        to_later += tl.dot(tl.load(d_P_scratch + tile_T), q2 * left2, input_precision=DOT)
        between = between * _exp(tl.sum(g2, 0))
    after = between
    right = _exp(_exclusive_suffix(g_I))  # g_{j+1} + ... + the end of I
    d_k_pair = right * to_later

    # Pairs inside I, without sums across rows: one row i at a time for the keys' side (``E[j] =
    # exp(g_{j+1} + ... + g_i)``, the previous row's times ``exp(g_i)``), one column j at a time,
    # last first, for the rows' side (``F[i] = exp(g_{j+1} + ... + g_i)``, the next column's times
    # ``exp(g_{j+1})``). Both in one loop (step s: row s and column 15 - s), so that their loads
    # wait together, and each step's rows loaded one step ahead: a step's arithmetic is short.
    k_I = _rows(k, first, end, HK, cols_k, k_ok)
    E = tl.zeros((16, BKB), dtype=tl.float32)
    F = tl.zeros((16, BKB), dtype=tl.float32)
    g_i, q_i, b_i, k_i, d_A_row, d_P_row = _row_step_inputs(
        q, k, g, b, d_A_scratch, d_P_scratch, first, end, HK, cols_k, k_ok, r, I, 0)
    g_next, k_j, d_A_column, d_P_column = _column_step_inputs(
        k, g, d_A_scratch, d_P_scratch, first, end, HK, cols_k, k_ok, r, I, 15)
    for s in range(16):
        g_i1, q_i1, b_i1, k_i1, d_A_row1, d_P_row1 = _row_step_inputs(
            q, k, g, b, d_A_scratch, d_P_scratch, first, end, HK, cols_k, k_ok, r, I, s + 1)
        g_next1, k_j1, d_A_column1, d_P_column1 = _column_step_inputs(
            k, g, d_A_scratch, d_P_scratch, first, end, HK, cols_k, k_ok, r, I, 14 - s)
        E, d_k_pair = _row_step(E, d_k_pair, r, s, g_i, q_i, b_i, k_i, d_A_row, d_P_row)
        F, d_bk_A, d_q_P = _column_step(F, d_bk_A, d_q_P, r, 15 - s, g_next, k_j, d_A_column, d_P_column)
        g_i, q_i, b_i, k_i, d_A_row, d_P_row = g_i1, q_i1, b_i1, k_i1, d_A_row1, d_P_row1
        g_next, k_j, d_A_column, d_P_column = g_next1, k_j1, d_A_column1, d_P_column1

    q_I = _rows(q, first, end, HK, cols_k, k_ok)
    b_I = _rows(b, first, end, HK, cols_k, k_ok)
    bk_I = b_I * k_I
    decay = left * before[None, :]  # exp(G_i)
    decay_to_end = right * after[None, :]  # exp(g_{i+1} + ... + g_last)
    d_q_decayed = tl.load(d_qd + saved, mask=k_ok[None, :], other=0.0)
    d_k_to_end = tl.load(d_kd + saved, mask=k_ok[None, :], other=0.0)
    d_bk_decayed = tl.load(d_bkd + saved, mask=k_ok[None, :], other=0.0)
    d_P_diagonal = tl.load(d_P_scratch + (I * 16 + r) * 65)  # P's diagonal goes straight to dq, dk
    d_q = d_q_decayed * decay + d_P_diagonal[:, None] * k_I + d_q_P
    d_bk = d_bk_decayed * decay + d_bk_A
    d_k = d_k_to_end * decay_to_end + d_P_diagonal[:, None] * q_I + d_k_pair + d_bk * b_I
    d_G = (d_q_decayed * q_I + d_bk_decayed * bk_I) * decay + bk_I * d_bk_A + q_I * d_q_P - k_I * d_k_pair

    # dg_i = (sum of d_G over rows s >= i) + (k-to-end terms of rows s < i) + gamma's term. Inside
    # the sub-block here; the last row's k-to-end term is O(1) where the others may be tiny, so the
    # rows before i are summed by an exact product (a cumulative sum minus the row would leave its
    # rounding in dg).
    k_to_end = d_k_to_end * k_I * decay_to_end
    strictly_lower = (r[None, :] < r[:, None]).to(tl.float32)
    partial = tl.cumsum(d_G, 0, reverse=True) + tl.dot(strictly_lower, k_to_end, input_precision="ieee")
    tl.store(d_qd + saved, partial, mask=k_ok[None, :])  # this program's own rows, read above
    sums = sub_block_sums + ((i_bh * N + i_n) * 8 + I) * K + cols_k
    tl.store(sums, tl.sum(d_G, 0), mask=k_ok)
    tl.store(sums + 4 * K, tl.sum(k_to_end, 0), mask=k_ok)

    t = first + r
    out = t[:, None] * HK + cols_k[None, :]
    mask = (t < end)[:, None] & k_ok[None, :]
    tl.store(dq + sequence + out, d_q.to(dq.dtype.element_ty), mask=mask)
    tl.store(dk + sequence + out, d_k.to(dk.dtype.element_ty), mask=mask)
    tl.store(db + sequence + out, (d_bk * k_I).to(db.dtype.element_ty), mask=mask)


@triton.jit
def _gate_gradient_kernel(
    partial, sub_block_sums, gamma, d_gamma,  # [B, H, N * 64, K], [B, H, N, 2, 4, K], [B, H, N, K] x2
    dg,  # output [B, T, H, K]
    chunk_table, T, H, K: tl.constexpr, N, BKB: tl.constexpr, PACKED: tl.constexpr,
):
    """dg of one chunk and key block: each sub-block's partial sums plus the d_G sums of the
    sub-blocks after it, the k-to-end sums of those before it, and gamma's term."""
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    cols_k = tl.program_id(2) * BKB + tl.arange(0, BKB)
    k_ok = cols_k < K
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, 16)
    first, end = _chunk_span(chunk_table, i_n, T, PACKED)
    chunk = i_bh * N + i_n
    sums = sub_block_sums + chunk * 8 * K + cols_k
    gamma_term = tl.load(gamma + chunk * K + cols_k, mask=k_ok, other=0.0) * tl.load(
        d_gamma + chunk * K + cols_k, mask=k_ok, other=0.0)
    after = tl.zeros((BKB,), dtype=tl.float32)
    for step in range(4):
        I = 3 - step
        before = tl.zeros((BKB,), dtype=tl.float32)
        for M in range(I):
            before += tl.load(sums + (4 + M) * K, mask=k_ok, other=0.0)
        padded = i_n * 64 + I * 16 + r
        part = tl.load(partial + i_bh * N * 64 * K + padded[:, None] * K + cols_k[None, :], mask=k_ok[None, :], other=0.0)
        value = part + (after + before + gamma_term)[None, :]
        t = first + I * 16 + r
        out = i_b * T * H * K + t[:, None] * (H * K) + i_h * K + cols_k[None, :]
        tl.store(dg + out, value.to(dg.dtype.element_ty), mask=(t < end)[:, None] & k_ok[None, :])
        after += tl.load(sums + I * K, mask=k_ok, other=0.0)


def _blocks(K: int, V: int) -> tuple[int, int]:
    """Key and value columns per block in the in-chunk backward. At least 32: with 16, Triton 3.6
    on the H200 read past shared memory ("Invalid __shared__ read", compute-sanitizer) at K or
    V = 16; masks cover K, V < 32."""
    return (min(INTRA_BACKWARD_KEY_BLOCK, max(32, triton.next_power_of_2(K))),
            min(INTRA_BACKWARD_VALUE_BLOCK, max(32, triton.next_power_of_2(V))))


def intra_backward_contract(states, U, d_o, d_leaving, d_U, inverse, scale: float, dot_precision: str, chunk_table=None):
    """Launch the state-sized contractions; returns ``(d_qd, d_kd, d_bkd, d_gamma)`` float32
    (``[B, H, N * 64, K]`` three times and ``[B, H, N, K]``)."""
    B, H, N, K, V = states.shape
    T = d_o.shape[1]
    BKB, BV = _blocks(K, V)
    d_qd, d_kd, d_bkd = (states.new_empty(B, H, N * CHUNK, K, dtype=torch.float32) for _ in range(3))
    d_gamma = states.new_empty(B, H, N, K, dtype=torch.float32)
    _intra_backward_contract_kernel[(N * triton.cdiv(K, BKB), B * H)](
        states, U, d_o, d_leaving, d_U, inverse, d_qd, d_kd, d_bkd, d_gamma, _table(chunk_table, states), scale,
        T, H, K, V, N, BKB=BKB, BV=BV, C=CHUNK, DOT=dot_precision, PACKED=chunk_table is not None,
        STAGES=contract_stages(states.dtype == torch.bfloat16), STORED=INTRA_BACKWARD_BFLOAT16_PRODUCTS,
        num_warps=INTRA_BACKWARD_WARPS, num_stages=1,
        **register_cap("intra_backward_contract"),
    )
    return d_qd, d_kd, d_bkd, d_gamma


def intra_backward_values(v, w, Wk, Uw, Uw_scale, inverse, U, d_o, d_U, d_bkd, scale: float, dot_precision: str,
                          chunk_table=None):
    """Launch the value side; returns ``(dv, dw, d_A, d_P)`` (d_A, d_P ``[B, H, N, 64, 64]``)."""
    B, T, H, V = v.shape
    N, K = inverse.shape[2], Wk.shape[-1]
    BKB, BV = _blocks(K, V)
    dv, dw = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (v, w))  # contiguous
    d_A, d_P = (inverse.new_empty(inverse.shape[:3] + (CHUNK, CHUNK), dtype=torch.float32) for _ in range(2))
    _intra_backward_values_kernel[(N, B * H)](
        v, w, Wk, Uw, Uw_scale, inverse, U, d_o, d_U, d_bkd, d_A, d_P, dv, dw, _table(chunk_table, v), scale, T, H, K,
        V, N,
        BKB=BKB, BV=BV, C=CHUNK, DOT=dot_precision, PACKED=chunk_table is not None,
        STAGES=VALUES_STAGES, STORED=INTRA_BACKWARD_BFLOAT16_PRODUCTS,
        WARPGROUP_BARRIER=values_warpgroup_barrier(), num_warps=INTRA_BACKWARD_WARPS, num_stages=1,
        **register_cap("intra_backward_values"),
    )
    return dv, dw, d_A, d_P


def intra_backward_keys(q, k, g, b, d_qd, d_kd, d_bkd, d_gamma, d_A, d_P, gamma, dot_precision: str, chunk_table=None):
    """Launch the key side (one program per 16-row sub-block, head and key block), then dg's
    chunk sums; returns ``(dq, dk, dg, db)``. ``d_qd`` is overwritten."""
    B, T, H, K = q.shape
    N = d_A.shape[2]
    BKB = min(INTRA_BACKWARD_KEYS_BLOCK, max(16, triton.next_power_of_2(K)))
    dq, dk, dg, db = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, g, b))  # contiguous
    sub_block_sums = d_qd.new_empty(B, H, N, 2, 4, K)
    _intra_backward_keys_kernel[(N * 4 * triton.cdiv(K, BKB), B * H)](
        q, k, g, b, d_qd, d_kd, d_bkd, sub_block_sums, d_A, d_P, dq, dk, db, _table(chunk_table, q), T, H, K, N,
        BKB=BKB, DOT=dot_precision, PACKED=chunk_table is not None, STAGES=KEYS_STAGES,
        num_warps=INTRA_BACKWARD_KEYS_WARPS, num_stages=1, **register_cap("intra_backward_keys"),
    )
    _gate_gradient_kernel[(N, B * H, triton.cdiv(K, BKB))](
        d_qd, sub_block_sums, gamma, d_gamma, dg, _table(chunk_table, q), T, H, K, N, BKB=BKB,
        PACKED=chunk_table is not None, num_warps=4, num_stages=1, **register_cap("gate_gradient"),
    )
    return dq, dk, dg, db
