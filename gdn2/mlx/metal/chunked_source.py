"""Metal source of the chunked (WY) GDN-2 kernels (bodies for ``mx.fast.metal_kernel``).

The mathematics is ``gdn2/algorithm.py``'s (chunks of C steps, ``NT = C / 8`` blocks of 8 rows);
the launchers, shapes and cost counts are in ``chunked.py``. Four kernels:

* ``INTRA`` (one threadgroup per chunk and head): the erase and query-key interactions
  ``A[i, j] = sum_c b_ic k_ic k_jc E_ijc`` (j < i) and ``P[i, j] = sum_c q_ic k_jc E_ijc`` (j <= i),
  ``E_ijc = exp(g_{j+1,c} + ... + g_ic)``, and the inverse of ``I + A``.
* ``FORWARD`` (one threadgroup per value tile and head, sequential over chunks): the state in
  registers, the new values ``U = (I + A)^-1 (w v - (b k e^G) S)``, the output
  ``o = scale ((q e^G) S + P U)`` and the state update ``S <- e^{G_last} S + (k e^{G_last - G})^T U``;
  optionally the state entering each chunk and U (what the backward reads).
* ``STATE_BACKWARD`` (one threadgroup per value tile and head, reverse over chunks): the gradient
  of the state leaving each chunk, ``Z = (I + A)^-T dU`` (so ``dv = Z w``, ``dw = Z v``) and the
  initial state's gradient.
* ``BACKWARD`` (one threadgroup per chunk and head, parallel): every key-side gradient
  (q, k, g, b) of the chunk from the states, U, Z and d_o, one key tile of 8 channels at a time.

Decays (no exponent is ever positive, nothing is a difference of two long sums): inside a diagonal
8x8 block each ``E_ij`` is the exponent of the direct span sum ``g_{j+1} + ... + g_i``; an
off-diagonal tile (I > J) factors as ``left_i * right^(I)_j`` with ``left_i = exp(g_{8I} + ... + g_i)``
and ``right^(I)_j = exp(g_{j+1} + ... + g_{8I-1})``, both spans summed directly; the chunk-level
factors ``e^{G_i}``, ``e^{G_last - G_i}`` are prefix and suffix sums. A hard reset (g = -inf) gives
exp(-inf) = 0 in these factors and never meets a multiplication by zero, so it stays finite.
Masks are selections (``cond ? x : 0``), never products.

Products are 8x8 ``simdgroup_matrix`` tiles with float accumulation (inputs of any dtype are
converted to float when staged). A simdgroup owns 8 value columns in the sequential kernels (its
part of the state is ``ceil(K / 8)`` tiles in registers) and whole tiles in the parallel ones.
Internal buffers are float32 and padded: states ``[B, H, N, Kp, Vp]``, U and Z ``[B, H, N * C, Vp]``,
P and the inverse ``[B, H, N, C, C]`` (``Kp``, ``Vp``: K, V rounded up to 8; padding is zero), so
tiles load from them with ``simdgroup_load`` and no masks; the caller's arrays go through masked
loads and stores.

Template parameters: ``InT`` input dtype; ``K`` key dim; ``C`` chunk (16 or 32); ``NS`` simdgroups
per threadgroup; ``BK`` key channels staged per block. Runtime (``meta``): T, H, number of chunks,
V, and (forward) whether to save states and U. The kernels use only the Metal subset of
``tests/metal_harness`` (see its README).

Counted FLOP and bytes, threadgroup memory, registers per thread and the estimated M-series times
of each kernel (estimates: nothing was timed on a Mac) are in ``chunked.py``'s docstring.
"""

from __future__ import annotations

HEADER = """
// Loops over register arrays of tiles are unrolled, so that every index is a constant.
#define GDN2_UNROLL _Pragma("clang loop unroll(full)")

// m[r][c] = scale * x[(r0 + r) * stride + c0 + c] where r0 + r < rows and c0 + c < cols, else 0.
// Lane `lane` of the simdgroup holds row fm, columns fn and fn + 1 of the 8x8 tile (the layout of
// Apple GPUs; MLX's steel GEMM reads fragments the same way).
template <typename P>
inline void load_masked(thread simdgroup_float8x8& m, P x, uint r0, uint rows, ulong stride, uint c0, uint cols,
                        uint fm, uint fn, float scale) {
  for (uint e = 0; e < 2; ++e) {
    const uint r = r0 + fm, c = c0 + fn + e;
    m.thread_elements()[e] = (r < rows && c < cols) ? scale * float(x[ulong(r) * stride + c]) : 0.0f;
  }
}

// m[r][c] = x[...] * y[...] (two arrays of one layout), zero outside the bounds.
template <typename P, typename Q>
inline void load_product_masked(thread simdgroup_float8x8& m, P x, Q y, uint r0, uint rows, ulong stride, uint c0,
                                uint cols, uint fm, uint fn) {
  for (uint e = 0; e < 2; ++e) {
    const uint r = r0 + fm, c = c0 + fn + e;
    const ulong offset = ulong(r) * stride + c;
    m.thread_elements()[e] = (r < rows && c < cols) ? float(x[offset]) * float(y[offset]) : 0.0f;
  }
}

// x[(r0 + r) * stride + c0 + c] = scale * m[r][c] inside the bounds.
template <typename OutT, typename P>
inline void store_masked(thread simdgroup_float8x8& m, P x, uint r0, uint rows, ulong stride, uint c0, uint cols,
                         uint fm, uint fn, float scale) {
  for (uint e = 0; e < 2; ++e) {
    const uint r = r0 + fm, c = c0 + fn + e;
    if (r < rows && c < cols) {
      x[ulong(r) * stride + c] = static_cast<OutT>(scale * m.thread_elements()[e]);
    }
  }
}

// d += L r for a lower-triangular 8x8 tile L (threadgroup memory, rows ldl apart), each row i of
// the product summed over k <= i only: the matrix units would multiply the zeros above L's
// diagonal by later rows of r, and a NaN or Inf there (a bad input at a later step) would reach
// earlier outputs. r goes through this simdgroup's 64 floats of `scratch`.
inline void lower_multiply_accumulate(thread simdgroup_float8x8& d, const threadgroup float* L, uint ldl,
                                      thread simdgroup_float8x8& r, threadgroup float* scratch, uint fm, uint fn) {
  simdgroup_store(r, scratch, 8);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  float d0 = d.thread_elements()[0], d1 = d.thread_elements()[1];
  for (uint k = 0; k <= fm; ++k) {
    const float l = L[fm * ldl + k];
    d0 += l * scratch[k * 8 + fn];
    d1 += l * scratch[k * 8 + fn + 1];
  }
  d.thread_elements()[0] = d0;
  d.thread_elements()[1] = d1;
  simdgroup_barrier(mem_flags::mem_threadgroup);  // every lane has read r before scratch is reused
}

inline void tile_fill(thread simdgroup_float8x8& m, float value) {
  m = make_filled_simdgroup_matrix<float, 8>(value);
}

inline void tile_negate(thread simdgroup_float8x8& m) {
  m.thread_elements()[0] = -m.thread_elements()[0];
  m.thread_elements()[1] = -m.thread_elements()[1];
}
"""

# Shared opening of every kernel body.
_PROLOGUE = """
    const uint lane = thread_index_in_simdgroup;
    const uint sg = simdgroup_index_in_threadgroup;
    const uint tid = thread_position_in_threadgroup.x;
    const uint fm = ((lane / 4) & 4) + ((lane / 2) % 4);
    const uint fn = ((lane / 4) & 2) * 2 + (lane % 2) * 2;
    const uint steps = uint(meta[0]);
    const uint heads = uint(meta[1]);
    const uint chunks = uint(meta[2]);
    const uint bh = threadgroup_position_in_grid.z;
    const uint b_idx = bh / heads;
    const uint h_idx = bh % heads;
    constexpr uint NT = C / 8;
    constexpr uint KT = (K + 7) / 8;
    constexpr uint Kp = 8 * KT;
    constexpr uint THREADS = NS * 32;
    // rows of right^(I) for I = 1 .. NT - 1 (8 I rows each, from row 4 I (I - 1))
    constexpr uint RIGHT_ROWS = 4 * NT * (NT - 1);
    const ulong key_stride = ulong(heads) * K;
    const ulong key_base = (ulong(b_idx) * steps * heads + h_idx) * K;  // (b, t = 0, h, 0)
"""

_VALUE_PROLOGUE = """
    const uint V = uint(meta[3]);
    const uint Vp = (V + 7) / 8 * 8;
    const ulong value_stride = ulong(heads) * V;
    const ulong value_base = (ulong(b_idx) * steps * heads + h_idx) * V;
"""

INTRA_INPUTS = ("q", "k", "g", "b", "meta")
INTRA_OUTPUTS = ("P", "inverse")

INTRA_SOURCE = _PROLOGUE + """
    // A and P of chunk n, then the inverse of I + A. One threadgroup per (chunk, batch * head).
    const uint n = threadgroup_position_in_grid.y;
    const uint t0 = n * C;
    constexpr uint PAIRS = NT * (NT - 1) / 2;           // off-diagonal tiles I > J
    constexpr uint SLOTS = (2 * PAIRS + NS - 1) / NS;   // A and P tiles per simdgroup
    constexpr uint DIAG = NT * 36;                      // (i, j), j <= i, in the diagonal tiles
    constexpr uint DIAG_SLOTS = (DIAG + THREADS - 1) / THREADS;

    threadgroup float s_q[C * BK];
    threadgroup float s_k[C * BK];
    threadgroup float s_bk[C * BK];
    threadgroup float s_g[C * BK];
    threadgroup float s_qL[C * BK];             // q * left
    threadgroup float s_bkL[C * BK];            // b * k * left
    threadgroup float s_kR[4 * (C / 8) * (C / 8 - 1) * BK];    // k * right^(I)
    threadgroup float s_A[C * C];
    threadgroup float s_P[C * C];
    threadgroup float s_inv[C * C];
    threadgroup float s_scratch[NS * 64];

    simdgroup_float8x8 acc[SLOTS];
    GDN2_UNROLL
    for (uint s = 0; s < SLOTS; ++s) {
        tile_fill(acc[s], 0.0f);
    }
    float diag_A[DIAG_SLOTS];
    float diag_P[DIAG_SLOTS];
    GDN2_UNROLL
    for (uint s = 0; s < DIAG_SLOTS; ++s) {
        diag_A[s] = 0.0f;
        diag_P[s] = 0.0f;
    }

    for (uint kb = 0; kb < K; kb += BK) {
        threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous key block is no longer read
        for (uint e = tid; e < C * BK; e += THREADS) {
            const uint i = e / BK, c = e % BK;
            const bool valid = t0 + i < steps && kb + c < K;
            const ulong off = key_base + ulong(t0 + i) * key_stride + kb + c;
            const float kv = valid ? float(k[off]) : 0.0f;
            s_q[e] = valid ? float(q[off]) : 0.0f;
            s_k[e] = kv;
            s_bk[e] = valid ? float(b[off]) * kv : 0.0f;
            s_g[e] = valid ? float(g[off]) : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // Decay factors, one (channel, block) per thread: left over each 8-row block, and
        // right^(I) (rows j < 8 I, summed from the anchor row 8 I - 1 backwards).
        for (uint job = tid; job < BK * (2 * NT - 1); job += THREADS) {
            const uint c = job % BK, part = job / BK;
            float span = 0.0f;
            if (part < NT) {
                for (uint r = 0; r < 8; ++r) {
                    const uint e = (8 * part + r) * BK + c;
                    span += s_g[e];
                    const float left = metal::exp(span);
                    s_qL[e] = s_q[e] * left;
                    s_bkL[e] = s_bk[e] * left;
                }
            } else {
                const uint I = part - NT + 1;
                for (uint j = 8 * I; j-- > 0;) {
                    s_kR[(4 * I * (I - 1) + j) * BK + c] = s_k[j * BK + c] * metal::exp(span);
                    span += s_g[j * BK + c];
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // Off-diagonal tiles: (X * left)_I @ (k * right^(I))_J^T, X = b k (A) or q (P).
        GDN2_UNROLL
        for (uint s = 0; s < SLOTS; ++s) {
            const uint job = sg + NS * s;
            if (job < 2 * PAIRS) {
                uint I = 1, J = job / 2;
                while (J >= I) {
                    J -= I;
                    ++I;
                }
                const threadgroup float* X = (job % 2 == 0) ? s_bkL : s_qL;
                for (uint kk = 0; kk < BK; kk += 8) {
                    simdgroup_float8x8 x, y;
                    simdgroup_load(x, X + 8 * I * BK + kk, BK);
                    simdgroup_load(y, s_kR + (4 * I * (I - 1) + 8 * J) * BK + kk, BK, ulong2(0, 0), true);
                    simdgroup_multiply_accumulate(acc[s], x, y, acc[s]);
                }
            }
        }
        // Diagonal tiles, one (i, j) pair per thread: the span sum g_{j+1} + ... + g_i per channel.
        GDN2_UNROLL
        for (uint s = 0; s < DIAG_SLOTS; ++s) {
            const uint p = tid + THREADS * s;
            if (p < DIAG) {
                uint r = 0, w = p % 36;
                while (w > r) {
                    w -= r + 1;
                    ++r;
                }
                const uint i = 8 * (p / 36) + r, j = 8 * (p / 36) + w;
                float sum_A = 0.0f, sum_P = 0.0f;
                for (uint c = 0; c < BK; ++c) {
                    float span = 0.0f;
                    for (uint u = j + 1; u <= i; ++u) {
                        span += s_g[u * BK + c];
                    }
                    const float kd = s_k[j * BK + c] * metal::exp(span);
                    sum_A += s_bk[i * BK + c] * kd;
                    sum_P += s_q[i * BK + c] * kd;
                }
                diag_A[s] += sum_A;
                diag_P[s] += sum_P;
            }
        }
    }

    // A and P into threadgroup memory (zero above the diagonal, and on A's diagonal); the
    // inverse is zero above its diagonal blocks.
    GDN2_UNROLL
    for (uint s = 0; s < SLOTS; ++s) {
        const uint job = sg + NS * s;
        if (job < 2 * PAIRS) {
            uint I = 1, J = job / 2;
            while (J >= I) {
                J -= I;
                ++I;
            }
            simdgroup_store(acc[s], ((job % 2 == 0) ? s_A : s_P) + 8 * I * C + 8 * J, C);
        }
    }
    GDN2_UNROLL
    for (uint s = 0; s < DIAG_SLOTS; ++s) {
        const uint p = tid + THREADS * s;
        if (p < DIAG) {
            uint r = 0, w = p % 36;
            while (w > r) {
                w -= r + 1;
                ++r;
            }
            const uint i = 8 * (p / 36) + r, j = 8 * (p / 36) + w;
            s_A[i * C + j] = (i > j) ? diag_A[s] : 0.0f;
            s_P[i * C + j] = diag_P[s];
        }
    }
    for (uint e = tid; e < C * C; e += THREADS) {
        const uint i = e / C, j = e % C;
        if (j > i) {
            s_A[e] = 0.0f;
            s_P[e] = 0.0f;
        }
        if (j / 8 > i / 8) {
            s_inv[e] = 0.0f;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const ulong out = (ulong(bh) * chunks + n) * C * C;
    for (uint e = tid; e < C * C; e += THREADS) {
        P[out + e] = s_P[e];
    }
    // Diagonal blocks of the inverse by forward substitution, one column per thread, the columns
    // spread over the simdgroups.
    for (uint job = (tid % 32) * NS + tid / 32; job < NT * 8; job += THREADS) {
        const uint base = 8 * (job / 8), col = job % 8;
        float x[8];
        for (uint r = 0; r < 8; ++r) {
            float value = (r == col) ? 1.0f : 0.0f;
            for (uint m = col; m < r; ++m) {
                value -= s_A[(base + r) * C + base + m] * x[m];
            }
            x[r] = value;
            s_inv[(base + r) * C + base + col] = value;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Off-diagonal blocks, one block row at a time: X_IJ = -X_II sum_{J <= M < I} A_IM X_MJ.
    for (uint I = 1; I < NT; ++I) {
        for (uint J = sg; J < I; J += NS) {
            simdgroup_float8x8 sum, a, x;
            tile_fill(sum, 0.0f);
            for (uint M = J; M < I; ++M) {
                simdgroup_load(a, s_A + 8 * I * C + 8 * M, C);
                simdgroup_load(x, s_inv + 8 * M * C + 8 * J, C);
                simdgroup_multiply_accumulate(sum, a, x, sum);
            }
            tile_fill(a, 0.0f);
            lower_multiply_accumulate(a, s_inv + 8 * I * C + 8 * I, C, sum, s_scratch + 64 * sg, fm, fn);
            tile_negate(a);
            simdgroup_store(a, s_inv + 8 * I * C + 8 * J, C);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (uint e = tid; e < C * C; e += THREADS) {
        inverse[out + e] = s_inv[e];
    }
"""

# Staging of one key block (channels kb .. kb + BK - 1) of chunk n for the sequential kernels:
# every thread loads g (coalesced), one thread per channel sums it along the chunk in place, then
# every thread forms its elements. Prefix: G_i = g_0 + ... + g_i, x = q e^G, y = b k e^G,
# gamma = e^{G_last}. Suffix: x = k e^{g_{i+1} + ... + g_last}, gamma = e^{G_last}. Each runs
# between the caller's barrier before it and after it.
_STAGE_LOAD_G = """
            for (uint e = tid; e < C * BK; e += THREADS) {
                const uint i = e / BK, c = e % BK;
                const bool valid = t0 + i < steps && kb + c < K;
                s_x[e] = valid ? float(g[key_base + ulong(t0 + i) * key_stride + kb + c]) : 0.0f;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
"""

_STAGE_PREFIX = _STAGE_LOAD_G + """
            for (uint c = tid; c < BK; c += THREADS) {
                float G = 0.0f;
                for (uint i = 0; i < C; ++i) {
                    G += s_x[i * BK + c];
                    s_x[i * BK + c] = G;
                }
                s_gamma[c] = metal::exp(G);
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            for (uint e = tid; e < C * BK; e += THREADS) {
                const uint i = e / BK, c = e % BK;
                const bool valid = t0 + i < steps && kb + c < K;
                const ulong off = key_base + ulong(t0 + i) * key_stride + kb + c;
                const float decay = metal::exp(s_x[e]);
                s_x[e] = (valid ? float(q[off]) : 0.0f) * decay;
                s_y[e] = valid ? float(b[off]) * float(k[off]) * decay : 0.0f;
            }
"""

_STAGE_SUFFIX = _STAGE_LOAD_G + """
            for (uint c = tid; c < BK; c += THREADS) {
                float span = 0.0f;
                for (uint i = C; i-- > 0;) {
                    const float gi = s_x[i * BK + c];
                    s_x[i * BK + c] = span;
                    span += gi;
                }
                s_gamma[c] = metal::exp(span);
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            for (uint e = tid; e < C * BK; e += THREADS) {
                const uint i = e / BK, c = e % BK;
                const bool valid = t0 + i < steps && kb + c < K;
                const float decay = metal::exp(s_x[e]);
                s_x[e] = valid ? float(k[key_base + ulong(t0 + i) * key_stride + kb + c]) * decay : 0.0f;
            }
"""

_SEQUENTIAL_PROLOGUE = _PROLOGUE + _VALUE_PROLOGUE + """
    const uint col0 = threadgroup_position_in_grid.y * (NS * 8) + sg * 8;  // this simdgroup's 8 columns
    const bool active = col0 < Vp;  // uniform over the simdgroup
    const float scale_value = scale[0];

    threadgroup float s_P[C * C];
    threadgroup float s_inv[C * C];
    threadgroup float s_x[C * BK];
    threadgroup float s_y[C * BK];
    threadgroup float s_gamma[BK];
"""

# P and the inverse of chunk n into threadgroup memory. Their readers of the previous chunk are
# done: a key-block loop with barriers lies between.
_LOAD_CHUNK_MATRICES = """
        const ulong cc = (ulong(bh) * chunks + n) * C * C;
        for (uint e = tid; e < C * C; e += THREADS) {
            s_P[e] = P[cc + e];
            s_inv[e] = inverse[cc + e];
        }
"""

FORWARD_INPUTS = ("q", "k", "v", "g", "b", "w", "state0", "P", "inverse", "meta", "scale")
FORWARD_OUTPUTS = ("o", "final_state", "checkpoints", "new_values")

FORWARD_SOURCE = _SEQUENTIAL_PROLOGUE + """
    // Forward over the chunks of one (batch * head, value tile); meta[4] != 0: save the state
    // entering each chunk and U.
    threadgroup float s_scratch[NS * 64];
    const bool save = meta[4] != 0;
    simdgroup_float8x8 S[KT];
    GDN2_UNROLL
    for (uint kt = 0; kt < KT; ++kt) {
        load_masked(S[kt], state0 + ulong(bh) * K * V, 8 * kt, K, V, col0, V, fm, fn, 1.0f);
    }

    for (uint n = 0; n < chunks; ++n) {
        const uint t0 = n * C;
""" + _LOAD_CHUNK_MATRICES + """
        if (save && active) {
            GDN2_UNROLL
            for (uint kt = 0; kt < KT; ++kt) {
                simdgroup_store(S[kt], checkpoints + ((ulong(bh) * chunks + n) * Kp + 8 * kt) * Vp + col0, Vp);
            }
        }
        // (q e^G) S and (b k e^G) S, key block by key block
        simdgroup_float8x8 acc_q[NT], acc_u[NT], tile;
        GDN2_UNROLL
        for (uint I = 0; I < NT; ++I) {
            tile_fill(acc_q[I], 0.0f);
            tile_fill(acc_u[I], 0.0f);
        }
        GDN2_UNROLL
        for (uint kb = 0; kb < K; kb += BK) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
""" + _STAGE_PREFIX + """
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (active) {
                GDN2_UNROLL
                for (uint kk = 0; kk < BK / 8 && kb / 8 + kk < KT; ++kk) {
                    GDN2_UNROLL
                    for (uint I = 0; I < NT; ++I) {
                        simdgroup_load(tile, s_x + 8 * I * BK + 8 * kk, BK);
                        simdgroup_multiply_accumulate(acc_q[I], tile, S[kb / 8 + kk], acc_q[I]);
                        simdgroup_load(tile, s_y + 8 * I * BK + 8 * kk, BK);
                        simdgroup_multiply_accumulate(acc_u[I], tile, S[kb / 8 + kk], acc_u[I]);
                    }
                }
            }
        }
        if (active) {
            // U = (I + A)^-1 (w v - (b k e^G) S), in place from the last block row up
            GDN2_UNROLL
            for (uint I = 0; I < NT; ++I) {
                load_product_masked(tile, v + value_base, w + value_base, t0 + 8 * I, steps, value_stride, col0, V,
                                    fm, fn);
                acc_u[I].thread_elements()[0] = tile.thread_elements()[0] - acc_u[I].thread_elements()[0];
                acc_u[I].thread_elements()[1] = tile.thread_elements()[1] - acc_u[I].thread_elements()[1];
            }
            GDN2_UNROLL
            for (uint r = 0; r < NT; ++r) {
                const uint I = NT - 1 - r;
                simdgroup_float8x8 sum, x;
                tile_fill(sum, 0.0f);
                GDN2_UNROLL
                for (uint J = 0; J < I; ++J) {
                    simdgroup_load(x, s_inv + 8 * I * C + 8 * J, C);
                    simdgroup_multiply_accumulate(sum, x, acc_u[J], sum);
                }
                lower_multiply_accumulate(sum, s_inv + 8 * I * C + 8 * I, C, acc_u[I], s_scratch + 64 * sg, fm, fn);
                acc_u[I] = sum;
            }
            // o = scale ((q e^G) S + P U)
            GDN2_UNROLL
            for (uint I = 0; I < NT; ++I) {
                GDN2_UNROLL
                for (uint J = 0; J < I; ++J) {
                    simdgroup_load(tile, s_P + 8 * I * C + 8 * J, C);
                    simdgroup_multiply_accumulate(acc_q[I], tile, acc_u[J], acc_q[I]);
                }
                lower_multiply_accumulate(acc_q[I], s_P + 8 * I * C + 8 * I, C, acc_u[I], s_scratch + 64 * sg, fm, fn);
                store_masked<InT>(acc_q[I], o + value_base, t0 + 8 * I, steps, value_stride, col0, V, fm, fn,
                                  scale_value);
                if (save) {
                    simdgroup_store(acc_u[I], new_values + ((ulong(bh) * chunks + n) * C + 8 * I) * Vp + col0, Vp);
                }
            }
        }
        // S <- e^{G_last} S + (k e^{G_last - G})^T U
        GDN2_UNROLL
        for (uint kb = 0; kb < K; kb += BK) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
""" + _STAGE_SUFFIX + """
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (active) {
                GDN2_UNROLL
                for (uint kk = 0; kk < BK / 8 && kb / 8 + kk < KT; ++kk) {
                    const uint kt = kb / 8 + kk;
                    S[kt].thread_elements()[0] *= s_gamma[8 * kk + fm];
                    S[kt].thread_elements()[1] *= s_gamma[8 * kk + fm];
                    GDN2_UNROLL
                    for (uint I = 0; I < NT; ++I) {
                        simdgroup_load(tile, s_x + 8 * I * BK + 8 * kk, BK, ulong2(0, 0), true);
                        simdgroup_multiply_accumulate(S[kt], tile, acc_u[I], S[kt]);
                    }
                }
            }
        }
    }
    GDN2_UNROLL
    for (uint kt = 0; kt < KT; ++kt) {
        store_masked<float>(S[kt], final_state + ulong(bh) * K * V, 8 * kt, K, V, col0, V, fm, fn, 1.0f);
    }
"""

STATE_BACKWARD_INPUTS = ("q", "k", "v", "g", "b", "w", "d_o", "d_final", "P", "inverse", "meta", "scale")
STATE_BACKWARD_OUTPUTS = ("d_v", "d_w", "d_state0", "d_states", "z")

STATE_BACKWARD_SOURCE = _SEQUENTIAL_PROLOGUE + """
    // Reverse over the chunks of one (batch * head, value tile): dS is the gradient of the state
    // leaving chunk n; dU = scale P^T d_o + (k e^{G_last - G}) dS, Z = (I + A)^-T dU, and the state
    // entering the chunk gets e^{G_last} dS + (q e^G)^T scale d_o - (b k e^G)^T Z.
    simdgroup_float8x8 dS[KT];
    GDN2_UNROLL
    for (uint kt = 0; kt < KT; ++kt) {
        load_masked(dS[kt], d_final + ulong(bh) * K * V, 8 * kt, K, V, col0, V, fm, fn, 1.0f);
    }

    for (uint n = chunks; n-- > 0;) {
        const uint t0 = n * C;
""" + _LOAD_CHUNK_MATRICES + """
        if (active) {
            GDN2_UNROLL
            for (uint kt = 0; kt < KT; ++kt) {
                simdgroup_store(dS[kt], d_states + ((ulong(bh) * chunks + n) * Kp + 8 * kt) * Vp + col0, Vp);
            }
        }
        simdgroup_float8x8 acc[NT], d_out[NT], tile;
        GDN2_UNROLL
        for (uint I = 0; I < NT; ++I) {
            tile_fill(acc[I], 0.0f);
        }
        GDN2_UNROLL
        for (uint kb = 0; kb < K; kb += BK) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
""" + _STAGE_SUFFIX + """
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (active) {
                GDN2_UNROLL
                for (uint kk = 0; kk < BK / 8 && kb / 8 + kk < KT; ++kk) {
                    GDN2_UNROLL
                    for (uint I = 0; I < NT; ++I) {
                        simdgroup_load(tile, s_x + 8 * I * BK + 8 * kk, BK);
                        simdgroup_multiply_accumulate(acc[I], tile, dS[kb / 8 + kk], acc[I]);
                    }
                }
            }
        }
        if (active) {
            GDN2_UNROLL
            for (uint I = 0; I < NT; ++I) {
                load_masked(d_out[I], d_o + value_base, t0 + 8 * I, steps, value_stride, col0, V, fm, fn, scale_value);
            }
            // dU = P^T (scale d_o) + acc, then Z = (I + A)^-T dU, both in place from the first block row
            GDN2_UNROLL
            for (uint I = 0; I < NT; ++I) {
                GDN2_UNROLL
                for (uint J = I; J < NT; ++J) {
                    simdgroup_load(tile, s_P + 8 * J * C + 8 * I, C, ulong2(0, 0), true);
                    simdgroup_multiply_accumulate(acc[I], tile, d_out[J], acc[I]);
                }
            }
            GDN2_UNROLL
            for (uint I = 0; I < NT; ++I) {
                simdgroup_float8x8 sum;
                tile_fill(sum, 0.0f);
                GDN2_UNROLL
                for (uint J = I; J < NT; ++J) {
                    simdgroup_load(tile, s_inv + 8 * J * C + 8 * I, C, ulong2(0, 0), true);
                    simdgroup_multiply_accumulate(sum, tile, acc[J], sum);
                }
                acc[I] = sum;
            }
            GDN2_UNROLL
            for (uint I = 0; I < NT; ++I) {
                simdgroup_store(acc[I], z + ((ulong(bh) * chunks + n) * C + 8 * I) * Vp + col0, Vp);
                for (uint e = 0; e < 2; ++e) {
                    const uint t = t0 + 8 * I + fm, c = col0 + fn + e;
                    if (t < steps && c < V) {
                        const ulong off = value_base + ulong(t) * value_stride + c;
                        const float zv = acc[I].thread_elements()[e];
                        d_v[off] = static_cast<InT>(zv * float(w[off]));
                        d_w[off] = static_cast<InT>(zv * float(v[off]));
                    }
                }
                tile_negate(acc[I]);
            }
        }
        GDN2_UNROLL
        for (uint kb = 0; kb < K; kb += BK) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
""" + _STAGE_PREFIX + """
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (active) {
                GDN2_UNROLL
                for (uint kk = 0; kk < BK / 8 && kb / 8 + kk < KT; ++kk) {
                    const uint kt = kb / 8 + kk;
                    dS[kt].thread_elements()[0] *= s_gamma[8 * kk + fm];
                    dS[kt].thread_elements()[1] *= s_gamma[8 * kk + fm];
                    GDN2_UNROLL
                    for (uint I = 0; I < NT; ++I) {
                        simdgroup_load(tile, s_x + 8 * I * BK + 8 * kk, BK, ulong2(0, 0), true);
                        simdgroup_multiply_accumulate(dS[kt], tile, d_out[I], dS[kt]);
                        simdgroup_load(tile, s_y + 8 * I * BK + 8 * kk, BK, ulong2(0, 0), true);
                        simdgroup_multiply_accumulate(dS[kt], tile, acc[I], dS[kt]);
                    }
                }
            }
        }
    }
    GDN2_UNROLL
    for (uint kt = 0; kt < KT; ++kt) {
        store_masked<float>(dS[kt], d_state0 + ulong(bh) * K * V, 8 * kt, K, V, col0, V, fm, fn, 1.0f);
    }
"""

BACKWARD_INPUTS = ("q", "k", "g", "b", "d_o", "checkpoints", "d_states", "new_values", "z", "meta", "scale")
BACKWARD_OUTPUTS = ("d_q", "d_k", "d_g", "d_b")

BACKWARD_SOURCE = _PROLOGUE + _VALUE_PROLOGUE + """
    // Key-side gradients of chunk n, one key tile (8 channels) at a time. S: the state entering
    // the chunk, dS: the gradient of the state leaving it, U and Z = (I + A)^-T dU from the
    // sequential kernels.
    const uint n = threadgroup_position_in_grid.y;
    const uint t0 = n * C;
    const float scale_value = scale[0];
    const uint VT = Vp / 8;
    const ulong rows = (ulong(bh) * chunks + n) * C;     // first row of the chunk in U and Z
    const ulong state = (ulong(bh) * chunks + n) * Kp * Vp;
    constexpr uint TILES = NT * (NT + 1) / 2;           // tiles on and below the diagonal

    threadgroup float s_dP[C * C];
    threadgroup float s_dA[C * C];
    threadgroup float s_q[C * 8];
    threadgroup float s_k[C * 8];
    threadgroup float s_b[C * 8];
    threadgroup float s_g[C * 8];
    threadgroup float s_eG[C * 8];      // e^{G_i}
    threadgroup float s_dte[C * 8];     // e^{G_last - G_i}
    threadgroup float s_left[C * 8];
    threadgroup float s_qL[C * 8];      // q * left
    threadgroup float s_bkL[C * 8];     // b * k * left
    threadgroup float s_right[4 * (C / 8) * (C / 8 - 1) * 8];
    threadgroup float s_kR[4 * (C / 8) * (C / 8 - 1) * 8];  // k * right
    threadgroup float s_dQg[C * 8];     // d(q e^G) = scale d_o S^T
    threadgroup float s_dbkG[C * 8];    // d(b k e^G) = -Z S^T
    threadgroup float s_dKd[C * 8];     // d(k e^{G_last - G}) = U dS^T
    threadgroup float s_xA[C * 8];      // d(b k) through A (then dG)
    threadgroup float s_xP[C * 8];      // dq through P
    threadgroup float s_yA[C * 8];      // dk through A (then the exclusive prefix of dKd * Kd)
    threadgroup float s_yP[C * 8];      // dk through P
    threadgroup float s_gamma[8];
    threadgroup float s_dgamma[8];

    // dP = scale d_o U^T (j <= i) and dA = -Z U^T (j < i), summed over the value columns.
    for (uint job = sg; job < 2 * TILES; job += NS) {
        uint I = 0, J = job / 2;
        while (J > I) {
            J -= I + 1;
            ++I;
        }
        const bool is_P = job % 2 == 0;
        simdgroup_float8x8 sum, x, u;
        tile_fill(sum, 0.0f);
        for (uint vt = 0; vt < VT; ++vt) {
            if (is_P) {
                load_masked(x, d_o + value_base, t0 + 8 * I, steps, value_stride, 8 * vt, V, fm, fn, scale_value);
            } else {
                simdgroup_load(x, z + (rows + 8 * I) * Vp + 8 * vt, Vp);
            }
            simdgroup_load(u, new_values + (rows + 8 * J) * Vp + 8 * vt, Vp, ulong2(0, 0), true);
            simdgroup_multiply_accumulate(sum, x, u, sum);
        }
        for (uint e = 0; e < 2; ++e) {
            const uint i = 8 * I + fm, j = 8 * J + fn + e;
            const float value = sum.thread_elements()[e];
            sum.thread_elements()[e] = is_P ? (j <= i ? value : 0.0f) : (j < i ? -value : 0.0f);
        }
        simdgroup_store(sum, (is_P ? s_dP : s_dA) + 8 * I * C + 8 * J, C);
    }

    for (uint kt = 0; kt < KT; ++kt) {
        const uint kb = 8 * kt;
        // The previous key tile's last readers of these arrays are behind the barrier before its
        // dg loop.
        for (uint e = tid; e < C * 8; e += THREADS) {
            const uint i = e / 8, c = e % 8;
            const bool valid = t0 + i < steps && kb + c < K;
            const ulong off = key_base + ulong(t0 + i) * key_stride + kb + c;
            s_q[e] = valid ? float(q[off]) : 0.0f;
            s_k[e] = valid ? float(k[off]) : 0.0f;
            s_b[e] = valid ? float(b[off]) : 0.0f;
            s_g[e] = valid ? float(g[off]) : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // Decay factors and d gamma, one (channel, kind) per thread.
        for (uint job = tid; job < 8 * (2 * NT + 2); job += THREADS) {
            const uint c = job % 8, kind = job / 8;
            float span = 0.0f;
            if (kind == 0) {
                for (uint i = 0; i < C; ++i) {
                    span += s_g[i * 8 + c];
                    s_eG[i * 8 + c] = metal::exp(span);
                }
                s_gamma[c] = metal::exp(span);
            } else if (kind == 1) {
                for (uint i = C; i-- > 0;) {
                    s_dte[i * 8 + c] = metal::exp(span);
                    span += s_g[i * 8 + c];
                }
            } else if (kind == 2) {
                const ulong row = state + ulong(kb + c) * Vp;
                for (uint v = 0; v < Vp; ++v) {
                    span += d_states[row + v] * checkpoints[row + v];
                }
                s_dgamma[c] = span;
            } else if (kind < 3 + NT) {
                const uint I = kind - 3;
                for (uint r = 0; r < 8; ++r) {
                    const uint e = (8 * I + r) * 8 + c;
                    span += s_g[e];
                    const float left = metal::exp(span);
                    s_left[e] = left;
                    s_qL[e] = s_q[e] * left;
                    s_bkL[e] = s_b[e] * s_k[e] * left;
                }
            } else {
                const uint I = kind - 2 - NT;
                for (uint j = 8 * I; j-- > 0;) {
                    const float right = metal::exp(span);
                    s_right[(4 * I * (I - 1) + j) * 8 + c] = right;
                    s_kR[(4 * I * (I - 1) + j) * 8 + c] = s_k[j * 8 + c] * right;
                    span += s_g[j * 8 + c];
                }
            }
        }
        // scale d_o S^T, -Z S^T and U dS^T for block row I of this key tile.
        for (uint I = sg; I < NT; I += NS) {
            simdgroup_float8x8 dq, dbk, dkd, x, s;
            tile_fill(dq, 0.0f);
            tile_fill(dbk, 0.0f);
            tile_fill(dkd, 0.0f);
            for (uint vt = 0; vt < VT; ++vt) {
                simdgroup_load(s, checkpoints + state + ulong(kb) * Vp + 8 * vt, Vp, ulong2(0, 0), true);
                load_masked(x, d_o + value_base, t0 + 8 * I, steps, value_stride, 8 * vt, V, fm, fn, scale_value);
                simdgroup_multiply_accumulate(dq, x, s, dq);
                simdgroup_load(x, z + (rows + 8 * I) * Vp + 8 * vt, Vp);
                simdgroup_multiply_accumulate(dbk, x, s, dbk);
                simdgroup_load(s, d_states + state + ulong(kb) * Vp + 8 * vt, Vp, ulong2(0, 0), true);
                simdgroup_load(x, new_values + (rows + 8 * I) * Vp + 8 * vt, Vp);
                simdgroup_multiply_accumulate(dkd, x, s, dkd);
            }
            tile_negate(dbk);
            simdgroup_store(dq, s_dQg + 8 * I * 8, 8);
            simdgroup_store(dbk, s_dbkG + 8 * I * 8, 8);
            simdgroup_store(dkd, s_dKd + 8 * I * 8, 8);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // Adjoints of A = pair(b k, k) and P = pair(q, k) through the off-diagonal tiles:
        // dX_I = left_I * sum_{J < I} dM_IJ (k right^(I))_J, dY_J = sum_{I > J} right^(I)_J * dM_IJ^T (X left)_I.
        for (uint job = sg; job < 4 * NT; job += NS) {
            const uint which = job / NT, blk = job % NT;
            const threadgroup float* dM = (which % 2 == 0) ? s_dA : s_dP;
            simdgroup_float8x8 sum, a, y;
            tile_fill(sum, 0.0f);
            if (which < 2) {
                for (uint J = 0; J < blk; ++J) {
                    simdgroup_load(a, dM + 8 * blk * C + 8 * J, C);
                    simdgroup_load(y, s_kR + (4 * blk * (blk - 1) + 8 * J) * 8, 8);
                    simdgroup_multiply_accumulate(sum, a, y, sum);
                }
                for (uint e = 0; e < 2; ++e) {
                    sum.thread_elements()[e] *= s_left[(8 * blk + fm) * 8 + fn + e];
                }
                simdgroup_store(sum, ((which == 0) ? s_xA : s_xP) + 8 * blk * 8, 8);
            } else {
                const threadgroup float* X = (which == 2) ? s_bkL : s_qL;
                for (uint I = blk + 1; I < NT; ++I) {
                    simdgroup_load(a, dM + 8 * I * C + 8 * blk, C, ulong2(0, 0), true);
                    simdgroup_load(y, X + 8 * I * 8, 8);
                    simdgroup_multiply(a, a, y);
                    for (uint e = 0; e < 2; ++e) {
                        sum.thread_elements()[e] += a.thread_elements()[e] *
                                                    s_right[(4 * I * (I - 1) + 8 * blk + fm) * 8 + fn + e];
                    }
                }
                simdgroup_store(sum, ((which == 2) ? s_yA : s_yP) + 8 * blk * 8, 8);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // Per element (i, c): the diagonal tiles (span sums), then dq, dk, db and dG.
        for (uint e = tid; e < C * 8; e += THREADS) {
            const uint i = e / 8, c = e % 8, first = i & ~7u;
            float xA = s_xA[e], xP = s_xP[e], yA = s_yA[e], yP = s_yP[e], span = 0.0f;
            for (uint j = i; j-- > first;) {
                span += s_g[(j + 1) * 8 + c];
                const float kd = s_k[j * 8 + c] * metal::exp(span);
                xA += s_dA[i * C + j] * kd;
                xP += s_dP[i * C + j] * kd;
            }
            span = 0.0f;
            for (uint r = i + 1; r < first + 8; ++r) {
                span += s_g[r * 8 + c];
                const float decay = metal::exp(span);
                yA += s_dA[r * C + i] * s_b[r * 8 + c] * s_k[r * 8 + c] * decay;
                yP += s_dP[r * C + i] * s_q[r * 8 + c] * decay;
            }
            const float qi = s_q[e], ki = s_k[e], bi = s_b[e], bki = bi * ki;
            const float eG = s_eG[e], dte = s_dte[e];
            const float dQg = s_dQg[e], dbkG = s_dbkG[e], dKd = s_dKd[e];
            const float dP_diagonal = s_dP[i * C + i];  // P's diagonal does not depend on g
            const float d_bk = dbkG * eG + xA;
            if (t0 + i < steps && kb + c < K) {
                const ulong off = key_base + ulong(t0 + i) * key_stride + kb + c;
                d_q[off] = static_cast<InT>(dQg * eG + xP + dP_diagonal * ki);
                d_k[off] = static_cast<InT>(dKd * dte + yA + yP + dP_diagonal * qi + d_bk * bi);
                d_b[off] = static_cast<InT>(d_bk * ki);
            }
            s_xA[e] = dbkG * bki * eG + dQg * qi * eG + bki * xA - ki * yA + qi * xP - ki * yP;  // dG_i
            s_yA[e] = dKd * ki * dte;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // dg_i = sum_{s >= i} dG_s + sum_{s < i} dKd_s Kd_s + d gamma * gamma, one channel per thread.
        for (uint c = tid; c < 8; c += THREADS) {
            float before = 0.0f, after = 0.0f;
            for (uint i = 0; i < C; ++i) {
                const float term = s_yA[i * 8 + c];
                s_yA[i * 8 + c] = before;
                before += term;
            }
            const float gamma_term = s_dgamma[c] * s_gamma[c];
            for (uint i = C; i-- > 0;) {
                after += s_xA[i * 8 + c];
                if (t0 + i < steps && kb + c < K) {
                    d_g[key_base + ulong(t0 + i) * key_stride + kb + c] =
                        static_cast<InT>(after + s_yA[i * 8 + c] + gamma_term);
                }
            }
        }
    }
"""
