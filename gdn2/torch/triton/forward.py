"""Triton forward kernels of the chunked GDN-2 form (see ``gdn2/algorithm.py`` for the mathematics).

Six launches:

* ``_diagonal_kernel`` (one program per 16-row sub-block and head, parallel): the diagonal 16x16
  tiles of the erase interactions ``A`` and of the query-key interactions ``P``, the rows in four
  groups of four (inside a group a chain of per-step decays, all groups at once; across groups
  the products below);
* ``_intra_forward_kernel`` (one program per chunk and head, parallel): the other tiles of ``A``
  and ``P`` as 16x16 register tiles; from the same key loop,
  the decayed queries and keys the sequential pass and the output use, ``qd = q * exp(G)``,
  ``kd = k * exp(G_last - G)``, ``gamma = exp(G_last)``, and the decayed erase keys
  ``bkd = b * k * exp(G)``;
* ``_inverse_kernel`` (one program per chunk and head, parallel): ``X = (I + A)^{-1}``;
* ``_wy_kernel`` (one program per chunk and head, parallel): the WY products ``Wk = X bkd`` and
  ``Uw = X (w * v)``;
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
* inside a group of four rows of a diagonal tile, ``E_i[j] = E_{i-1}[j] e^{g_i}`` for ``j < i``
  (products of per-step decays, one exponential per step and channel); the groups' 4x4
  off-diagonal blocks are products as above, with groups in place of sub-blocks;
* ``exp(G_i) = e^{L_i} prod_{M<I} t_M`` and ``exp(G_last - G_j) = e^{R_j} prod_{M>J} t_M``.

Masks are selects (``tl.where``), never multiplications, so ``-inf`` never meets a zero.

Internal buffers are head-major and padded to whole chunks: ``[B, H, N * 64, D]`` (rows past T
are zero), states ``[B, H, N, K, V]``, ``gamma`` ``[B, H, N, K]``. The chunk matrices P, A and X
(lower block-triangular) keep only their ten 16x16 tiles on and below the diagonal, row by row:
``[B, H, N, 10, 16, 16]`` (``_tile_index``; ``full_chunk_matrices`` gives them whole).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK = 64
TILES = 10  # the 16x16 tiles of a chunk matrix on and below its diagonal, the ones stored

# Launch settings (bench/RESULTS.md has the measurements they come from).
INTRA_FORWARD_WARPS = 2
DIAGONAL_WARPS = 1  # one warp holds a 16x16 product without copies
DIAGONAL_KEY_BLOCK = 16  # key columns per step of the diagonal launch's key loop
WY_WARPS = 4
WY_BLOCK = 32  # against 64: 2.118 / 2.140 and 2.297 / 2.329 ms forward at the first and third shapes
INTRA_FORWARD_KEY_BLOCK = 16
# Key blocks whose loads Triton issues this many steps ahead, as asynchronous copies to shared
# memory (1: none), in the diagonal and intra-forward launches (the WY launch's: slower).
DIAGONAL_STAGES = 3  # 2.335 -> 2.313 ms forward (2: 2.319)
INTRA_FORWARD_STAGES = 3  # 2.497 -> 2.349 ms forward (2: 2.424)
# How the intra-forward sums the log decays down each sub-block's rows: "scans" (``tl.cumsum``,
# ``_exclusive_suffix``), or as tensor-core products, "products" or "stacked"
# (``_span_sums_by_products``). Nsight Compute on the H200 found the launch bound by shuffles and
# shared memory, most of them the scans' (bench/RESULTS.md). The products' forms are not yet
# timed (bench/triton_h200.py VARIANTS 36, 37; sm_90a: more instructions and spills, no shuffles).
INTRA_FORWARD_SPAN_SUMS = "scans"
INVERSE_WARPS = 1  # two: 2.524 ms forward against 2.375 (at 204 registers against 255)
STATE_WARPS = 4
# Loads of the state pass issued this many chunks ahead (1: none), K <= 128 only (state_stages): in
# its widened form (float32 or float16 saved buffers) one, in its split form (bfloat16 Wk and kd)
# two. H100 (2026-12-06, bench/RESULTS.md), the split form two chunks ahead at 128 programs at
# least (STATE_SPLIT_MIN_PROGRAMS; sm_90a: 117.5 KiB of shared memory in value blocks of 32
# columns, one program a multiprocessor, one wave at B=2 H=16 against two programs of 16 columns),
# bit-identical: forward 2.080 -> 1.965 ms at B=2 T=16384 H=16 K=V=128, 1.882 -> 1.869 at B=8
# T=4096, 1.883 -> 1.892 at B=16 T=2048 H=32 K=V=64; two ahead alone 2.040, 128 programs alone
# slower (2.108 against 2.077). Two ahead in the widened form would take 274 KiB at K = V = 128 on
# sm_90a, 194 KiB on sm_80 (bench/kernel_resources.py): more than those devices' blocks may take.
STATE_STAGES = 2
STATE_SPLIT_STAGES = 3
OUTPUT_WARPS = 4
OUTPUT_KEY_BLOCK = 64  # key columns of qd and S per step of the output's loop
# Products on bfloat16 operands where the saved buffers are bfloat16: the state pass's with U split
# into two bfloat16 parts (``_split_dot``; Wk and kd bfloat16; the state rounded or split, below), the
# output's qd S and P U where both operands are bfloat16 as stored (exact as they are). Off: every
# product widened to float32 (TF32).
STATE_BFLOAT16_PRODUCTS = True  # 2.853 -> 2.712 ms forward (H200, B=8 T=4096 H=16 K=V=128)
OUTPUT_BFLOAT16_PRODUCT = True  # 2.853 -> 2.726; both 2.580 (forward+backward 11.440 -> 11.116)
# With the state pass's split products, ``Wk S`` on the state rounded to bfloat16 (one product, as
# flash-linear-attention's pass has it; the state is saved so rounded anyway) in place of the
# state split in two parts; the update ``kd^T U`` stays split (on a rounded U the final state's
# error was 3-8x). sm_90a: 851 instructions a chunk against 1,160 at K = V = 128; H100 (four
# processes): forward 2.025 -> 2.012 ms at B=8 T=4096 H=16 K=V=128, the pass 0.308 -> 0.297;
# errors against the spec as the split form's (bench/RESULTS.md).
STATE_FORWARD_ROUNDED_STATE = True
# b k exp(G) written into Wk's own buffer when Wk is bfloat16 (one more rounding, half the bytes
# of the float32 scratch). Alone no faster (1.975 against 1.972 ms forward, 2026-12-03); with the
# inverse saved in bfloat16 too (``SAVED_IN_BFLOAT16``) the WY products run on both as stored:
# H100, B=8 T=4096 H=16 K=V=128, the WY launch 0.371 -> 0.293 ms, the forward 1.958 -> 1.872 ms
# (1.959 -> 1.863 at B=16 T=2048 H=32 K=V=64); errors against the spec over 18 CPU draws as
# before (bench/RESULTS.md).
DECAYED_ERASE_KEYS_IN_WK = True
# The WY products on X and bkd as stored when both are bfloat16 (X saved in bfloat16 and
# DECAYED_ERASE_KEYS_IN_WK), w v split into two bfloat16 parts; off: widened to float32 (TF32).
WY_BFLOAT16_PRODUCTS = True
# Value blocks shrink until the state pass has this many programs (STATE_SPLIT_MIN_PROGRAMS in its
# split form; the reverse pass has its own, backward.py).
STATE_MIN_PROGRAMS = 256
STATE_SPLIT_MIN_PROGRAMS = 128
# The state pass in its widened form (float32 or float16 inputs) loading a chunk ahead at K > 64 in
# value blocks of 64 columns takes 113 KiB of shared memory on sm_86, sm_89 and sm_120 (Triton 3.6,
# bench/kernel_resources.py --arch 89; 193 KiB on sm_90a, where blocks may take 227): on devices
# whose blocks may take less (99 KiB on those GPUs: RTX 3090, RTX 4090, L40, RTX 5090) it runs in
# value blocks of 32 columns (88.8 KiB), else its launch could not start.
STATE_WIDE_BLOCK_SHARED = 113 * 1024
# Register caps (ptxas ``maxnreg``) by launch name (the names of bench/kernel_resources.py), for
# these and the backward's launches. The keys launch at two warps and 128 registers (220 B of
# spills, 2.47 G warp-instructions a launch against 3.35 G at four warps and 80): forward+backward
# 9.636 -> 8.762 ms (168: 8.877; 112: 9.341); at four warps 80 had beaten its own 128 (10.322 ->
# 9.894). The value launch's masked load of X (``_load_chunk_matrix``, its zero tiles not read)
# took it from 125 to 143 registers, two programs a multiprocessor against four: 128 gives back
# four, without spills. The contraction launch with U saved in bfloat16: 130 registers, two
# programs a multiprocessor; 128 gives back four, without spills (95 with U in float32). No cap
# helped the WY, output, diagonal or intra-forward launch. The inverse launch (X's diagonal
# tiles by recursive doubling: 146 registers) at 128, 4 B of spills: forward 1.947 -> 1.941 ms
# and 1.992 -> 1.981 at the first and third shapes.
MAX_REGISTERS: dict[str, int] = {"intra_backward_keys": 128, "intra_backward_values": 128, "intra_backward_contract": 128,
                                 "inverse": 128}


def register_cap(launch: str) -> dict:
    """The launch option capping ``launch``'s registers, if ``MAX_REGISTERS`` names it."""
    cap = MAX_REGISTERS.get(launch)
    return {} if cap is None else dict(maxnreg=cap)


@triton.jit
def _chunk_span(chunk_table, i_n, T, PACKED: tl.constexpr):
    """First token and end (exclusive) of chunk ``i_n``: from the chunk table with packed
    sequences (every sequence starts a chunk; ``[chunks, 2]`` int32 (first token, length)), else
    ``64 i_n`` and T."""
    if PACKED:
        first = tl.load(chunk_table + 2 * i_n)
        end = first + tl.load(chunk_table + 2 * i_n + 1)
    else:
        first = i_n * 64
        end = T
    return first, end


@triton.jit
def _sequence_chunks(sequence_chunks, i_bh, H, N, PACKED: tl.constexpr):
    """For a sequential pass: the chunks ``[first, end)`` of program ``i_bh`` (a sequence and
    head with packed sequences, ``[sequences + 1]`` int32 chunk offsets; else a batch row and
    head, all N chunks) and its row of the head-major chunk buffers."""
    if PACKED:
        first = tl.load(sequence_chunks + i_bh // H)
        end = tl.load(sequence_chunks + i_bh // H + 1)
        row = i_bh % H  # the packed batch is one row
    else:
        first = 0
        end = N
        row = i_bh
    return first, end, row


@triton.jit
def _exp(x):
    """e^x as ``exp2(x log2(e))``. On the GPU ``tl.exp`` computes the same product and the same
    ``ex2`` but asks for results below 2^-126 as denormals, which takes three more instructions a
    value (sm_90a: a compare, and a scaling before and after; 5 against 2); this flushes them to 0
    instead (a decay below 1.2e-38 counts as none), as flash-linear-attention's exp2 does."""
    return tl.math.exp2(x * 1.4426950408889634)


@triton.jit
def _finite(x):
    """x with every non-finite value replaced by 0 (a bad value must not reach earlier rows
    through a product with a masked-out zero; its own rows are set to NaN explicitly)."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


@triton.jit
def _decay(g):
    """g with NaN and +inf replaced by 0; -inf (a hard reset) kept."""
    return tl.where(g < float("inf"), g, 0.0)


@triton.jit
def _load_finite(pointer, mask):
    return _finite(tl.load(pointer, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _load_decay(pointer, mask):
    return _decay(tl.load(pointer, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _split_dot(a, b, acc):
    """``acc + a b`` for bfloat16 ``a`` and float32 ``b``: b as the sum of two bfloat16 parts, two
    exact bfloat16 tensor-core products (b within 2^-16 of its value; TF32 would round it to
    2^-11), no float32 copy of ``a``."""
    high = b.to(tl.bfloat16)
    return tl.dot(a, (b - high.to(tl.float32)).to(tl.bfloat16), tl.dot(a, high, acc))


@triton.jit
def _doubled_inverse(A, PRECISION: tl.constexpr):
    """``(I + A)^{-1}`` for a strictly lower 16x16 ``A`` (float32, zero on and above the diagonal)
    by recursive doubling: with ``Y`` the inverse of the block-diagonal part of ``I + A`` in blocks
    of b, the blocks of 2b are ``Y - Y C Y``, C the entries of A in the lower b-block of each
    2b-block (for [[D1, 0], [C, D2]] the inverse's lower block is ``-X2 C X1``). Blocks of 2 need
    no product (``I - C``); 4, 8 and 16 take two products each in ``PRECISION``: six dependent
    products where forward substitution takes 15 dependent row steps (H200: forward 1.983 ->
    1.947 ms at B=8 T=4096 H=16 K=V=128, 2.049 -> 1.992 at B=16 T=2048 H=32 K=V=64; the errors
    against the spec unchanged at the check shapes)."""
    r = tl.arange(0, 16)
    X = (r[:, None] == r[None, :]).to(tl.float32) - tl.where(r[:, None] // 2 == r[None, :] // 2, A, 0.0)
    for level in tl.static_range(1, 4):
        b = 1 << level  # the block size inverted so far
        joined = (r[:, None] // (2 * b) == r[None, :] // (2 * b)) & (r[:, None] // b != r[None, :] // b)
        X -= tl.dot(tl.dot(X, tl.where(joined, A, 0.0), input_precision=PRECISION), X, input_precision=PRECISION)
    return X


@triton.jit
def _tile_index(I, J):
    """Where tile (I, J), J <= I, of a chunk matrix is stored among its ten: row by row."""
    return I * (I + 1) // 2 + J


@triton.jit
def _tile_entry(I, J, r, c):
    """Offset of row r, column c (0..15) of tile (I, J) from its chunk matrix's first entry."""
    return _tile_index(I, J) * 256 + r * 16 + c


@triton.jit
def _chunk_matrix(base, chunk):
    """The first entry of chunk ``chunk``'s matrix in a buffer of chunk matrices (``[..., 10, 16,
    16]``)."""
    return base + chunk * (10 * 256)


@triton.jit
def _store_tile(matrix, I: tl.constexpr, J: tl.constexpr, tile):
    """Store tile (I, J) of a chunk matrix (rows 16 I, columns 16 J; ``matrix`` at its first
    entry), in its dtype."""
    r = tl.arange(0, 16)
    tl.store(matrix + _tile_entry(I, J, r[:, None], r[None, :]), tile.to(matrix.dtype.element_ty))


@triton.jit
def _sub_block_load(q, k, b, g, key_base, t0, I: tl.constexpr, T, HK, cols, col_ok):
    """The tiles of sub-block I (rows ``t0 + 16 I ...``) for one block of key columns as stored:
    q, k, b and g (``_sub_block``'s input)."""
    r = tl.arange(0, 16)
    t = t0 + I * 16 + r
    ok = (t < T)[:, None] & col_ok[None, :]
    offsets = key_base + t[:, None] * HK + cols[None, :]
    k_raw = tl.load(k + offsets, mask=ok, other=0.0)
    q_raw = tl.load(q + offsets, mask=ok, other=0.0)
    b_raw = tl.load(b + offsets, mask=ok, other=0.0)
    return q_raw, k_raw, b_raw, tl.load(g + offsets, mask=ok, other=0.0)


@triton.jit
def _chunk_load(q, k, b, g, key_base, t0, T, HK, cols, col_ok):
    """``_sub_block_load`` of all four sub-blocks, issued together so that their latencies overlap."""
    return (_sub_block_load(q, k, b, g, key_base, t0, 0, T, HK, cols, col_ok),
            _sub_block_load(q, k, b, g, key_base, t0, 1, T, HK, cols, col_ok),
            _sub_block_load(q, k, b, g, key_base, t0, 2, T, HK, cols, col_ok),
            _sub_block_load(q, k, b, g, key_base, t0, 3, T, HK, cols, col_ok))


@triton.jit
def _sub_block(q_raw, k_raw, b_raw, g_raw, I: tl.constexpr, key_bad, SPAN_SUMS: tl.constexpr):
    """Inputs and span sums of sub-block I from its stored tiles (``_sub_block_load``).

    Returns q, k, b * k ([16, BK] float32), the exponentials of the log decays' inclusive prefix
    ``L``, exclusive suffix ``R`` and the sub-block's total ``L + R`` ([16, BK]: each row the whole
    span's, with no reduction across rows; with ``SPAN_SUMS`` products, ``e^L e^R``), each sum
    over its own span, and ``key_bad``, updated to
    the chunk's first bad key-side entries so far ([16, BK] int32, elementwise: the least 16 M + r
    over the sub-blocks M seen whose k or b at row r is non-finite or whose g is NaN or +inf; 64
    where there is none; reduced once after the key loop).
    """
    r = tl.arange(0, 16)
    q_tile = q_raw.to(tl.float32)
    k_raw = k_raw.to(tl.float32)
    b_raw = b_raw.to(tl.float32)
    g_tile = g_raw.to(tl.float32)
    bad = (g_tile != _decay(g_tile)) | (k_raw != _finite(k_raw)) | (b_raw != _finite(b_raw))
    key_bad = tl.minimum(key_bad, tl.where(bad, I * 16 + r[:, None], 64))
    k_tile = _finite(k_raw)
    bk = _finite(b_raw) * k_tile
    decay = _decay(g_tile)
    if SPAN_SUMS != "scans":
        left, right = _span_sums_by_products(decay, SPAN_SUMS)
        whole = left * right
    else:
        L = tl.cumsum(decay, 0)
        R = _exclusive_suffix(decay)
        left, right, whole = _exp(L), _exp(R), _exp(L + R)
    return q_tile, k_tile, bk, left, right, whole, key_bad


@triton.jit
def _span_sums_by_products(decay, FORM: tl.constexpr):
    """The exponentials of ``tl.cumsum(decay, 0)`` and ``_exclusive_suffix(decay)`` of a [16, BK]
    tile of log decays, the sums as tensor-core products with 0/1 matrices, so that no scan runs
    across the rows' threads and warps: decay split exactly into three bfloat16 parts (8 + 8 + 8
    significant bits), each product exact and summed in float32, the smallest first. ``FORM``
    "products": two [16, 16] matrices (rows i sum rows 0..i, and rows i+1..15), six products;
    "stacked": both as one [32, 16] matrix (one warp's 16 rows each), three products, exponentials
    taken before the split (so that each warp takes its own rows' only). A hard reset (-inf)
    enters as -2^100, which a zero times leaves zero; every sum with it still gives an exponential
    of exactly 0 (sums of values <= 0 only: no NaN, at worst -inf). The 0/1 matrices go through
    float32 to bfloat16: the interpreter casts a boolean to bfloat16 as the integer pattern 1."""
    finite = tl.maximum(decay, -1.2676506002282294e30)  # -2^100, exact in bfloat16
    high = finite.to(tl.bfloat16)
    rest = finite - high.to(tl.float32)
    middle = rest.to(tl.bfloat16)
    low = (rest - middle.to(tl.float32)).to(tl.bfloat16)
    c = tl.arange(0, 16)
    if FORM == "stacked":
        r = tl.arange(0, 32)
        i = r[:, None] % 16
        summed = tl.where(r[:, None] < 16, c[None, :] <= i, c[None, :] > i)  # rows 0..i, then i+1..15
        spans = tl.where(summed, 1.0, 0.0).to(tl.bfloat16)
        sums = tl.dot(spans, high, tl.dot(spans, middle, tl.dot(spans, low)))  # [32, BK]
        L, R = tl.split(tl.permute(tl.reshape(_exp(sums), (2, 16, decay.shape[1])), (1, 2, 0)))
    else:
        inclusive = tl.where(c[None, :] <= c[:, None], 1.0, 0.0).to(tl.bfloat16)
        after = tl.where(c[None, :] > c[:, None], 1.0, 0.0).to(tl.bfloat16)
        L = tl.dot(inclusive, high, tl.dot(inclusive, middle, tl.dot(inclusive, low)))
        R = tl.dot(after, high, tl.dot(after, middle, tl.dot(after, low)))
        L, R = _exp(L), _exp(R)
    return L, R


@triton.jit
def _suffix_sums(later_inclusive, later_exclusive, inclusive, exclusive):
    """``_exclusive_suffix``'s combination: a span followed by the later span already summed (the
    reverse scan passes the later one first)."""
    return inclusive + later_inclusive, exclusive + later_inclusive


@triton.jit
def _exclusive_suffix(x):
    """The sums down the rows of x after each row, ``x[i + 1] + ... + x[last]`` (0 at the last
    row), as a reverse scan of (inclusive, exclusive) pairs: sums only, no difference, and no
    load of x one row on."""
    _, exclusive = tl.associative_scan((x, tl.zeros_like(x)), 0, _suffix_sums, reverse=True)
    return exclusive


@triton.jit
def _store_rows(base, I: tl.constexpr, K, cols, col_ok, tile):
    """Store a [16, BK] tile at rows 16 I of a chunk's [64, K] rows (``base`` at the chunk's first
    row), in the buffer's dtype; padded rows too (their tile is zero)."""
    r = tl.arange(0, 16)
    tl.store(base + (I * 16 + r[:, None]) * K + cols[None, :], tile.to(base.dtype.element_ty),
             mask=(r >= 0)[:, None] & col_ok[None, :])


@triton.jit
def _diagonal_kernel(
    q, k, g, b,  # inputs [B, T, H, K]
    P_out, A_out,  # [B, H, N, 10, 16, 16] (A float32; P float32 or bfloat16): this launch writes their diagonal tiles
    chunk_table, T, H, K: tl.constexpr, N, BK: tl.constexpr, DOT: tl.constexpr, PACKED: tl.constexpr,
    STAGES: tl.constexpr,
):
    """The diagonal 16x16 tiles of ``P`` (lower, with its diagonal) and ``A`` (strictly lower), one
    sub-block per program (``_diagonal_by_groups``: blocks of BK key columns, cross-group entries as
    products in ``DOT`` precision)."""
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_n = i_s // 4
    I = i_s % 4
    i_b = i_bh // H
    i_h = i_bh % H
    chunk_first, end = _chunk_span(chunk_table, i_n, T, PACKED)
    key_base = i_b * T * H * K + i_h * K  # the sequence and head's offset in the inputs
    chunk = i_bh * N + i_n
    tile = _tile_entry(I, I, 0, 0)  # the diagonal tile's first entry in its chunk's matrix
    _diagonal_by_groups(q + key_base, k + key_base, g + key_base, b + key_base,
                        _chunk_matrix(P_out, chunk) + tile, _chunk_matrix(A_out, chunk) + tile,
                        chunk_first + I * 16, end, H * K, K, BK, DOT, STAGES)


@triton.jit
def _position_rows(q, k, g, b, first, p: tl.constexpr, end, HK, cols, col_ok):
    """Rows ``4 G + p`` of a sub-block (position p of each group G = 0..3), as [4, BK] float32:
    q, k, b * k and the decays ``exp(g)`` (k and b non-finite read as 0, g as in ``_decay``; rows
    past end read as 0, a decay of 1)."""
    t = first + 4 * tl.arange(0, 4) + p
    rows = t[:, None] * HK + cols[None, :]
    ok = (t < end)[:, None] & col_ok[None, :]
    q_p = tl.load(q + rows, mask=ok, other=0.0).to(tl.float32)
    k_p = _load_finite(k + rows, ok)
    return q_p, k_p, _load_finite(b + rows, ok) * k_p, _exp(_load_decay(g + rows, ok))


@triton.jit
def _stack_positions(x0, x1, x2, x3, BK: tl.constexpr):
    """[16, BK] with row ``4 p + G`` holding ``x_p[G]`` (position-major: a dot operand)."""
    x = tl.join(tl.join(x0, x1), tl.join(x2, x3))  # [G, c, s, u] = x_{2u+s}
    return tl.reshape(tl.permute(x, (3, 2, 0, 1)), (16, BK))


@triton.jit
def _store_group_entry(tile, p: tl.constexpr, j: tl.constexpr, values):
    """``values[G]`` at row ``4 G + p``, column ``4 G + j`` of a diagonal tile, G = 0..3 (in the
    tile's dtype)."""
    G = tl.arange(0, 4)
    tl.store(tile + (4 * G + p) * 16 + 4 * G + j, values.to(tile.dtype.element_ty))


@triton.jit
def _diagonal_by_groups(q, k, g, b, P_tile, A_tile, first, end, HK, K: tl.constexpr, BK: tl.constexpr,
                        DOT: tl.constexpr, STAGES: tl.constexpr):
    """One diagonal tile (inputs at the sequence and head, ``P_tile``, ``A_tile`` at the tile's
    first entry, ``first`` the sub-block's first token) from its rows in four groups of four.

    Each position p of the groups is its own [4, BK] tile (rows ``4 G + p``), so that inside the
    groups a chain of per-step decays runs on all four groups at once in four steps,
    ``E_j <- E_j exp(g_p)`` (one exponential per entry of g), with nothing moved between rows.
    Across groups (group I > J), as in ``_intra_forward_kernel`` between sub-blocks: the
    products ``(x_I e^{L_I}) (k_J e^{R_J} prod t_M)^T`` over the groups M strictly between, with
    ``e^L`` the inclusive prefix product of the decays inside a group, ``e^R`` the exclusive
    suffix product (the step chain's E at the last step) and ``t_M`` a group's total, every factor
    <= 1. Two products per matrix cover every such block without masking an operand: adjacent
    groups (I = J + 1) with the spans inside the two groups, and groups 2, 3 against 0, 1 with the
    spans from and to the middle of the sub-block (``e^L`` times ``t_2`` in group 3, ``e^R``
    times ``t_1`` in group 0); each entry is selected from the product that holds it. The
    operands are stacked position-major (row ``4 p + G``), as the position tiles join without
    moving data. Masks are selects: a hard reset zeroes the spans through it, a bad q reaches its
    own row of P only."""
    G = tl.arange(0, 4)
    # each step sum's products kept per key column, summed over the columns once after the loop (a
    # sum across lanes per key block cost 2.178 against 2.129 ms forward)
    zero = tl.zeros((4, BK), dtype=tl.float32)
    P00, P10, P11, P20, P21, P22, P30, P31, P32, P33 = zero, zero, zero, zero, zero, zero, zero, zero, zero, zero
    A10, A20, A21, A30, A31, A32 = zero, zero, zero, zero, zero, zero
    P_near = tl.zeros((16, 16), dtype=tl.float32)
    A_near = P_near
    P_far = P_near
    A_far = P_near
    group = tl.arange(0, 16)[:, None] % 4  # of a stacked row
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        cols = k0 + tl.arange(0, BK)
        col_ok = cols < K
        # inside the groups, step p: E_j = exp(g_{j+1} + ... + g_p) for the positions j < p
        q0, k_0, bk0, e0 = _position_rows(q, k, g, b, first, 0, end, HK, cols, col_ok)
        P00 += k_0 * q0
        q1, k_1, bk1, e1 = _position_rows(q, k, g, b, first, 1, end, HK, cols, col_ok)
        E0 = e1
        kE0 = k_0 * E0
        P10 += kE0 * q1
        A10 += kE0 * bk1
        P11 += k_1 * q1
        q2, k_2, bk2, e2 = _position_rows(q, k, g, b, first, 2, end, HK, cols, col_ok)
        E0 = E0 * e2
        E1 = e2
        kE0 = k_0 * E0
        kE1 = k_1 * E1
        P20 += kE0 * q2
        A20 += kE0 * bk2
        P21 += kE1 * q2
        A21 += kE1 * bk2
        P22 += k_2 * q2
        q3, k_3, bk3, e3 = _position_rows(q, k, g, b, first, 3, end, HK, cols, col_ok)
        E0 = E0 * e3
        E1 = E1 * e3
        E2 = e3
        kE0 = k_0 * E0  # k e^R: the right factors
        kE1 = k_1 * E1
        kE2 = k_2 * E2
        P30 += kE0 * q3
        A30 += kE0 * bk3
        P31 += kE1 * q3
        A31 += kE1 * bk3
        P32 += kE2 * q3
        A32 += kE2 * bk3
        P33 += k_3 * q3

        # across the groups
        L1 = e0 * e1
        L2 = L1 * e2
        t = L2 * e3  # each group's total decay
        t1 = tl.sum(tl.where(G[:, None] == 1, t, 0.0), 0)[None, :]
        t2 = tl.sum(tl.where(G[:, None] == 2, t, 0.0), 0)[None, :]
        left_q = _stack_positions(q0 * e0, q1 * L1, q2 * L2, q3 * t, BK)
        left_bk = _stack_positions(bk0 * e0, bk1 * L1, bk2 * L2, bk3 * t, BK)
        right = _stack_positions(kE0, kE1, kE2, k_3, BK)
        # adjacent groups (I = J + 1): the spans inside the two groups
        P_near = tl.dot(left_q, tl.trans(right), P_near, input_precision=DOT)
        A_near = tl.dot(left_bk, tl.trans(right), A_near, input_precision=DOT)
        # groups 2, 3 against groups 0, 1: the spans from and to the middle of the sub-block
        from_middle = tl.where(group == 3, t2, 1.0)
        right = right * tl.where(group == 0, t1, 1.0)
        P_far = tl.dot(left_q * from_middle, tl.trans(right), P_far, input_precision=DOT)
        A_far = tl.dot(left_bk * from_middle, tl.trans(right), A_far, input_precision=DOT)

    P00, P10, P11, P20, P21 = tl.sum(P00, 1), tl.sum(P10, 1), tl.sum(P11, 1), tl.sum(P20, 1), tl.sum(P21, 1)
    P22, P30, P31, P32, P33 = tl.sum(P22, 1), tl.sum(P30, 1), tl.sum(P31, 1), tl.sum(P32, 1), tl.sum(P33, 1)
    A10, A20, A21 = tl.sum(A10, 1), tl.sum(A20, 1), tl.sum(A21, 1)
    A30, A31, A32 = tl.sum(A30, 1), tl.sum(A31, 1), tl.sum(A32, 1)

    # Stacked row 4 p + G is the tile's row 4 G + p. The products give the entries of earlier
    # groups (the rest selected away: a bad q makes its whole product row non-finite); the
    # entries inside the groups are stored from the step sums.
    stacked = tl.arange(0, 16)
    tile_row = 4 * (stacked % 4) + stacked // 4
    entries = tile_row[:, None] * 16 + tile_row[None, :]
    row_group = (stacked % 4)[:, None]
    column_group = (stacked % 4)[None, :]
    earlier = column_group < row_group
    inside_P = (column_group == row_group) & (stacked[None, :] // 4 <= stacked[:, None] // 4)
    inside_A = (column_group == row_group) & (stacked[None, :] // 4 < stacked[:, None] // 4)
    far = (row_group >= 2) & (column_group <= 1)
    P = tl.where(far, P_far, tl.where(earlier, P_near, 0.0))
    A = tl.where(far, A_far, tl.where(earlier, A_near, 0.0))
    tl.store(P_tile + entries, P.to(P_tile.dtype.element_ty), mask=~inside_P)
    tl.store(A_tile + entries, A.to(A_tile.dtype.element_ty), mask=~inside_A)
    _store_group_entry(P_tile, 0, 0, P00)
    _store_group_entry(P_tile, 1, 0, P10)
    _store_group_entry(P_tile, 1, 1, P11)
    _store_group_entry(P_tile, 2, 0, P20)
    _store_group_entry(P_tile, 2, 1, P21)
    _store_group_entry(P_tile, 2, 2, P22)
    _store_group_entry(P_tile, 3, 0, P30)
    _store_group_entry(P_tile, 3, 1, P31)
    _store_group_entry(P_tile, 3, 2, P32)
    _store_group_entry(P_tile, 3, 3, P33)
    _store_group_entry(A_tile, 1, 0, A10)
    _store_group_entry(A_tile, 2, 0, A20)
    _store_group_entry(A_tile, 2, 1, A21)
    _store_group_entry(A_tile, 3, 0, A30)
    _store_group_entry(A_tile, 3, 1, A31)
    _store_group_entry(A_tile, 3, 2, A32)


@triton.jit
def _load_chunk_matrix_stored(matrix):
    """One chunk's matrix (P, X, ``matrix`` at its first entry) whole as [64, 64], in its stored
    dtype, the tiles above the diagonal zero (not stored)."""
    rows = tl.arange(0, 64)
    I = rows[:, None] // 16
    J = rows[None, :] // 16
    # _tile_entry's offsets, written out: grouped so, ptxas spills 8 B less in the reverse state pass
    offsets = _tile_index(I, J) * 256 + (rows[:, None] % 16) * 16 + rows[None, :] % 16
    return tl.load(matrix + offsets, mask=I >= J, other=0.0)


@triton.jit
def _load_chunk_matrix_transposed(matrix):
    """``_load_chunk_matrix_stored`` transposed, read so from memory (row j, column i: entry (i, j))."""
    rows = tl.arange(0, 64)
    I = rows[None, :] // 16
    J = rows[:, None] // 16
    offsets = _tile_index(I, J) * 256 + (rows[None, :] % 16) * 16 + rows[:, None] % 16
    return tl.load(matrix + offsets, mask=I >= J, other=0.0)


@triton.jit
def _load_chunk_matrix(matrix):
    """``_load_chunk_matrix_stored`` as float32."""
    return _load_chunk_matrix_stored(matrix).to(tl.float32)


@triton.jit
def _load_tile(matrix, I: tl.constexpr, J: tl.constexpr):
    """Tile (I, J) of a chunk matrix (``matrix`` at its first entry) as float32."""
    r = tl.arange(0, 16)
    return tl.load(matrix + _tile_entry(I, J, r[:, None], r[None, :])).to(tl.float32)


@triton.jit
def _intra_forward_kernel(
    q, k, g, b,  # inputs [B, T, H, K]
    P_out,  # [B, H, N, 10, 16, 16], float32 or bfloat16 (the saved dtype)
    A_out,  # [B, H, N, 10, 16, 16] float32, beside A's diagonal tiles from _diagonal_kernel
    qd_out, kd_out, bkd_out,  # [B, H, N * 64, K]
    gamma_out,  # [B, H, N, K] float32
    key_first_bad_out,  # [B, H, N] int32: the chunk's first row with a bad k, b or g (64: none)
    chunk_table, T, H, K: tl.constexpr, N,
    BK: tl.constexpr, DOT: tl.constexpr, PACKED: tl.constexpr, STAGES: tl.constexpr, SPAN_SUMS: tl.constexpr,
):
    """The off-diagonal tiles of ``P`` and ``A`` of one chunk (A's beside its diagonal ones, for
    ``_inverse_kernel``; the inverse made here was slower, 2.569 against 2.375 ms forward: this
    launch's schedule with the substitution and the blocked products in it).

    Also the decayed queries and keys from the same key loop, ``qd = q exp(G)``, ``kd = k
    exp(G_last - G)``, ``gamma = exp(G_last)`` and the decayed erase keys ``bkd = b k exp(G)``
    (``exp(G_i) = e^{L_i} prod_{M<I} t_M``, ``exp(G_last - G_j) = e^{R_j} prod_{M>J} t_M``:
    products of span exponentials, each <= 1), each sub-block's rows
    stored once final; and where the chunk's key-side inputs first go bad (a non-finite k or b, a
    NaN or +inf g: ``key_first_bad_out``)."""
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    t0, end = _chunk_span(chunk_table, i_n, T, PACKED)
    HK = H * K
    key_base = i_b * T * HK + i_h * K  # + t * H * K + column
    chunk = i_bh * N + i_n
    A10, A20, A21, A30, A31, A32, P10, P20, P21, P30, P31, P32 = _off_diagonal_tiles(
        q, k, b, g, key_base, t0, end, HK, qd_out, kd_out, bkd_out, gamma_out, key_first_bad_out,
        chunk, K, BK, DOT, STAGES, SPAN_SUMS)
    _store_below(_chunk_matrix(P_out, chunk), P10, P20, P21, P30, P31, P32)
    _store_below(_chunk_matrix(A_out, chunk), A10, A20, A21, A30, A31, A32)


@triton.jit
def _inverse_kernel(
    A,  # [B, H, N, 10, 16, 16] float32, from _diagonal_kernel and _intra_forward_kernel (X_out itself when float32)
    X_out,  # [B, H, N, 10, 16, 16], float32 or bfloat16
    PRECISION: tl.constexpr,  # of every product: the operator's dot precision
):
    """``X = (I + A)^{-1}`` of one chunk, stored in X's dtype, from A's tiles as the diagonal and
    intra-forward launches stored them (float32; X's own buffer when X is float32: each A tile is
    read before X's tile in its place is written): the diagonal tiles by recursive doubling
    (``_doubled_inverse``), the others by the blocked formula ``X_IJ = -X_II sum_{J <= M < I}
    A_IM X_MJ``, products in ``PRECISION``, each tile stored as soon as it is final, X's upper
    tiles zero. sm_90a at one warp: 146 registers, capped at 128 (``MAX_REGISTERS``, 4 B of
    spills). TF32 in the blocked products took the forward from 2.312 to 2.283 ms and from 2.208
    to 2.181 ms, the errors against the spec unchanged at the check shapes."""
    chunk = tl.program_id(0).to(tl.int64)
    _invert_chunk(_chunk_matrix(A, chunk), _chunk_matrix(X_out, chunk), PRECISION)


@triton.jit
def _invert_chunk(A, X_out, PRECISION: tl.constexpr):
    """One chunk's X from its A (both at the chunk's first entry; the same buffer when X is
    float32)."""
    X00, X11, X22, X33 = _store_inverse_diagonal(X_out, A, PRECISION)
    # A's tiles below the diagonal loaded after the diagonal's inversion, so that they hold no
    # registers through it, and all read before X's tiles overwrite them
    A10, A20, A21 = _load_tile(A, 1, 0), _load_tile(A, 2, 0), _load_tile(A, 2, 1)
    A30, A31, A32 = _load_tile(A, 3, 0), _load_tile(A, 3, 1), _load_tile(A, 3, 2)
    tl.debug_barrier()
    _store_inverse_below(X_out, X00, X11, X22, X33, A10, A20, A21, A30, A31, A32, PRECISION)


@triton.jit
def _off_diagonal_tiles(q, k, b, g, key_base, t0, end, HK, qd_out, kd_out, bkd_out, gamma_out, key_first_bad_out,
                        chunk, K: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr,
                        SPAN_SUMS: tl.constexpr):
    """The key loop of ``_intra_forward_kernel``: returns A's and P's off-diagonal tiles, and stores
    qd, kd, bkd, gamma and the key side's first bad row of the chunk."""
    A10 = tl.zeros((16, 16), dtype=tl.float32)
    A20 = tl.zeros((16, 16), dtype=tl.float32)
    A21 = tl.zeros((16, 16), dtype=tl.float32)
    A30 = tl.zeros((16, 16), dtype=tl.float32)
    A31 = tl.zeros((16, 16), dtype=tl.float32)
    A32 = tl.zeros((16, 16), dtype=tl.float32)
    P10 = tl.zeros((16, 16), dtype=tl.float32)
    P20 = tl.zeros((16, 16), dtype=tl.float32)
    P21 = tl.zeros((16, 16), dtype=tl.float32)
    P30 = tl.zeros((16, 16), dtype=tl.float32)
    P31 = tl.zeros((16, 16), dtype=tl.float32)
    P32 = tl.zeros((16, 16), dtype=tl.float32)
    key_bad = tl.full((16, BK), 64, dtype=tl.int32)
    qd_out += chunk * 64 * K
    kd_out += chunk * 64 * K
    bkd_out += chunk * 64 * K

    # A and P, one block of key columns at a time; sub-blocks in order, so that the right factors
    # of earlier sub-blocks (k e^R times the decay of the sub-blocks between) are at hand.
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        cols = k0 + tl.arange(0, BK)
        col_ok = cols < K
        # every sub-block's loads issued before the first is used, so that their latencies overlap
        # (one after another, each sub-block waited for its own: 3.05 -> 2.85 ms forward; the order
        # inside a sub-block matters too: with q loaded before k, ptxas scheduled it to run 3.03)
        stored0, stored1, stored2, stored3 = _chunk_load(q, k, b, g, key_base, t0, end, HK, cols, col_ok)
        # each sub-block's e^L (left), e^R and whole decay; on sub-block 0, left is exp(G) and its
        # whole decay that of the sub-blocks before the next one
        q0, k0_, bk0, left, eR0, before, key_bad = _sub_block(*stored0, 0, key_bad, SPAN_SUMS)
        _store_rows(qd_out, 0, K, cols, col_ok, q0 * left)
        _store_rows(bkd_out, 0, K, cols, col_ok, bk0 * left)
        right0 = k0_ * eR0

        q1, k1, bk1, left, eR1, decay1, key_bad = _sub_block(*stored1, 1, key_bad, SPAN_SUMS)
        A10 += tl.dot(bk1 * left, tl.trans(right0), input_precision=DOT)
        P10 += tl.dot(q1 * left, tl.trans(right0), input_precision=DOT)
        left = left * before  # exp(G) on sub-block 1
        _store_rows(qd_out, 1, K, cols, col_ok, q1 * left)
        _store_rows(bkd_out, 1, K, cols, col_ok, bk1 * left)
        before = before * decay1
        right0 = right0 * decay1
        right1 = k1 * eR1

        q2, k2, bk2, left, eR2, decay2, key_bad = _sub_block(*stored2, 2, key_bad, SPAN_SUMS)
        # A's products before P's (each A after its P: intra-forward 0.717 -> 0.705 ms)
        A20 += tl.dot(bk2 * left, tl.trans(right0), input_precision=DOT)
        A21 += tl.dot(bk2 * left, tl.trans(right1), input_precision=DOT)
        P20 += tl.dot(q2 * left, tl.trans(right0), input_precision=DOT)
        P21 += tl.dot(q2 * left, tl.trans(right1), input_precision=DOT)
        left = left * before  # exp(G) on sub-block 2
        _store_rows(qd_out, 2, K, cols, col_ok, q2 * left)
        _store_rows(bkd_out, 2, K, cols, col_ok, bk2 * left)
        before = before * decay2
        right0 = right0 * decay2
        right1 = right1 * decay2
        right2 = k2 * eR2

        q3, k3, bk3, left, eR3, decay3, key_bad = _sub_block(*stored3, 3, key_bad, SPAN_SUMS)
        A30 += tl.dot(bk3 * left, tl.trans(right0), input_precision=DOT)
        A31 += tl.dot(bk3 * left, tl.trans(right1), input_precision=DOT)
        A32 += tl.dot(bk3 * left, tl.trans(right2), input_precision=DOT)
        P30 += tl.dot(q3 * left, tl.trans(right0), input_precision=DOT)
        P31 += tl.dot(q3 * left, tl.trans(right1), input_precision=DOT)
        P32 += tl.dot(q3 * left, tl.trans(right2), input_precision=DOT)
        left = left * before  # exp(G) on sub-block 3
        _store_rows(qd_out, 3, K, cols, col_ok, q3 * left)
        _store_rows(bkd_out, 3, K, cols, col_ok, bk3 * left)
        # the totals are tiles whose rows agree (to rounding): gamma from the first row
        r = tl.arange(0, 16)
        tl.store(gamma_out + chunk * K + r[:, None] * 0 + cols[None, :], before * decay3,
                 mask=(r == 0)[:, None] & col_ok[None, :])
        # exp(G_last - G_j): right_J already carries e^{R_J} and the decays up to sub-block 2
        _store_rows(kd_out, 0, K, cols, col_ok, right0 * decay3)
        _store_rows(kd_out, 1, K, cols, col_ok, right1 * decay3)
        _store_rows(kd_out, 2, K, cols, col_ok, right2 * decay3)
        _store_rows(kd_out, 3, K, cols, col_ok, k3 * eR3)

    tl.store(key_first_bad_out + chunk, tl.min(tl.min(key_bad, 1), 0))
    return A10, A20, A21, A30, A31, A32, P10, P20, P21, P30, P31, P32


@triton.jit
def _blocked(a, b, PRECISION: tl.constexpr):
    """A 16x16 product of the blocked inverse in the operator's dot precision ("tf32"; "ieee",
    exact float32; "tf32x3", three tensor-core passes, measured slower on the H200)."""
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _store_inverse_diagonal(matrix, A, PRECISION: tl.constexpr):
    """X's diagonal tiles (``_doubled_inverse``, the four side by side), returned too."""
    X00, X11, X22, X33 = (_doubled_inverse(_load_tile(A, 0, 0), PRECISION), _doubled_inverse(_load_tile(A, 1, 1), PRECISION),
                          _doubled_inverse(_load_tile(A, 2, 2), PRECISION), _doubled_inverse(_load_tile(A, 3, 3), PRECISION))
    tl.debug_barrier()  # every entry of A read before X's tiles overwrite them (X formed over A)
    _store_tile(matrix, 0, 0, X00)
    _store_tile(matrix, 1, 1, X11)
    _store_tile(matrix, 2, 2, X22)
    _store_tile(matrix, 3, 3, X33)
    return X00, X11, X22, X33


@triton.jit
def _store_inverse_below(matrix, X00, X11, X22, X33, A10, A20, A21, A30, A31, A32, PRECISION: tl.constexpr):
    """X's tiles below the diagonal, by the blocked formula (products in ``PRECISION``)."""
    X10 = -_blocked(X11, _blocked(A10, X00, PRECISION), PRECISION)
    _store_tile(matrix, 1, 0, X10)
    X21 = -_blocked(X22, _blocked(A21, X11, PRECISION), PRECISION)
    _store_tile(matrix, 2, 1, X21)
    X20 = -_blocked(X22, _blocked(A20, X00, PRECISION) + _blocked(A21, X10, PRECISION), PRECISION)
    _store_tile(matrix, 2, 0, X20)
    X32 = -_blocked(X33, _blocked(A32, X22, PRECISION), PRECISION)
    _store_tile(matrix, 3, 2, X32)
    X31 = -_blocked(X33, _blocked(A31, X11, PRECISION) + _blocked(A32, X21, PRECISION), PRECISION)
    _store_tile(matrix, 3, 1, X31)
    X30 = -_blocked(X33, _blocked(A30, X00, PRECISION) + _blocked(A31, X10, PRECISION) + _blocked(A32, X20, PRECISION),
                    PRECISION)
    _store_tile(matrix, 3, 0, X30)


@triton.jit
def _store_below(matrix, T10, T20, T21, T30, T31, T32):
    """The six 16x16 tiles below the diagonal of one chunk matrix, in its dtype."""
    _store_tile(matrix, 1, 0, T10)
    _store_tile(matrix, 2, 0, T20)
    _store_tile(matrix, 2, 1, T21)
    _store_tile(matrix, 3, 0, T30)
    _store_tile(matrix, 3, 1, T31)
    _store_tile(matrix, 3, 2, T32)


@triton.jit
def _load_uw(Uw, Uw_scale, v_ok):
    """A chunk's [64, BV] tile of Uw as float32 (``Uw`` at its entries, ``Uw_scale`` at its value
    columns): the saved tile times its column scales (``_value_products``)."""
    column_scale = tl.load(Uw_scale, mask=v_ok, other=1.0)
    return tl.load(Uw, mask=v_ok[None, :], other=0.0).to(tl.float32) * column_scale[None, :]


@triton.jit
def _value_products(v, w, X_tile, Uw_out, Uw_scale_out, first_bad_out, first_key_bad, t, row_ok, H, V: tl.constexpr,
                    BV: tl.constexpr, DOT: tl.constexpr, BFLOAT16_PRODUCTS: tl.constexpr, SCALED: tl.constexpr):
    """One chunk's ``Uw = X (w v)`` (``v``, ``w`` at the sequence and head; ``Uw_out`` at the
    chunk's first row, ``Uw_scale_out`` and ``first_bad_out`` at the chunk) and, per value
    column, its first bad row: a non-finite v or w in that column, or ``first_key_bad``,
    whichever comes first. ``SCALED`` (Uw_out float16): each column stored over its largest
    magnitude, which goes to ``Uw_scale_out`` (else 1), so that any Uw fits float16's range."""
    rows = tl.arange(0, 64)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        col_ok = cols < V
        offsets = t[:, None] * (H * V) + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        w_raw = tl.load(w + offsets, mask=mask, other=0.0).to(tl.float32)
        v_raw = tl.load(v + offsets, mask=mask, other=0.0).to(tl.float32)
        bad = (w_raw != _finite(w_raw)) | (v_raw != _finite(v_raw))
        first_bad = tl.minimum(tl.min(tl.where(bad, rows[:, None], 64), 0), first_key_bad)
        tl.store(first_bad_out + cols, first_bad, mask=col_ok)
        if BFLOAT16_PRODUCTS:  # X bfloat16 as stored, w v split (_split_dot)
            Uw = _split_dot(X_tile, _finite(w_raw) * _finite(v_raw), tl.zeros((64, BV), dtype=tl.float32))
        else:
            Uw = tl.dot(X_tile, _finite(w_raw) * _finite(v_raw), input_precision=DOT)
        if SCALED:
            largest = tl.max(tl.abs(Uw), 0)
            column_scale = tl.where(largest > 0, largest, 1.0)
            Uw = Uw / column_scale[None, :]
        else:
            column_scale = tl.full((BV,), 1.0, tl.float32)
        tl.store(Uw_scale_out + cols, column_scale, mask=col_ok)
        out = rows[:, None] * V + cols[None, :]
        tl.store(Uw_out + out, Uw.to(Uw_out.dtype.element_ty), mask=(rows >= 0)[:, None] & col_ok[None, :])


@triton.jit
def _wy_kernel(
    v, w,  # inputs [B, T, H, V]
    X,  # [B, H, N, 10, 16, 16] float32 or bfloat16, from _inverse_kernel
    bkd,  # [B, H, N * 64, K] float32 (or Wk_out itself): b k exp(G), from _intra_forward_kernel
    key_first_bad,  # [B, H, N] int32, from _intra_forward_kernel
    Wk_out,  # [B, H, N * 64, K]
    Uw_out,  # [B, H, N * 64, V]
    Uw_scale_out,  # [B, H, N, V] float32
    first_bad_out,  # [B, H, N, V] int32: per value column, the chunk's first row with a bad input (64: none)
    chunk_table, T, H, K: tl.constexpr, V: tl.constexpr, N,
    BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr, PACKED: tl.constexpr, BFLOAT16_PRODUCTS: tl.constexpr,
    SCALED: tl.constexpr,
):
    """The WY products of one chunk: ``Wk = X bkd`` and ``Uw = X (w v)`` (with ``SCALED``, over
    its largest magnitude per column: ``_value_products``) as whole-chunk [64, 64] x
    [64, block] products, and first_bad: the key side's first bad row (screened by
    ``_intra_forward_kernel``) or a non-finite v or w (its own column), whichever comes first.
    ``bkd`` may be ``Wk_out``'s own buffer: each [64, BK] tile is whole in the product before any
    of its Wk is stored (one program per chunk, distinct columns per step). With
    ``BFLOAT16_PRODUCTS`` (X and bkd bfloat16), the products run on X and bkd as stored."""
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    rows = tl.arange(0, 64)
    first, end = _chunk_span(chunk_table, i_n, T, PACKED)
    t = first + rows
    row_ok = t < end
    if BFLOAT16_PRODUCTS:
        X_tile = _load_chunk_matrix_stored(_chunk_matrix(X, i_bh * N + i_n))
    else:
        X_tile = _load_chunk_matrix(_chunk_matrix(X, i_bh * N + i_n))
    chunk_rows = (i_bh * N + i_n) * 64
    bkd += chunk_rows * K
    Wk_out += chunk_rows * K
    Uw_out += chunk_rows * V
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        out = rows[:, None] * K + cols[None, :]
        out_ok = (rows >= 0)[:, None] & (cols < K)[None, :]
        bkd_tile = tl.load(bkd + out, mask=out_ok, other=0.0)
        if BFLOAT16_PRODUCTS:
            Wk = tl.dot(X_tile, bkd_tile)
        else:
            Wk = tl.dot(X_tile, bkd_tile.to(tl.float32), input_precision=DOT)
        tl.store(Wk_out + out, Wk.to(Wk_out.dtype.element_ty), mask=out_ok)
    first_key_bad = tl.load(key_first_bad + i_bh * N + i_n)
    _value_products(v + i_b * T * H * V + i_h * V, w + i_b * T * H * V + i_h * V, X_tile, Uw_out,
                    Uw_scale_out + (i_bh * N + i_n) * V, first_bad_out + (i_bh * N + i_n) * V, first_key_bad, t,
                    row_ok, H, V, BV, DOT, BFLOAT16_PRODUCTS, SCALED)


def diagonal(q, k, g, b, P, A, dot_precision: str, chunk_table=None) -> None:
    """Launch ``_diagonal_kernel``: the diagonal 16x16 tiles of ``P`` and ``A`` (``[B, H, N, 10, 16,
    16]``; A float32, P float32 or bfloat16; ``intra_forward`` has ``A``'s written into X's buffer
    when X is float32), nothing else of either."""
    B, T, H, K = q.shape
    N = P.shape[2]
    BK = diagonal_key_block(K)
    _diagonal_kernel[(N * 4, B * H)](
        q, k, g, b, P, A, _table(chunk_table, P), T, H, K, N, BK=BK, DOT=dot_precision,
        PACKED=chunk_table is not None, STAGES=DIAGONAL_STAGES, num_warps=DIAGONAL_WARPS,
        num_stages=1, **register_cap("diagonal"),
    )


def diagonal_key_block(K: int) -> int:
    """Key columns per step of the diagonal tiles' key loop (``DIAGONAL_KEY_BLOCK``, at most the
    padded K)."""
    return min(DIAGONAL_KEY_BLOCK, max(16, triton.next_power_of_2(K)))


def intra_forward(q, k, v, g, b, w, qd, kd, Wk, Uw, Uw_scale, gamma, P, X, first_bad, dot_precision: str,
                  chunk_table=None) -> None:
    """Launch the in-chunk kernels: the diagonal tiles, the rest of P and A with the decays, X,
    then the WY products. Inputs ``[B, T, H, K|V]`` contiguous; outputs preallocated: ``qd, kd, Wk``
    ``[B, H, N * 64, K]``, ``Uw`` ``[B, H, N * 64, V]``, ``Uw_scale`` ``[B, H, N, V]`` float32 (Uw
    stored is Uw over it), ``gamma`` ``[B, H, N, K]``, ``P, X`` ``[B, H, N, 10, 16, 16]``
    (``TILES``) and ``first_bad`` ``[B, H, N, V]`` int32 (per chunk and value column, the first row
    with a non-finite input; 64 when there is none). Any of qd, kd, Wk, Uw, P and X may be
    bfloat16 (``SAVED_IN_BFLOAT16``), Uw float16 (scaled per chunk and value column: ``Uw_scale``,
    else 1): the kernels compute in float32 and round on the store. With packed sequences,
    ``chunk_table`` (``[chunks, 2]`` int32: first token, length) lists the chunks, B is 1 and N the
    table's length."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = P.shape[2]
    table, packed = _table(chunk_table, P), chunk_table is not None
    # A goes into X's own buffer when it is float32 (X is formed over it), else into a float32
    # scratch buffer (A rounded to bfloat16 before the inverse would cost accuracy the rounding of
    # X alone does not).
    A = X if X.dtype == torch.float32 else torch.empty(X.shape, dtype=torch.float32, device=X.device)
    diagonal(q, k, g, b, P, A, dot_precision, chunk_table)
    # b k exp(G) goes into Wk's own buffer when it is float32 (Wk = X bkd is formed in place), or
    # with DECAYED_ERASE_KEYS_IN_WK, else into a float32 scratch buffer dropped after the WY launch.
    in_place = Wk.dtype == torch.float32 or DECAYED_ERASE_KEYS_IN_WK
    bkd = Wk if in_place else torch.empty(Wk.shape, dtype=torch.float32, device=Wk.device)
    key_first_bad = torch.empty((B, H, N), dtype=torch.int32, device=Wk.device)
    _intra_forward_kernel[(N, B * H)](
        q, k, g, b, P, A, qd, kd, bkd, gamma, key_first_bad, table, T, H, K, N,
        BK=min(INTRA_FORWARD_KEY_BLOCK, max(16, triton.next_power_of_2(K))), DOT=dot_precision,
        PACKED=packed, STAGES=INTRA_FORWARD_STAGES, SPAN_SUMS=INTRA_FORWARD_SPAN_SUMS,
        num_warps=INTRA_FORWARD_WARPS, num_stages=1, **register_cap("intra_forward"),
    )
    _inverse_kernel[(B * H * N,)](A, X, PRECISION=dot_precision, num_warps=INVERSE_WARPS, num_stages=1,
                                  **register_cap("inverse"))
    _wy_kernel[(N, B * H)](
        v, w, X, bkd, key_first_bad, Wk, Uw, Uw_scale, first_bad, table, T, H, K, V, N,
        BK=min(WY_BLOCK, max(16, triton.next_power_of_2(K))), BV=min(WY_BLOCK, max(16, triton.next_power_of_2(V))),
        DOT=dot_precision, PACKED=packed,
        BFLOAT16_PRODUCTS=WY_BFLOAT16_PRODUCTS and X.dtype == bkd.dtype == torch.bfloat16,
        SCALED=Uw.dtype == torch.float16, num_warps=WY_WARPS, num_stages=1, **register_cap("wy"),
    )


@triton.jit
def _state_forward_kernel(
    Wk, kd, Uw, Uw_scale, gamma, first_bad,  # [B, H, N * 64, K | K | V], [B, H, N, V | K | V] (float32, int32)
    initial_state, states, U_out, final_state,  # [B, H, K, V], [B, H, N, K, V], [B, H, N * 64, V], [B, H, K, V]
    sequence_chunks, H, K: tl.constexpr, V: tl.constexpr, N,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr, DOT: tl.constexpr, PACKED: tl.constexpr,
    STAGES: tl.constexpr, SPLIT: tl.constexpr, ROUNDED_STATE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)  # the state's row: batch row (or sequence) and head
    chunk_first, chunk_end, head = _sequence_chunks(sequence_chunks, i_bh, H, N, PACKED)
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
    # The next chunks' Wk, kd and Uw do not depend on the state: with STAGES > 1 their loads are
    # issued ahead, while this chunk's products run.
    for i_n in tl.range(chunk_first, chunk_end, num_stages=STAGES):
        tl.store(states + (head * N + i_n) * K * V + state_offsets, state.to(states.dtype.element_ty), mask=state_mask)
        row0 = head * N * 64 + i_n * 64
        keys = (row0 + rows[:, None]) * K + cols_k[None, :]
        values = (row0 + rows[:, None]) * V + cols_v[None, :]
        decay = tl.load(gamma + (head * N + i_n) * K + cols_k, mask=k_ok, other=0.0)
        U = _load_uw(Uw + values, Uw_scale + (head * N + i_n) * V + cols_v, v_ok)
        # A bad input in this chunk: its value columns of the state leaving it are NaN (the chunk
        # ran on inputs with the bad values replaced by 0, so that no earlier row saw them). The
        # NaN is added to the decayed state, the products' accumulator: one FFMA an entry where a
        # select after the update took a multiply and a select.
        first_bad_row = tl.load(first_bad + (head * N + i_n) * V + cols_v, mask=v_ok, other=64)
        poison = tl.where(first_bad_row < 64, float("nan"), 0.0)
        if SPLIT:  # Wk and kd as stored (bfloat16), U split (_split_dot), the state rounded or split
            Wk_tile = tl.load(Wk + keys, mask=k_ok[None, :], other=0.0)
            kd_tile = tl.load(kd + keys, mask=k_ok[None, :], other=0.0)
            if ROUNDED_STATE:  # Wk S on S rounded to bfloat16 as stored above: one product
                U -= tl.dot(Wk_tile, state.to(tl.bfloat16))
            else:
                U -= _split_dot(Wk_tile, state, tl.zeros((64, BV), dtype=tl.float32))
            tl.store(U_out + values, U.to(U_out.dtype.element_ty), mask=v_ok[None, :])
            # the state update on U as computed, not as saved: on a bfloat16 U as saved, one
            # product, the final state's error was 3-8x, o's the same (bench/RESULTS.md)
            state = _split_dot(tl.trans(kd_tile), U, state * decay[:, None] + poison[None, :])
        else:
            # Products in float32 (TF32), every operand widened: float32 or float16 saved buffers,
            # or STATE_BFLOAT16_PRODUCTS off (an earlier form of this loop on bfloat16 operands was
            # built wrong by Triton 3.6 for the H200: non-finite states, illegal memory accesses).
            Wk_tile = tl.load(Wk + keys, mask=k_ok[None, :], other=0.0).to(tl.float32)
            kd_tile = tl.load(kd + keys, mask=k_ok[None, :], other=0.0).to(tl.float32)
            U -= tl.dot(Wk_tile, state, input_precision=DOT)
            tl.store(U_out + values, U.to(U_out.dtype.element_ty), mask=v_ok[None, :])
            state = tl.dot(tl.trans(kd_tile), U, state * decay[:, None] + poison[None, :], input_precision=DOT)
    if STORE_FINAL:
        tl.store(final_state + i_bh * K * V + state_offsets, state, mask=state_mask)


def chunk_value_block(V: int) -> int:
    """Columns of V per program in the output launch (one program per chunk, head and block of
    value columns), and the most the sequential passes take."""
    return min(64, max(16, triton.next_power_of_2(V)))


def value_block(V: int, programs_per_block: int, min_programs: int) -> int:
    """Columns of V per program in the sequential passes: smaller blocks when there are few heads,
    so that the GPU has at least ``min_programs`` programs."""
    block = chunk_value_block(V)
    while block > 16 and programs_per_block * triton.cdiv(V, block) < min_programs:
        block //= 2
    return block


@functools.lru_cache(maxsize=None)
def _shared_per_block(device: torch.device) -> int | None:
    """The bytes of shared memory a block may take on ``device`` as Triton reads it (the limit it
    checks a launch against), None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def state_value_block(V: int, programs_per_block: int, BK: int, split: bool, stages: int,
                      shared_per_block: int | None = None) -> int:
    """The state pass's value block (``value_block`` at ``STATE_SPLIT_MIN_PROGRAMS`` programs in
    the ``split`` form, else ``STATE_MIN_PROGRAMS``), at most 32 columns where its widened form
    loads ahead (``stages`` > 1) at BK > 64 on a device whose blocks may take less than
    ``STATE_WIDE_BLOCK_SHARED`` bytes of shared memory (``shared_per_block``; None: no limit)."""
    BV = value_block(V, programs_per_block, STATE_SPLIT_MIN_PROGRAMS if split else STATE_MIN_PROGRAMS)
    if (not split and stages > 1 and BK > 64 and shared_per_block is not None
            and shared_per_block < STATE_WIDE_BLOCK_SHARED):
        BV = min(BV, 32)
    return BV


def state_stages(BK: int, N: int, bfloat16: bool) -> int:
    """The state pass's ``STAGES`` for BK key rows and N chunks a row, Wk and kd saved in bfloat16
    or not: ``STATE_SPLIT_STAGES`` where its products run split (``STATE_BFLOAT16_PRODUCTS`` with
    ``bfloat16``), else ``STATE_STAGES``; loads ahead at K <= 128 only (the shared memory), and
    only over more than one chunk: Triton makes N = 1 a constant of the kernel, and its loop of one
    chunk then has nothing to load ahead (no asynchronous copies in the sm_90a build, half the
    shared memory)."""
    if BK > 128 or N <= 1:
        return 1
    return STATE_SPLIT_STAGES if STATE_BFLOAT16_PRODUCTS and bfloat16 else STATE_STAGES


def state_split_products(bfloat16: bool, stages: int) -> bool:
    """Whether the state pass runs its products on Wk and kd as stored, U (and the state, unless
    ``STATE_FORWARD_ROUNDED_STATE``) split (``_split_dot``): with ``STATE_BFLOAT16_PRODUCTS``, Wk
    and kd bfloat16 (``bfloat16``) and the loads issued ahead (``stages`` > 1). Triton 3.6 builds
    the split form without loads ahead wrong for the H200: an illegal memory access at K = 256
    (bench/RESULTS.md), where the widened form is right, and an invalid shared memory read over
    one chunk (N = 1: B=1 T=1 H=2 K=48 V=80, found by compute-sanitizer after a fault there),
    where ``state_stages`` is 1 now."""
    return STATE_BFLOAT16_PRODUCTS and bfloat16 and stages > 1


def state_products(bfloat16: bool, stages: int) -> dict:
    """The state pass's ``SPLIT`` and ``ROUNDED_STATE`` (``state_split_products``; the rounded
    state only in the split form), as the launch passes them."""
    split = state_split_products(bfloat16, stages)
    return dict(SPLIT=split, ROUNDED_STATE=split and STATE_FORWARD_ROUNDED_STATE)


def state_forward(Wk, kd, Uw, Uw_scale, gamma, first_bad, initial_state, states, U, final_state, dot_precision: str,
                  sequence_chunks=None) -> None:
    """Launch the sequential pass over chunks (writes ``states``, ``U`` and ``final_state``), one
    program per state row (batch row, or sequence with ``sequence_chunks``) and head."""
    B, H, N, K, V = states.shape
    rows = B if sequence_chunks is None else sequence_chunks.shape[0] - 1
    BK = max(16, triton.next_power_of_2(K))
    bfloat16 = Wk.dtype == kd.dtype == torch.bfloat16
    stages = state_stages(BK, N, bfloat16)
    products = state_products(bfloat16, stages)
    BV = state_value_block(V, rows * H, BK, products["SPLIT"], stages, _shared_per_block(states.device))
    _state_forward_kernel[(triton.cdiv(V, BV), rows * H)](
        Wk, kd, Uw, Uw_scale, gamma, first_bad,
        initial_state if initial_state is not None else states,
        states, U, final_state if final_state is not None else states,
        _table(sequence_chunks, states), H, K, V, N, BK=BK, BV=BV,
        HAS_INITIAL=initial_state is not None, STORE_FINAL=final_state is not None, DOT=dot_precision,
        PACKED=sequence_chunks is not None, STAGES=stages, **products, num_warps=STATE_WARPS, num_stages=1,
        **register_cap("state_forward"),
    )


@triton.jit
def _output_kernel(
    qd, P, states, U, first_bad, o,  # [B, H, N * 64, K], [B, H, N, 10, 16, 16], [B, H, N, K, V], [B, H, N * 64, V], [B, H, N, V], [B, T, H, V]
    chunk_table, scale, T, H, K: tl.constexpr, V: tl.constexpr, N,
    BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr, PACKED: tl.constexpr, BFLOAT16_PRODUCT: tl.constexpr,
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
    if BFLOAT16_PRODUCT and P.dtype.element_ty == tl.bfloat16 and U.dtype.element_ty == tl.bfloat16:
        out = tl.dot(_load_chunk_matrix_stored(_chunk_matrix(P, i_bh * N + i_n)), U_tile)  # both as stored: exact
    else:  # in float32 (TF32)
        U_tile = U_tile.to(tl.float32)
        out = tl.dot(_load_chunk_matrix(_chunk_matrix(P, i_bh * N + i_n)), U_tile, input_precision=DOT)
    state_base = (i_bh * N + i_n) * K * V
    for k0 in range(0, K, BK):
        cols_k = k0 + tl.arange(0, BK)
        k_ok = cols_k < K
        qd_tile = tl.load(qd + (row0 + rows[:, None]) * K + cols_k[None, :], mask=k_ok[None, :], other=0.0)
        S = tl.load(states + state_base + cols_k[:, None] * V + cols_v[None, :], mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        if BFLOAT16_PRODUCT and qd.dtype.element_ty == tl.bfloat16 and states.dtype.element_ty == tl.bfloat16:
            out = tl.dot(qd_tile, S, out)  # both bfloat16 as stored: their tensor-core product is exact
        else:
            out += tl.dot(qd_tile.to(tl.float32), S.to(tl.float32), input_precision=DOT)
    # From a chunk's first bad input on (per value column), the outputs are NaN, as on the
    # reference path; the rows before it are the clean run's.
    poisoned_from = tl.load(first_bad + (i_bh * N + i_n) * V + cols_v, mask=v_ok, other=64)
    out = tl.where(rows[:, None] >= poisoned_from[None, :], float("nan"), out)
    first, end = _chunk_span(chunk_table, i_n, T, PACKED)
    t = first + rows
    offsets = i_b * T * H * V + t[:, None] * (H * V) + i_h * V + cols_v[None, :]
    tl.store(o + offsets, (out * scale).to(o.dtype.element_ty), mask=(t < end)[:, None] & v_ok[None, :])


def output(qd, P, states, U, first_bad, o, scale: float, dot_precision: str, chunk_table=None) -> None:
    """Launch the output kernel (writes ``o`` ``[B, T, H, V]``)."""
    B, T, H, V = o.shape
    N, K = states.shape[2], states.shape[3]
    BK = min(OUTPUT_KEY_BLOCK, max(16, triton.next_power_of_2(K)))
    BV = chunk_value_block(V)
    _output_kernel[(triton.cdiv(V, BV), N, B * H)](
        qd, P, states, U, first_bad, o, _table(chunk_table, o), scale, T, H, K, V, N,
        BK=BK, BV=BV, DOT=dot_precision, PACKED=chunk_table is not None,
        BFLOAT16_PRODUCT=OUTPUT_BFLOAT16_PRODUCT,
        num_warps=OUTPUT_WARPS, num_stages=1, **register_cap("output"),
    )


def full_chunk_matrices(tiles: torch.Tensor) -> torch.Tensor:
    """Chunk matrices as stored (``[..., 10, 16, 16]``: the tiles on and below the diagonal, row
    by row) as whole ``[..., 64, 64]`` matrices, the tiles above the diagonal zero."""
    full = tiles.new_zeros(tiles.shape[:-3] + (CHUNK, CHUNK))
    index = 0
    for I in range(4):
        for J in range(I + 1):
            full[..., 16 * I:16 * I + 16, 16 * J:16 * J + 16] = tiles[..., index, :, :]
            index += 1
    return full


def _table(table, anything):
    """A chunk or sequence table, or any tensor in its place (the kernels then do not read it)."""
    return anything if table is None else table
