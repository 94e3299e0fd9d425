"""Metal source of the GDN-2 scan kernels (bodies for ``mx.fast.metal_kernel``).

The forward runs one threadgroup per (batch*head, value tile). A threadgroup is ``NS`` simdgroups
of 32 lanes; simdgroup ``s`` owns ``CPS`` value columns of the tile, and lane ``l`` of it owns the
key channels ``l, l + 32, ...`` (``KPL = ceil(K / 32)`` of them), so a state column ``S[:, j]`` of
``K`` floats lives in the registers of one simdgroup and the sums over ``K`` are ``simd_sum``.
The key-side vectors of a step (q, k, b*k, exp(g)) are the same for every value column, so the
threadgroup stages them once in threadgroup memory (between barriers) and every simdgroup reads
them from there.

The backward runs one threadgroup per batch * head over every value tile (one after another), so
the key-side gradients (sums over value columns) are summed inside the kernel: lanes over their
columns, the group over its simdgroups in threadgroup memory, the tiles in a per-chunk buffer.
It walks each chunk back in segments of ``R`` steps whose states it replays into ``held``, a
thread-private array ``[R][KPL][CPS]`` (registers: the loops that index it are unrolled with
``#pragma clang loop unroll(full)``, which Metal's compiler honours and g++ ignores); only the
segments' start states go to device memory. Checkpoints, segment start states and the saved dS
are laid out with the lane index fastest (``[..., column, i, lane]`` for key channel
``lane + 32 i``): every simd access is one 128-byte line.

Template parameters: ``InT`` input dtype; ``K, V`` sizes; ``KPL`` key channels per lane; ``NS``
simdgroups per group; ``CPS`` value columns per simdgroup; ``C`` checkpoint interval; ``L`` steps
staged per block (forward); ``SAVE`` write checkpoints; ``R`` steps per segment and ``SLOTS``
segment start states stored per chunk and tile (backward; ``scan.segment_slots``, which also sizes
the buffer).
Runtime: ``meta = [T, B, value tiles, H]``, ``scale[0]``.

The kernels use only the Metal subset that ``tests/metal_harness`` supports (see its README):
kernel-scope ``threadgroup`` arrays, ``threadgroup_barrier``, ``simd_sum``, ``metal::exp``,
conversions between ``InT`` and float.

Counted FLOP and bytes, threadgroup memory, registers per thread and the estimated M-series times
of both kernels (estimates: nothing was timed on a Mac) are in ``scan.py``'s docstring.
"""

from __future__ import annotations

FORWARD_INPUTS = ("q", "k", "v", "g", "b", "w", "state0", "meta", "scale")
FORWARD_OUTPUTS = ("o", "final_state", "checkpoints")

FORWARD_SOURCE = """
    // Forward scan: one state column per (simdgroup, column), key channels spread over lanes.
    const uint lane = thread_index_in_simdgroup;
    const uint sg = simdgroup_index_in_threadgroup;
    const uint tid = thread_position_in_threadgroup.x;
    const uint bh = threadgroup_position_in_grid.z;
    const uint tile = threadgroup_position_in_grid.y;
    const uint H = uint(meta[3]);
    const uint b_idx = bh / H;
    const uint h_idx = bh % H;
    const uint steps = uint(meta[0]);
    const uint n_checkpoints = (steps + C - 1) / C;
    const float scale_value = scale[0];
    const uint col0 = tile * (NS * CPS) + sg * CPS;

    threadgroup float staged_q[L * K];
    threadgroup float staged_k[L * K];
    threadgroup float staged_bk[L * K];
    threadgroup float staged_a[L * K];

    float S[KPL][CPS];
    for (uint i = 0; i < KPL; ++i) {
        const uint kk = lane + 32 * i;
        for (uint c = 0; c < CPS; ++c) {
            const uint j = col0 + c;
            S[i][c] = (kk < K && j < V) ? state0[(ulong(bh) * K + kk) * V + j] : 0.0f;
        }
    }

    for (uint t0 = 0; t0 < steps; t0 += L) {
        const uint block = metal::min(uint(L), steps - t0);
        // Stage the key-side vectors of `block` steps; padding steps leave the state unchanged.
        for (uint e = tid; e < L * K; e += NS * 32) {
            const uint l = e / K;
            const uint kk = e % K;
            float qv = 0.0f, kv = 0.0f, bkv = 0.0f, av = 1.0f;
            if (l < block) {
                const ulong off = ((ulong(b_idx) * steps + t0 + l) * H + h_idx) * K + kk;
                qv = float(q[off]);
                kv = float(k[off]);
                bkv = float(b[off]) * kv;
                av = metal::exp(float(g[off]));
            }
            staged_q[e] = qv;
            staged_k[e] = kv;
            staged_bk[e] = bkv;
            staged_a[e] = av;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        for (uint l = 0; l < block; ++l) {
            const uint t = t0 + l;
            if (SAVE && t % C == 0) {
                for (uint i = 0; i < KPL; ++i) {
                    const uint kk = lane + 32 * i;
                    for (uint c = 0; c < CPS; ++c) {
                        const uint j = col0 + c;
                        if (kk < K && j < V) {
                            checkpoints[((ulong(bh) * n_checkpoints + t / C) * V + j) * (KPL * 32) + kk] = S[i][c];
                        }
                    }
                }
            }
            for (uint c = 0; c < CPS; ++c) {
                const uint j = col0 + c;
                const ulong off_v = ((ulong(b_idx) * steps + t) * H + h_idx) * V + j;
                const float wv = (j < V) ? float(w[off_v]) * float(v[off_v]) : 0.0f;
                float erased_part = 0.0f;
                for (uint i = 0; i < KPL; ++i) {
                    const uint kk = lane + 32 * i;
                    if (kk < K) {
                        erased_part += staged_bk[l * K + kk] * staged_a[l * K + kk] * S[i][c];
                    }
                }
                const float u = wv - simd_sum(erased_part);
                float out_part = 0.0f;
                for (uint i = 0; i < KPL; ++i) {
                    const uint kk = lane + 32 * i;
                    if (kk < K) {
                        S[i][c] = staged_a[l * K + kk] * S[i][c] + staged_k[l * K + kk] * u;
                        out_part += staged_q[l * K + kk] * S[i][c];
                    }
                }
                const float out_value = simd_sum(out_part);
                if (lane == 0 && j < V) {
                    o[off_v] = static_cast<InT>(scale_value * out_value);
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    for (uint i = 0; i < KPL; ++i) {
        const uint kk = lane + 32 * i;
        for (uint c = 0; c < CPS; ++c) {
            const uint j = col0 + c;
            if (kk < K && j < V) {
                final_state[(ulong(bh) * K + kk) * V + j] = S[i][c];
            }
        }
    }
"""

BACKWARD_INPUTS = ("q", "k", "v", "g", "b", "w", "d_o", "d_final", "checkpoints", "meta", "scale")
BACKWARD_OUTPUTS = ("d_q", "d_k", "d_v", "d_g", "d_b", "d_w", "d_state0", "segment_starts", "saved_dS", "key_sums")


def _replay_step(indent: str, t: str, source: str, target: str) -> str:
    """One forward step of this simdgroup's columns, ``target = step(source)`` at step ``t``: the
    same arithmetic wherever a state is replayed, so every replayed state has the same bits."""
    text = """
// Replay step TIME: SOURCE -> TARGET.
for (uint kk = tid; kk < K; kk += NS * 32) {
    const ulong off = ((ulong(b_idx) * steps + TIME) * H + h_idx) * K + kk;
    const float kv = float(k[off]);
    staged_k[kk] = kv;
    staged_bk[kk] = float(b[off]) * kv;
    staged_a[kk] = metal::exp(float(g[off]));
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint c = 0; c < CPS; ++c) {
    const uint j = col0 + c;
    const ulong off_v = ((ulong(b_idx) * steps + TIME) * H + h_idx) * V + j;
    const float wv = (j < V) ? float(w[off_v]) * float(v[off_v]) : 0.0f;
    float erased_part = 0.0f;
    for (uint i = 0; i < KPL; ++i) {
        const uint kk = lane + 32 * i;
        if (kk < K) {
            erased_part += staged_bk[kk] * staged_a[kk] * SOURCE[i][c];
        }
    }
    const float u = wv - simd_sum(erased_part);
    for (uint i = 0; i < KPL; ++i) {
        const uint kk = lane + 32 * i;
        TARGET[i][c] = (kk < K) ? staged_a[kk] * SOURCE[i][c] + staged_k[kk] * u : 0.0f;
    }
}
threadgroup_barrier(mem_flags::mem_threadgroup);"""
    text = text.replace("TIME", t).replace("SOURCE", source).replace("TARGET", target)
    return "\n".join(indent + line if line else line for line in text.split("\n"))


BACKWARD_SOURCE = """
    // Reverse scan, one threadgroup per batch * head covering every value column: per chunk of C
    // steps (last first) and per value tile, walk the chunk backwards in segments of R steps,
    // last first, applying the adjoint of each step. A segment's R states (each thread's
    // [KPL][CPS] slice of them) are replayed into `held`, a thread-private array indexed only by
    // unrolled loops, so they stay in registers: no per-step state goes to device memory. The
    // start state of a segment is the chunk's checkpoint (the first), left in held[0] by the
    // chunk's first replay (the last), or written by that replay to segment_starts (the others,
    // ceil(C / R) - 2 per chunk and tile). dS of a tile is kept between chunks in saved_dS.
    // Key-side gradients (dq, sum_j dS u, dg, d(b k)) are sums over value columns: lanes sum
    // their columns, the group its simdgroups (threadgroup memory), and the tiles are summed in
    // key_sums[C, 4, K] (each key channel by one thread throughout, so no barrier orders these
    // device accesses); the last tile writes the gradients.
    const uint lane = thread_index_in_simdgroup;
    const uint sg = simdgroup_index_in_threadgroup;
    const uint tid = thread_position_in_threadgroup.x;
    const uint bh = threadgroup_position_in_grid.z;
    const uint steps = uint(meta[0]);
    const uint tiles = uint(meta[2]);
    const uint H = uint(meta[3]);
    const uint b_idx = bh / H;
    const uint h_idx = bh % H;
    const uint n_checkpoints = (steps + C - 1) / C;
    const float scale_value = scale[0];
    constexpr uint KP = KPL * 32;  // key channels padded to whole lanes
    constexpr uint TILE = NS * CPS;

    threadgroup float staged_q[K];
    threadgroup float staged_k[K];
    threadgroup float staged_bk[K];
    threadgroup float staged_a[K];
    threadgroup float reduce_buffer[4 * NS * K];

    for (uint n = n_checkpoints; n-- > 0;) {
        const uint t_begin = n * C;
        const uint t_end = metal::min(steps, t_begin + C);
        const uint segments = (t_end - t_begin + R - 1) / R;
        const uint last_start = t_begin + (segments - 1) * R;
        for (uint tile = 0; tile < tiles; ++tile) {
            const uint col0 = tile * TILE + sg * CPS;
            float dS[KPL][CPS];
            float held[R][KPL][CPS];  // held[s]: the state before step (segment start + s)
            for (uint i = 0; i < KPL; ++i) {
                const uint kk = lane + 32 * i;
                for (uint c = 0; c < CPS; ++c) {
                    const uint j = col0 + c;
                    const bool inside = kk < K && j < V;
                    dS[i][c] = !inside ? 0.0f
                             : (n + 1 == n_checkpoints) ? d_final[(ulong(bh) * K + kk) * V + j]
                                                        : saved_dS[(ulong(bh) * V + j) * KP + kk];
                    held[0][i][c] = inside ? checkpoints[((ulong(bh) * n_checkpoints + n) * V + j) * KP + kk] : 0.0f;
                }
            }

            // Replay the chunk from its checkpoint up to the last segment's start, storing the
            // start states of the segments between the first and the last.
            for (uint t = t_begin; t < last_start; ++t) {
                if (t > t_begin && (t - t_begin) % R == 0) {
                    for (uint i = 0; i < KPL; ++i) {
                        const uint kk = lane + 32 * i;
                        for (uint c = 0; c < CPS; ++c) {
                            const uint j = col0 + c;
                            if (kk < K && j < V) {
                                const ulong slot = ulong(bh) * SLOTS + (t - t_begin) / R - 1;
                                segment_starts[(slot * TILE + sg * CPS + c) * KP + kk] = held[0][i][c];
                            }
                        }
                    }
                }
""" + _replay_step(" " * 16, "t", "held[0]", "held[0]") + """
            }

            for (uint m = segments; m-- > 0;) {
                const uint seg0 = t_begin + m * R;
                if (m + 1 < segments) {
                    for (uint i = 0; i < KPL; ++i) {
                        const uint kk = lane + 32 * i;
                        for (uint c = 0; c < CPS; ++c) {
                            const uint j = col0 + c;
                            const bool inside = kk < K && j < V;
                            if (m == 0) {
                                held[0][i][c] = inside
                                    ? checkpoints[((ulong(bh) * n_checkpoints + n) * V + j) * KP + kk] : 0.0f;
                            } else {
                                const ulong slot = ulong(bh) * SLOTS + m - 1;
                                held[0][i][c] = inside ? segment_starts[(slot * TILE + sg * CPS + c) * KP + kk] : 0.0f;
                            }
                        }
                    }
                }

                // Replay the segment into registers (unrolled: held[s] needs constant indices).
                #pragma clang loop unroll(full)
                for (uint s = 1; s < R; ++s) {
                    if (seg0 + s < t_end) {
""" + _replay_step(" " * 24, "seg0 + s - 1", "held[s - 1]", "held[s]") + """
                    }
                }

                // Walk the segment backwards.
                #pragma clang loop unroll(full)
                for (uint s = R; s-- > 0;) {
                    const uint t = seg0 + s;
                    if (t >= t_end) {
                        continue;
                    }
                    for (uint kk = tid; kk < K; kk += NS * 32) {
                        const ulong off = ((ulong(b_idx) * steps + t) * H + h_idx) * K + kk;
                        const float kv = float(k[off]);
                        staged_q[kk] = float(q[off]);
                        staged_k[kk] = kv;
                        staged_bk[kk] = float(b[off]) * kv;
                        staged_a[kk] = metal::exp(float(g[off]));
                    }
                    threadgroup_barrier(mem_flags::mem_threadgroup);

                    float acc_q[KPL], acc_ku[KPL], acc_g[KPL], acc_bk[KPL];
                    for (uint i = 0; i < KPL; ++i) {
                        acc_q[i] = 0.0f;
                        acc_ku[i] = 0.0f;
                        acc_g[i] = 0.0f;
                        acc_bk[i] = 0.0f;
                    }
                    for (uint c = 0; c < CPS; ++c) {
                        const uint j = col0 + c;
                        const bool column = j < V;
                        const ulong off_v = ((ulong(b_idx) * steps + t) * H + h_idx) * V + j;
                        const float vv = column ? float(v[off_v]) : 0.0f;
                        const float wv = column ? float(w[off_v]) : 0.0f;
                        const float dov = column ? scale_value * float(d_o[off_v]) : 0.0f;
                        float D[KPL];
                        float erased_part = 0.0f;
                        for (uint i = 0; i < KPL; ++i) {
                            const uint kk = lane + 32 * i;
                            const float prev = (kk < K && column) ? held[s][i][c] : 0.0f;
                            D[i] = (kk < K) ? staged_a[kk] * prev : 0.0f;
                            erased_part += (kk < K) ? staged_bk[kk] * D[i] : 0.0f;
                        }
                        const float u = wv * vv - simd_sum(erased_part);
                        float du_part = 0.0f;
                        for (uint i = 0; i < KPL; ++i) {
                            const uint kk = lane + 32 * i;
                            if (kk < K) {
                                const float state_t = D[i] + staged_k[kk] * u;
                                acc_q[i] += state_t * dov;
                                dS[i][c] += staged_q[kk] * dov;
                                du_part += staged_k[kk] * dS[i][c];
                            }
                        }
                        const float du = simd_sum(du_part);
                        for (uint i = 0; i < KPL; ++i) {
                            const uint kk = lane + 32 * i;
                            if (kk < K) {
                                acc_ku[i] += dS[i][c] * u;
                                acc_bk[i] -= D[i] * du;
                                const float dD = dS[i][c] - staged_bk[kk] * du;
                                acc_g[i] += dD * D[i];
                                dS[i][c] = dD * staged_a[kk];
                            }
                        }
                        if (lane == 0 && column) {
                            d_v[off_v] = static_cast<InT>(du * wv);
                            d_w[off_v] = static_cast<InT>(du * vv);
                        }
                    }
                    for (uint i = 0; i < KPL; ++i) {
                        const uint kk = lane + 32 * i;
                        if (kk < K) {
                            reduce_buffer[(0 * NS + sg) * K + kk] = acc_q[i];
                            reduce_buffer[(1 * NS + sg) * K + kk] = acc_ku[i];
                            reduce_buffer[(2 * NS + sg) * K + kk] = acc_g[i];
                            reduce_buffer[(3 * NS + sg) * K + kk] = acc_bk[i];
                        }
                    }
                    threadgroup_barrier(mem_flags::mem_threadgroup);
                    // Sum over simdgroups, then over tiles. reduce_buffer is written next after
                    // the next step's first barrier, which every thread reaches only after this.
                    for (uint kk = tid; kk < K; kk += NS * 32) {
                        float total[4];
                        for (uint part = 0; part < 4; ++part) {
                            total[part] = 0.0f;
                            for (uint s2 = 0; s2 < NS; ++s2) {
                                total[part] += reduce_buffer[(part * NS + s2) * K + kk];
                            }
                            const ulong at = ((ulong(bh) * C + (t - t_begin)) * 4 + part) * K + kk;
                            if (tile > 0) {
                                total[part] += key_sums[at];
                            }
                            key_sums[at] = total[part];
                        }
                        if (tile + 1 == tiles) {
                            const ulong off = ((ulong(b_idx) * steps + t) * H + h_idx) * K + kk;
                            const float kv = float(k[off]);
                            d_q[off] = static_cast<InT>(total[0]);
                            d_k[off] = static_cast<InT>(total[1] + total[3] * float(b[off]));
                            d_g[off] = static_cast<InT>(total[2]);
                            d_b[off] = static_cast<InT>(total[3] * kv);
                        }
                    }
                }
            }

            for (uint i = 0; i < KPL; ++i) {
                const uint kk = lane + 32 * i;
                for (uint c = 0; c < CPS; ++c) {
                    const uint j = col0 + c;
                    if (kk < K && j < V) {
                        if (n == 0) {
                            d_state0[(ulong(bh) * K + kk) * V + j] = dS[i][c];
                        } else {
                            saved_dS[(ulong(bh) * V + j) * KP + kk] = dS[i][c];
                        }
                    }
                }
            }
        }
    }
"""
