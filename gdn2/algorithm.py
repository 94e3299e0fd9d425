"""Chunked (WY) GDN-2 forward and its analytic backward, written once over the ``gdn2.xp`` shim.

Time is split into chunks of ``C`` tokens (the last one zero-padded: a step with ``k = 0`` and
``g = 0`` leaves the state unchanged). Inside a chunk, with ``G`` the cumulative log decay and
``S`` the state entering it::

    A[i, j] = sum_c b_ic k_ic k_jc exp(G_ic - G_jc)   (j < i)      erase interactions
    P[i, j] = sum_c q_ic k_jc exp(G_ic - G_jc)        (j <= i)     query-key interactions
    U       = (I + A)^{-1} (w * v) - (I + A)^{-1} (b * k * exp(G)) S   "new values"
    o       = scale * ((q * exp(G)) S + P U)
    S'      = exp(G_last) * S + (k * exp(G_last - G))^T U

Numerics: every exponent is a sum of log decays over a span, ``sum_{j < s <= i} g_s <= 0``,
never ``exp(G_i) * exp(-G_j)``, so nothing overflows for any ``g <= 0``; and each span is summed
directly rather than as the difference of two long cumulative sums, which in float32 would lose
the low digits of the exponent. ``PairDecay`` keeps these pairwise decays in blocks.

Hard resets (``g = -inf``, exp gives 0) are legal: masks are applied by ``where``, never by
multiplication (``-inf * 0`` is NaN), and no exponent is a difference (``inf - inf``).

Causality holds for bad values too (``screen``): a non-finite k, v, g (NaN or +inf), b or w at step
t must not reach the outputs before t, but a dense triangular product lets one NaN row reach every
row (``0 * NaN``). So each chunk runs on sanitized inputs (non-finite values replaced by 0), and
the outputs from the first bad step on (per value column for v and w, all columns for k, g, b),
the state leaving that chunk, and through it everything after in the same sequence, are set to
NaN explicitly: outputs before t are exactly those of the clean run, as on the reference path. A
non-finite input makes the loss NaN; the backward then returns NaN for every gradient of that
sequence and head (where the reference path's autodiff also gives NaN for most of them).

The chunk size is capped at the longest sequence (``effective_chunk_size``): a chunk longer than
the input would only add zero padding, and the in-chunk terms grow with the chunk.

The backward is the exact adjoint. It keeps only the inputs and the chunk-boundary states from the
forward and recomputes the in-chunk terms. Gated bilinear forms ``M = pair(X, Y)`` have the
adjoint ``dX = left(dM, Y)``, ``dY = right(dM, X)`` and contribute ``X * dX - Y * dY`` to ``dG``.
It is written in differentiable framework ops, so differentiating it (with the chunk states
recomputed from the inputs) gives exact second-order gradients.

Internal layout: ``[B, H, N, C, D]`` (N chunks of C steps); packed sequences
(``gdn2.packing``) start a chunk each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .packing import ChunkLayout, SequenceOffsets
from .xp import Ops


def effective_chunk_size(chunk_size: int, T: int, sequences: SequenceOffsets | None = None) -> int:
    """``chunk_size`` capped at the longest sequence (T, or the longest packed sequence): a chunk
    longer than the input only adds zero padding, and memory grows with the chunk."""
    longest = T if sequences is None else max(sequences.lengths)
    return max(1, min(int(chunk_size), longest))


def to_chunks(ops: Ops, x, chunk_size: int, layout: ChunkLayout | None = None):
    """``[B, T, H, D]`` -> ``[B, H, N, C, D]``, zero-padding T up to a multiple of C.

    With the ``layout`` of packed sequences (B = 1) every sequence is padded to whole chunks of its own.
    """
    B, T, H, D = x.shape
    if layout is not None:
        x = ops.take(ops.pad_time(x, 1), layout.token_of_slot, axis=1)
        T = x.shape[1]
    N = -(-T // chunk_size)
    if N * chunk_size != T:
        x = ops.pad_time(x, N * chunk_size - T)
    return ops.transpose(x.reshape(B, N, chunk_size, H, D), (0, 3, 1, 2, 4))


def from_chunks(ops: Ops, x, T: int, layout: ChunkLayout | None = None):
    """``[B, H, N, C, D]`` -> ``[B, T, H, D]`` (padding dropped)."""
    B, H, N, C, D = x.shape
    x = ops.transpose(x, (0, 2, 3, 1, 4)).reshape(B, N * C, H, D)
    if layout is not None:
        return ops.take(x, layout.slot_of_token, axis=1)
    return x[:, :T]


def _segments(layout: ChunkLayout | None, chunks: int):
    """(state row, first chunk, end chunk) for each independent run of the recurrence."""
    if layout is None:
        return [(None, 0, chunks)]
    return [(n, first, end) for n, (first, end) in enumerate(layout.chunk_ranges)]


def _state_rows(ops: Ops, state, row, shape, like):
    """The rows of ``state`` for one run (all rows when ``row`` is None), or zeros of ``shape``."""
    if state is None:
        return ops.zeros(shape, like=like)
    return state if row is None else state[row : row + 1]


def decay_pairs(ops: Ops, g):
    """``E[..., i, j, c] = exp(sum_{j < s <= i} g_sc)`` for ``j <= i``, else 0. ``g``: ``[..., C, K]``.

    The exponent is summed per pair (a cumsum down each column j), not taken as ``G_i - G_j``:
    with strong decay ``|G|`` reaches hundreds and the difference of two such float32 sums
    would lose the exponent's low digits (relative errors near 1e-4 in E).
    """
    C = g.shape[-2]
    strict = ops.lower(C, True, g)[:, :, None]
    exponent = ops.cumsum(ops.where(strict, g[..., :, None, :], 0.0), axis=-3)
    return ops.where(ops.lower(C, False, g)[:, :, None], ops.exp(exponent), 0.0)


def sum_after(ops: Ops, g):
    """``sum_{s > i} g_s`` along axis -2 of ``[..., C, K]``, each span summed directly."""
    tail = ops.cumsum(g, axis=-2, reverse=True)[..., 1:, :]
    return ops.concat([tail, ops.zeros(tuple(g.shape[:-2]) + (1, g.shape[-1]), like=g)], axis=-2)


def _blocks(x, blocks: int):
    """``[..., C, D]`` -> ``[..., blocks, C / blocks, D]``."""
    return x.reshape(*x.shape[:-2], blocks, x.shape[-2] // blocks, x.shape[-1])


class PairDecay:
    """The pairwise decays ``E[i, j, c] = exp(sum_{j < s <= i} g_sc)`` (``j <= i``) of a chunk, in
    blocks, and the three gated bilinear forms built on them.

    Diagonal blocks of ``block`` steps hold E explicitly (``[block, block, K]`` each). An
    off-diagonal block pair (I > J) factors through the steps between them,
    ``E_ij = exp(L_i) * exp(between_IJ) * exp(R_j)``, with ``L_i`` the decay from the start of
    block I to i, ``R_j`` from j to the end of block J, and ``between_IJ`` the blocks strictly in
    between: every exponent is a sum of log decays (``<= 0`` in normal use, never a difference of
    two large sums), and those blocks become matrix products. Memory per chunk drops from
    ``C * C * K`` to about ``C * block * K + (C / block)^2 * block * K``.
    """

    def __init__(self, ops: Ops, g, block: int = 8):
        C, K = g.shape[-2:]
        self.blocks = C // block if (C % block == 0 and C > block) else 1
        self.diagonal = decay_pairs(ops, _blocks(g, self.blocks))  # [..., n, c, c, K]
        if self.blocks == 1:
            return
        n = self.blocks
        g = _blocks(g, n)
        self.row_decay = ops.exp(ops.cumsum(g, axis=-2))  # exp(L_i)
        self.col_decay = ops.exp(sum_after(ops, g))  # exp(R_j)
        totals = ops.sum(g, axis=-2)  # [..., n, K]
        strict = ops.lower(n, True, g)
        inside = strict[:, None, :, None] & mT(strict)[None, :, :, None]  # [I, J, M, 1]: J < M < I
        between = ops.sum(ops.where(inside, totals[..., None, None, :, :], 0.0), axis=-2)  # [..., I, J, K]
        self.block_decay = ops.where(strict[:, :, None], ops.exp(between), 0.0)  # zero unless I > J
        self.block_eye = ops.eye(n, g)[:, :, None, None]

    def _full(self, ops, off_diagonal, diagonal):
        """Blocks ``[..., I, J, c, c]`` (+ diagonal ``[..., n, c, c]``) -> ``[..., C, C]``."""
        if self.blocks == 1:
            blocks = diagonal[..., None, :, :, :]
        else:
            blocks = off_diagonal + self.block_eye * diagonal[..., :, None, :, :]
        n, c = self.blocks, diagonal.shape[-1]
        axes = tuple(range(blocks.ndim - 4)) + tuple(blocks.ndim - 4 + i for i in (0, 2, 1, 3))
        return ops.transpose(blocks, axes).reshape(*blocks.shape[:-4], n * c, n * c)

    def _split(self, ops, M):
        """``[..., C, C]`` -> blocks ``[..., I, J, c, c]`` and the diagonal blocks ``[..., n, c, c]``."""
        n = self.blocks
        c = M.shape[-1] // n
        blocks = M.reshape(*M.shape[:-2], n, c, n, c)
        axes = tuple(range(blocks.ndim - 4)) + tuple(blocks.ndim - 4 + i for i in (0, 2, 1, 3))
        blocks = ops.transpose(blocks, axes)
        if n == 1:
            return blocks, blocks[..., 0, :, :, :]
        return blocks, ops.sum(blocks * self.block_eye, axis=-3)

    def pair(self, ops, X, Y):
        """``M[i, j] = sum_c X_ic Y_jc E_ijc``: ``[..., C, C]`` (zero above the diagonal)."""
        Xb, Yb = _blocks(X, self.blocks), _blocks(Y, self.blocks)
        diagonal = (Xb[..., :, None, :] * Yb[..., None, :, :] * self.diagonal).sum(-1)
        if self.blocks == 1:
            return self._full(ops, None, diagonal)
        X_rows = (Xb * self.row_decay)[..., :, None, :, :] * self.block_decay[..., :, :, None, :]  # [I, J, c, K]
        Y_cols = Yb * self.col_decay
        return self._full(ops, X_rows @ mT(Y_cols)[..., None, :, :, :], diagonal)

    def left(self, ops, dM, Y):
        """Adjoint of ``pair`` in X: ``dX[i, c] = sum_j dM_ij Y_jc E_ijc``."""
        blocks, diagonal = self._split(ops, dM)
        Yb = _blocks(Y, self.blocks)
        dX = (diagonal[..., None] * Yb[..., None, :, :] * self.diagonal).sum(-2)
        if self.blocks > 1:
            through = (blocks @ (Yb * self.col_decay)[..., None, :, :, :]) * self.block_decay[..., :, :, None, :]
            dX = dX + ops.sum(through, axis=-3) * self.row_decay
        return dX.reshape(Y.shape[:-2] + (dX.shape[-3] * dX.shape[-2], Y.shape[-1]))

    def right(self, ops, dM, X):
        """Adjoint of ``pair`` in Y: ``dY[j, c] = sum_i dM_ij X_ic E_ijc``."""
        blocks, diagonal = self._split(ops, dM)
        Xb = _blocks(X, self.blocks)
        dY = (diagonal[..., None] * Xb[..., :, None, :] * self.diagonal).sum(-3)
        if self.blocks > 1:
            through = (mT(blocks) @ (Xb * self.row_decay)[..., :, None, :, :]) * self.block_decay[..., :, :, None, :]
            dY = dY + ops.sum(through, axis=-4) * self.col_decay
        return dY.reshape(X.shape[:-2] + (dY.shape[-3] * dY.shape[-2], X.shape[-1]))


def mT(x):
    """Swap the last two axes (``.mT`` is not in every framework)."""
    axes = list(range(x.ndim if hasattr(x, "ndim") else len(x.shape)))
    axes[-1], axes[-2] = axes[-2], axes[-1]
    return x.transpose(axes) if not hasattr(x, "mT") else x.mT


@dataclass
class Intra:
    """In-chunk terms, all ``[B, H, N, ...]``."""

    G: object  # cumulative log decay [C, K]
    decay: PairDecay  # pairwise decays and the gated products on them
    bk: object  # b * k [C, K]
    P: object  # query-key interactions [C, C]
    inverse: object  # (I + A)^{-1} [C, C]
    Uw: object  # inverse @ (w * v) [C, V]
    Wk: object  # inverse @ (b * k * exp(G)) [C, K]
    Qg: object  # q * exp(G) [C, K]
    Kd: object  # k * exp(G_last - G) [C, K]
    decay_to_end: object  # exp(G_last - G) [C, K]
    gamma: object  # exp(G_last) [K]


def intra_chunk(ops: Ops, q, k, v, g, b, w) -> Intra:
    """Everything that does not depend on the state; parallel over all chunks."""
    C = q.shape[-2]
    G = ops.cumsum(g, axis=-2)
    decay = PairDecay(ops, g)
    # exp(sum_{s > i} g_s), the exponent summed directly for the same reason as in decay_pairs.
    decay_to_end = ops.exp(sum_after(ops, g))
    bk = b * k
    A = ops.where(ops.lower(C, True, G), decay.pair(ops, bk, k), 0.0)
    P = decay.pair(ops, q, k)
    inverse = ops.unit_lower_inverse(A)
    exp_G = ops.exp(G)
    G_last = G[..., C - 1 :, :]
    return Intra(
        G=G,
        decay=decay,
        bk=bk,
        P=P,
        inverse=inverse,
        Uw=inverse @ (w * v),
        Wk=inverse @ (bk * exp_G),
        Qg=q * exp_G,
        Kd=k * decay_to_end,
        decay_to_end=decay_to_end,
        gamma=ops.exp(G_last[..., 0, :]),
    )


def _finite(ops: Ops, k, v, g, b, w):
    """Per step, where the inputs are usable: ``(key_ok [..., C, 1], value_ok [..., C, V])``.
    ``g = -inf`` is a hard reset, not a bad value; NaN and +inf are."""
    key_ok = ops.isfinite(k) & ops.isfinite(b) & (g < math.inf)
    return ~ops.any(~key_ok, axis=-1, keepdims=True), ops.isfinite(v) & ops.isfinite(w)


def screen(ops: Ops, k, v, g, b, w):
    """The chunked inputs ``[..., C, D]`` with every non-finite value replaced by 0 (``g = -inf``
    kept), and ``poisoned [..., C, V]``: true at and after, within the chunk, the first step whose
    k, g or b (any key channel) or v or w (this value column) is not finite.

    Returns ``(k, v, g, b, w, poisoned)``.
    """
    key_ok, value_ok = _finite(ops, k, v, g, b, w)
    bad = ~(key_ok & value_ok)
    poisoned = ops.cumsum(ops.astype(bad, k.dtype), axis=-2) > 0
    k, v, b, w = (ops.where(ops.isfinite(x), x, 0.0) for x in (k, v, b, w))
    g = ops.where(g < math.inf, g, 0.0)
    return k, v, g, b, w, poisoned


def forward(
    ops: Ops, q, k, v, g, b, w, scale: float, initial_state, chunk_size: int, sequences: SequenceOffsets | None = None
):
    """Chunked forward.

    Inputs ``[B, T, H, D]`` in the compute dtype; ``initial_state`` ``[B, H, K, V]`` (``[N, ...]``
    with packed ``sequences``) or None. Returns ``(o [B, T, H, V], final_state, states [B, H,
    chunks, K, V])`` where ``states`` holds the state entering each chunk (what the backward needs).
    """
    T = q.shape[1]
    chunk_size = effective_chunk_size(chunk_size, T, sequences)
    layout = None if sequences is None else sequences.chunk_layout(chunk_size)
    q, k, g, b, v, w = (to_chunks(ops, x, chunk_size, layout) for x in (q, k, g, b, v, w))
    B, H, N, C, K = q.shape
    k, v, g, b, w, poisoned = screen(ops, k, v, g, b, w)
    leaving_poisoned = poisoned[..., C - 1 :, :]  # [B, H, N, 1, V]: the state leaving the chunk
    intra = intra_chunk(ops, q, k, v, g, b, w)
    states, new_values, final_states = [None] * N, [None] * N, []
    for row, first, end in _segments(layout, N):
        state = _state_rows(ops, initial_state, row, (B, H, K, v.shape[-1]), q)
        for n in range(first, end):
            states[n] = state
            new_values[n] = intra.Uw[:, :, n] - intra.Wk[:, :, n] @ state
            state = intra.gamma[:, :, n, :, None] * state + mT(intra.Kd[:, :, n]) @ new_values[n]
            state = ops.where(leaving_poisoned[:, :, n], math.nan, state)
        final_states.append(state)
    states = ops.stack(states, axis=2)
    U = ops.stack(new_values, axis=2)
    o = ops.where(poisoned, math.nan, scale * (intra.Qg @ states + intra.P @ U))
    return from_chunks(ops, o, T, layout), ops.concat(final_states, axis=0), states


def _poisoned_sequences(ops: Ops, q, k, v, g, b, w, layout: ChunkLayout | None):
    """Which (sequence, head) runs hold a non-finite input, q included: a mask ``[B, H, N, 1, 1]``
    per chunk and one ``[rows, H, 1, 1]`` per state row."""
    key_ok, value_ok = _finite(ops, k, v, g, b, w)
    step_bad = ~key_ok[..., 0] | ops.any(~value_ok, axis=-1) | ops.any(~ops.isfinite(q), axis=-1)  # [B, H, N, C]
    chunk_bad = ops.any(step_bad, axis=-1)  # [B, H, N]
    per_chunk, per_row = [], []
    for _, first, end in _segments(layout, chunk_bad.shape[-1]):
        run = ops.any(chunk_bad[:, :, first:end], axis=-1, keepdims=True)  # [B, H, 1]
        per_row.append(run)
        if end > first:
            per_chunk.append(run | chunk_bad[:, :, first:end])
    per_chunk = ops.concat(per_chunk, axis=-1)[..., None, None]
    return per_chunk, ops.concat(per_row, axis=0)[..., None]


def backward(
    ops: Ops, q, k, v, g, b, w, scale: float, states, d_o, d_final_state, chunk_size: int,
    sequences: SequenceOffsets | None = None,
):
    """Exact adjoint of ``forward``.

    ``states`` is forward's third output; ``d_o`` ``[B, T, H, V]``; ``d_final_state``
    ``[B, H, K, V]`` or None. Returns ``(dq, dk, dv, dg, db, dw, d_initial_state)`` in the compute
    dtype, inputs shaped ``[B, T, H, D]``.
    """
    T = q.shape[1]
    chunk_size = effective_chunk_size(chunk_size, T, sequences)
    layout = None if sequences is None else sequences.chunk_layout(chunk_size)
    q, k, g, b, v, w, d_o = (to_chunks(ops, x, chunk_size, layout) for x in (q, k, g, b, v, w, d_o))
    B, H, N, C, K = q.shape
    chunk_poisoned, row_poisoned = _poisoned_sequences(ops, q, k, v, g, b, w, layout)
    k, v, g, b, w, _ = screen(ops, k, v, g, b, w)
    intra = intra_chunk(ops, q, k, v, g, b, w)
    U = intra.Uw - intra.Wk @ states
    inclusive, strict = ops.tril(C, False, q), ops.tril(C, True, q)

    # o = scale * (Qg S + P U)
    d_Qg = scale * (d_o @ mT(states))
    d_P = scale * (d_o @ mT(U)) * inclusive
    d_U = scale * (mT(intra.P) @ d_o)

    # Reverse pass over chunks: d_state is the gradient of the state leaving chunk n.
    d_leaving, d_initial_states = [None] * N, []
    for row, first, end in _segments(layout, N):
        d_state = _state_rows(ops, d_final_state, row, (B, H, K, v.shape[-1]), q)
        for n in reversed(range(first, end)):
            d_leaving[n] = d_state
            d_U_n = d_U[:, :, n] + intra.Kd[:, :, n] @ d_state
            d_state = (
                intra.gamma[:, :, n, :, None] * d_state
                + mT(intra.Qg[:, :, n]) @ (scale * d_o[:, :, n])
                - mT(intra.Wk[:, :, n]) @ d_U_n
            )
        d_initial_states.append(d_state)
    d_initial_state = ops.concat(d_initial_states, axis=0)
    d_leaving = ops.stack(d_leaving, axis=2)

    # S' = gamma * S + Kd^T U ;  U = Uw - Wk S
    d_U = d_U + intra.Kd @ d_leaving
    d_Kd = U @ mT(d_leaving)
    d_gamma = ops.sum(d_leaving * states, axis=-1)
    d_Wk = -(d_U @ mT(states))

    # Uw = inverse (w v), Wk = inverse (bk exp(G)); inverse = (I + A)^{-1}
    d_wv = mT(intra.inverse) @ d_U
    d_bkg = mT(intra.inverse) @ d_Wk
    d_A = -(d_wv @ mT(intra.Uw) + d_bkg @ mT(intra.Wk)) * strict
    dw = d_wv * v
    dv = d_wv * w

    exp_G = ops.exp(intra.G)
    d_bk = d_bkg * exp_G
    d_G = d_bkg * intra.bk * exp_G
    dq = d_Qg * exp_G
    d_G = d_G + d_Qg * intra.Qg
    dk = d_Kd * intra.decay_to_end

    # A = pair(bk, k) (strict), P = pair(q, k) (inclusive). P's diagonal does not depend on G
    # (E_ii = 1): it is kept out of d_G, where its two equal and opposite terms would cancel
    # only to rounding and swamp the small log-decay gradients of strongly decaying channels.
    d_P_diagonal = ops.sum(d_P * (inclusive - strict), axis=-1)[..., None]  # [C, 1]
    d_P = d_P * strict
    d_bk_A = intra.decay.left(ops, d_A, k)
    d_k_A = intra.decay.right(ops, d_A, intra.bk)
    d_q_P = intra.decay.left(ops, d_P, k)
    d_k_P = intra.decay.right(ops, d_P, q)
    d_bk = d_bk + d_bk_A
    dq = dq + d_q_P + d_P_diagonal * k
    dk = dk + d_k_A + d_k_P + d_P_diagonal * q + d_bk * b
    d_G = d_G + intra.bk * d_bk_A - k * d_k_A + q * d_q_P - k * d_k_P
    db = d_bk * k

    # G_i = sum_{s <= i} g_s: terms in G_i reach every g_t with t <= i (a reverse cumsum).
    # Kd_i = k_i exp(sum_{s > i} g_s) reaches g_t for t > i only, and gamma every g_t: summed
    # directly (an exclusive cumsum), not as the difference of two large sums.
    kd_terms = d_Kd * intra.Kd
    before = ops.concat([ops.zeros(kd_terms.shape[:-2] + (1, K), like=q), ops.cumsum(kd_terms, axis=-2)[..., :-1, :]], axis=-2)
    dg = ops.cumsum(d_G, axis=-2, reverse=True) + before + (d_gamma * intra.gamma)[..., None, :]

    grads = (from_chunks(ops, ops.where(chunk_poisoned, math.nan, x), T, layout) for x in (dq, dk, dv, dg, db, dw))
    return (*grads, ops.where(row_poisoned, math.nan, d_initial_state))


def recurrent(ops: Ops, q, k, v, g, b, w, scale: float, initial_state, sequences: SequenceOffsets | None = None):
    """Token-by-token recurrence in framework ops (the reference path; differentiated by autodiff).

    Inputs ``[B, T, H, D]``; returns ``(o [B, T, H, V], final_state [B, H, K, V])``. With packed
    ``sequences`` (B = 1) each sequence runs alone from its row of ``initial_state``.
    """
    B, T, H, K = q.shape
    spans = [(0, T)] if sequences is None else sequences.spans
    outputs, final_states = [], []
    for row, (start, end) in enumerate(spans):
        row = None if sequences is None else row
        state = _state_rows(ops, initial_state, row, (B, H, K, v.shape[-1]), q)
        for t in range(start, end):
            decayed = state * ops.exp(g[:, t])[..., None]
            erased = ops.sum((b[:, t] * k[:, t])[..., None] * decayed, axis=-2)
            state = decayed + k[:, t][..., None] * (w[:, t] * v[:, t] - erased)[..., None, :]
            outputs.append(scale * ops.sum(q[:, t][..., None] * state, axis=-2))
        final_states.append(state)
    return ops.stack(outputs, axis=1), ops.concat(final_states, axis=0)
