"""Context parallelism: one sequence split along T across ranks, written once over the ``gdn2.xp`` shim.

Each rank holds a contiguous segment of the tokens (rank 0 the first). A segment's effect on a
sequence's state is affine: with ``S_in`` the state entering it,

    S_out = M S_in + C                  M [K, K] and C [K, V] per batch row and head

and its outputs are ``o = o_C + o_M S_in`` (``o_C`` the outputs from a zero state, ``o_M = scale *
M_t^T q_t`` per token). One run of the segment gives all four: the value columns are widened to
``[0 | v]`` and ``[0 | w]`` (K zero columns in front) and the state entering the segment is
``[I | 0]``; the first K columns of the state then hold ``M`` (they see no values, only the
decays and erasures), the other V columns ``C``, and the outputs split likewise into ``o_M`` and
``o_C``. A rank whose segment starts a sequence (rank 0, or a packed sequence starting exactly
there) runs the plain width: nothing enters it from another rank.

Then (``combine_forward``): every rank all-gathers the maps ``[M | C]`` of the sequence leaving
its segment, composes those of the ranks before it into its entering state
(``S <- M_i S + C_i`` for i = 0 .. rank - 1, from zero), and corrects its outputs by
``o_M S``. The backward (``combine_backward``) mirrors it: the gradient of the entering state runs
back through the composition to the earlier ranks' maps, all-summed to the rank that made each
map, and from there into that rank's segment run through the framework's autodiff of the
operator (the kernel path where it runs). Final states, when asked for, are summed over ranks
(each rank fills the rows of the sequences that end in its segment), and their gradient is
all-summed back.

Packed sequences (``cu_seqlens``, B = 1, the offsets of the whole split sequence) may cross rank
boundaries: each rank runs the pieces of the sequences in its segment as packed sequences of its
own; only its first piece may continue a sequence from the previous rank, and only its last one
may continue on the next.

Conventions for the arrays every rank holds in full (``initial_state``, ``final_state``): the
loss is the sum of the ranks' losses. So each rank's ``initial_state`` gradient is its share (the
rows of the sequences that start in its segment); summed over ranks they are the gradient of one
process. ``final_state`` is the same on every rank, and its gradients from all ranks are summed.
This is what data-parallel training does with replicated parameters (their gradients are
all-reduced), so a model whose initial state comes from parameters trains correctly.

The collectives come from the framework's own distributed engine through a ``Collectives``
adapter (``gdn2.torch.context_parallel`` for ``torch.distributed``, ``gdn2.mlx.context_parallel``
for ``mx.distributed``); every rank must make the same calls in the same order, with the same
arguments apart from its segment of q, k, v, g, b, w, and run the backward when one does. MLX
evaluates lazily: the collectives of one call wait for its inputs and for each other, but two
independent computations evaluated by one ``mx.eval`` may reach other ranks' collectives in
another order, so evaluate one before building the next (a training step's loss and gradients are
one computation).

Cost: a rank that carries a state in runs its segment with ``K + V`` value columns instead of
``V`` (rank 0 runs the plain width), so with equal segments the carrying ranks take longer; the
exchange itself is ``size x [K, K + V]`` per row and head, once forward and once backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .packing import SequenceOffsets
from .xp import Ops


class Collectives:
    """What context parallelism needs from a distributed engine. Every call is collective: all
    ranks of the group make it, in the same order, with arrays of the same shape and dtype."""

    rank: int = 0
    size: int = 1

    def all_gather(self, x):
        """``[size, *x.shape]``: every rank's ``x``, in rank order."""
        raise NotImplementedError

    def all_sum(self, x):
        """The sum of every rank's ``x``."""
        raise NotImplementedError

    def gather_ints(self, values: list[int], like) -> list[list[int]]:
        """Every rank's list of ``len(values)`` integers, in rank order, read back to the host
        (``like``: an array on the device the engine communicates from)."""
        raise NotImplementedError

    def depends(self, x, on):
        """``x``, evaluated only after the arrays ``on`` (a list). Eager frameworks return ``x``;
        a lazy one (MLX) must not skip a collective whose result a rank happens not to read, since
        the other ranks wait in it."""
        return x


# ---------------------------------------------------------------------------------------------
# Where this rank's tokens sit in the split sequence
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """This rank's part of a sequence split along T, and how its sequences run (host values).

    ``pieces``: the state rows this rank's run has, in order: B rows without packing; with packing
    one per piece of a sequence in the segment (a sequence crossing a boundary has a piece on each
    rank it touches; an empty sequence belongs to the rank whose segment holds its offset, the
    last one for an offset at the end). ``row_of_piece``: the global state row of each piece.
    ``continues``: the first ``carried`` pieces start from the state the previous ranks leave
    (without packing: all B rows on every rank but 0; with packing: piece 0 when the segment
    starts inside a sequence). ``ends``: the pieces whose sequence ends in this segment (their
    final state is this rank's to give). ``local``: the pieces as packed offsets of this segment
    (None without packing). ``first_tokens``: the tokens of the carried pieces (without packing,
    all T).
    """

    rank: int
    size: int
    start: int
    length: int
    total: int
    rows: int  # N: the rows of initial_state and final_state (B, or the packed sequences)
    row_of_piece: tuple[int, ...]
    continues: bool
    carried: int  # B', the rows of the maps exchanged: B without packing, 1 with
    ends: tuple[bool, ...]
    first_tokens: int
    local: SequenceOffsets | None
    sequences: SequenceOffsets | None  # the global offsets (None without packing)

    @property
    def pieces(self) -> int:
        return len(self.row_of_piece)

    def positions(self) -> np.ndarray | None:
        """Each of this segment's tokens' index inside its (global) packed sequence, ``[T]``, or
        None without packing: what the layer's short convolution needs to restart at sequence starts."""
        if self.sequences is None:
            return None
        return self.sequences.positions()[self.start : self.start + self.length]


def plain_segment(rank: int, size: int, B: int, T: int) -> Segment:
    """Without packing: B rows, each split along T; every rank but 0 continues all of them."""
    continues = rank > 0
    return Segment(
        rank=rank, size=size, start=-1, length=T, total=-1, rows=B, row_of_piece=tuple(range(B)), continues=continues,
        carried=B, ends=(rank == size - 1,) * B, first_tokens=T, local=None, sequences=None,
    )


def packed_segment(rank: int, size: int, lengths: list[int], sequences: SequenceOffsets) -> Segment:
    """The pieces of the packed ``sequences`` (global offsets) in this rank's segment, from every
    rank's segment length ``lengths`` (rank order)."""
    total = sum(lengths)
    if sequences.total != total:
        raise ValueError(
            f"cu_seqlens: expected to end at the {total} tokens of all ranks' segments "
            f"({' + '.join(str(n) for n in lengths)}), received {sequences.total}"
        )
    start = sum(lengths[:rank])
    end = start + lengths[rank]
    last = rank == size - 1
    pieces, offsets, ends = [], [0], []
    continues = False
    for row, (first, stop) in enumerate(sequences.spans):
        if first == stop:  # empty: belongs to the segment holding its offset (the last for the end)
            if start <= first < end or (last and first == end):
                pieces.append(row)
                offsets.append(offsets[-1])
                ends.append(True)
            continue
        low, high = max(first, start), min(stop, end)
        if low >= high:
            continue
        if low > first:  # begins before this segment: the first piece, carried in
            continues = True
        pieces.append(row)
        offsets.append(offsets[-1] + high - low)
        ends.append(high == stop)
    return Segment(
        rank=rank, size=size, start=start, length=lengths[rank], total=total, rows=sequences.count,
        row_of_piece=tuple(pieces), continues=continues, carried=1, ends=tuple(ends),
        first_tokens=offsets[1] - offsets[0] if continues else 0,
        local=SequenceOffsets(tuple(offsets)), sequences=sequences,
    )


def equal_split(T: int, size: int) -> list[int]:
    """Segment lengths of T tokens over ``size`` ranks, contiguous and as equal as possible (the
    first ``T % size`` ranks one token more)."""
    return [T // size + (1 if r < T % size else 0) for r in range(size)]


def split_offsets(T: int, size: int, lengths: list[int] | None = None) -> list[int]:
    """Where each rank's segment starts, and the end: ``[0, ..., T]``."""
    lengths = equal_split(T, size) if lengths is None else lengths
    return [0] + np.cumsum(lengths).tolist()


# ---------------------------------------------------------------------------------------------
# The segment run's inputs
# ---------------------------------------------------------------------------------------------


def widen_values(ops: Ops, v, w, K: int):
    """``[0 | v]`` and ``[0 | w]``: K zero value columns in front, where the map M builds up."""
    zeros = ops.zeros(tuple(v.shape[:-1]) + (K,), like=v)
    return ops.concat([zeros, v], axis=-1), ops.concat([ops.zeros(tuple(w.shape[:-1]) + (K,), like=w), w], axis=-1)


def segment_initial_state(ops: Ops, segment: Segment, initial_state, H: int, K: int, V: int, like):
    """The state each piece of the segment run starts from, ``[pieces, H, K, width]``, or None.

    Carried pieces start from ``[I | 0]`` (their map is built in the first K columns); the others
    from ``[0 | initial_state row]`` when this rank widens (it carries a piece), else from their
    ``initial_state`` row (None: zeros). ``like``: an array of the state's dtype and device.
    """
    rows = None
    if initial_state is not None and segment.pieces > segment.carried * segment.continues:
        rows = ops.take(initial_state, np.asarray(segment.row_of_piece, dtype=np.int64), axis=0)
    if not segment.continues:
        return rows
    P, carried = segment.pieces, segment.carried
    eye = ops.eye(K, like)
    identity = ops.concat([eye + ops.zeros((carried, H, K, K), like), ops.zeros((carried, H, K, V), like)], axis=-1)
    if P == carried:
        return identity
    rest = ops.zeros((P - carried, H, K, V), like) if rows is None else rows[carried:]
    rest = ops.concat([ops.zeros((P - carried, H, K, K), like), ops.astype(rest, like.dtype)], axis=-1)
    return ops.concat([identity, rest], axis=0)


# ---------------------------------------------------------------------------------------------
# Exchange and composition (forward and backward, analytic)
# ---------------------------------------------------------------------------------------------


def _heads_first(ops: Ops, x):
    """``[B, T, H, D] <-> [B, H, T, D]``."""
    return ops.transpose(x, (0, 2, 1, 3))


def _mT(ops: Ops, x):
    return ops.transpose(x, (0, 1, 3, 2))


def _pad_rows(ops: Ops, x, before: int, after: int):
    """``x`` with ``before`` and ``after`` zero rows along axis 0."""
    parts = []
    if before:
        parts.append(ops.zeros((before,) + tuple(x.shape[1:]), like=x))
    parts.append(x)
    if after:
        parts.append(ops.zeros((after,) + tuple(x.shape[1:]), like=x))
    return parts[0] if len(parts) == 1 else ops.concat(parts, axis=0)


def _entering_states(ops: Ops, gathered, rank: int, K: int):
    """``S_0 = 0, S_{i+1} = M_i S_i + C_i``: the states entering ranks 0 .. rank (a list)."""
    maps = gathered[0]
    states = [ops.zeros(tuple(maps.shape[:-1]) + (maps.shape[-1] - K,), like=maps)]
    for i in range(rank):
        M, C = gathered[i][..., :K], gathered[i][..., K:]
        states.append(M @ states[-1] + C)
    return states


@dataclass
class Saved:
    """What ``combine_forward`` keeps for ``combine_backward``."""

    gathered: object  # [size, carried, H, K, K + V]
    carry: object  # the state entering this segment's carried pieces [carried, H, K, V]
    o_map: object  # o_M of the carried tokens [B, first_tokens, H, K] in o's dtype (None unless continuing)
    maps: object  # M of the carried pieces [carried, H, K, K] (None unless continuing)


def saved_from(ops: Ops, segment: Segment, o_wide, final_wide, gathered, K: int) -> Saved:
    """``Saved`` rebuilt from the forward's inputs and its gathered maps (for a framework whose
    backward sees only those)."""
    carry = _entering_states(ops, gathered, segment.rank, K)[-1]
    if not segment.continues:
        return Saved(gathered, carry, None, None)
    return Saved(gathered, carry, o_wide[:, : segment.first_tokens, :, :K], final_wide[: segment.carried, ..., :K])


def _final_index(segment: Segment):
    """Where each global final-state row comes from (a piece, or ``pieces``: a zero row), and
    where each piece's final-state gradient comes from (a global row, or ``rows``: zero)."""
    from_piece = np.full(segment.rows, segment.pieces, dtype=np.int64)
    from_row = np.full(segment.pieces, segment.rows, dtype=np.int64)
    for p, (row, ends) in enumerate(zip(segment.row_of_piece, segment.ends)):
        if ends:
            from_piece[row], from_row[p] = p, row
    return from_piece, from_row


def combine_forward(ops: Ops, comm: Collectives, segment: Segment, o_wide, final_wide, K: int, output_final_state: bool):
    """From the segment run (``o_wide [B, T, H, width]``, ``final_wide [pieces, H, K, width]``,
    width ``K + V`` on a rank that carries, else ``V``) to this rank's outputs ``o [B, T, H, V]``
    (in o_wide's dtype) and, with ``output_final_state``, the final states ``[rows, H, K, V]``
    summed over ranks. Returns ``(o, final_state or None, saved)``."""
    dtype = final_wide.dtype
    P, carried = segment.pieces, segment.carried
    if segment.continues:
        maps, values = final_wide[..., :K], final_wide[..., K:]
    else:
        maps, values = None, final_wide
    # The map of the sequence leaving this segment (M = 0 where it starts in the segment).
    leaving = final_wide[P - carried :]
    if not segment.continues:
        leaving = ops.concat([ops.zeros(tuple(leaving.shape[:-1]) + (K,), like=leaving), leaving], axis=-1)
    # Collectives run in one order on every rank: each waits for this call's inputs and the one before.
    gathered = comm.all_gather(comm.depends(leaving, [o_wide]))
    carry = _entering_states(ops, gathered, segment.rank, K)[-1]

    o_map = None
    if segment.continues:
        T0 = segment.first_tokens
        o_map = o_wide[:, :T0, :, :K]
        correction = _heads_first(ops, _heads_first(ops, ops.astype(o_map, dtype)) @ carry)  # o_M S, [B, T0, H, V]
        corrected = ops.astype(o_wide[:, :T0, :, K:], dtype) + correction
        parts = [ops.astype(corrected, o_wide.dtype)]
        if T0 < o_wide.shape[1]:
            parts.append(o_wide[:, T0:, :, K:])
        o = parts[0] if len(parts) == 1 else ops.concat(parts, axis=1)
        maps = maps[:carried]
    else:
        o = o_wide

    final_state = None
    if output_final_state:
        finals = values
        if segment.continues:
            first = maps @ carry + values[:carried]
            finals = first if P == carried else ops.concat([first, values[carried:]], axis=0)
        from_piece, _ = _final_index(segment)
        mine = ops.take(_pad_rows(ops, finals, 0, 1), from_piece, axis=0)
        final_state = comm.all_sum(comm.depends(mine, [gathered]))
    o = comm.depends(o, [gathered] + ([] if final_state is None else [final_state]))
    return o, final_state, Saved(gathered=gathered, carry=carry, o_map=o_map, maps=maps)


def combine_backward(ops: Ops, comm: Collectives, segment: Segment, saved: Saved, d_o, d_final_state, K: int,
                     output_final_state: bool, after=()):
    """The adjoint of ``combine_forward``: ``(d_o_wide, d_final_wide)`` from ``d_o [B, T, H, V]``
    and ``d_final_state [rows, H, K, V]`` (None: zero), in the state's dtype. Makes the same
    collectives on every rank, in the same order (the final states' sum, then the maps'), each
    after the cotangents, the forward's collectives (``after``: the forward's final state, where
    the framework evaluates lazily) and the one before."""
    gathered, carry = saved.gathered, saved.carry
    dtype = carry.dtype
    P, carried, rank = segment.pieces, segment.carried, segment.rank
    H, V = carry.shape[1], carry.shape[-1]
    d_o = ops.astype(d_o, dtype)

    d_values = ops.zeros((P, H, K, V), like=carry)  # gradient of the V columns of final_wide
    d_maps_first = None  # of M of the carried pieces
    d_carry = ops.zeros(tuple(carry.shape), like=carry)
    collected = []
    before = [d_o, gathered, *after]
    if output_final_state:
        if d_final_state is None:
            d_final_state = ops.zeros((segment.rows, H, K, V), like=carry)
        d_total = comm.all_sum(comm.depends(ops.astype(d_final_state, dtype), before))
        collected.append(d_total)
        _, from_row = _final_index(segment)
        d_values = ops.take(_pad_rows(ops, d_total, 0, 1), from_row, axis=0)
        if segment.continues:
            d_first = d_values[:carried]
            d_maps_first = d_first @ _mT(ops, carry)
            d_carry = d_carry + _mT(ops, saved.maps) @ d_first

    d_o_wide = d_o
    if segment.continues:
        T0 = segment.first_tokens
        d_first_o = _heads_first(ops, d_o[:, :T0])  # [B, H, T0, V]
        d_carry = d_carry + _mT(ops, _heads_first(ops, ops.astype(saved.o_map, dtype))) @ d_first_o
        d_o_map = _heads_first(ops, d_first_o @ _mT(ops, carry))  # [B, T0, H, K]
        if T0 < d_o.shape[1]:
            d_o_map = ops.concat([d_o_map, ops.zeros((d_o.shape[0], d_o.shape[1] - T0, H, K), like=d_o)], axis=1)
        d_o_wide = ops.concat([d_o_map, d_o], axis=-1)

    # Back through the composition S_{i+1} = M_i S_i + C_i to every earlier rank's map.
    states = _entering_states(ops, gathered, rank, K)
    d_gathered = []
    d_state = d_carry
    for i in reversed(range(rank)):
        d_gathered.append(ops.concat([d_state @ _mT(ops, states[i]), d_state], axis=-1))
        d_state = _mT(ops, gathered[i][..., :K]) @ d_state
    d_gathered = d_gathered[::-1] + [ops.zeros(tuple(gathered.shape[1:]), like=gathered)] * (segment.size - rank)
    d_leaving = comm.all_sum(comm.depends(ops.stack(d_gathered, axis=0), before + collected))[rank]

    d_values = d_values + _pad_rows(ops, d_leaving[..., K:], P - carried, 0)
    if not segment.continues:
        return comm.depends(d_o_wide, [d_leaving] + collected), d_values
    d_maps = _pad_rows(ops, d_leaving[..., :K], P - carried, 0)
    if d_maps_first is not None:
        d_maps = d_maps + _pad_rows(ops, d_maps_first, 0, P - carried)
    return comm.depends(d_o_wide, [d_leaving] + collected), ops.concat([d_maps, d_values], axis=-1)


# ---------------------------------------------------------------------------------------------
# The layer's short convolution: the last kernel_size - 1 inputs of the previous rank
# ---------------------------------------------------------------------------------------------


def conv_tail(x, width: int):
    """The rows this rank sends on: the last ``width - 1`` of ``x [B, T, D]``."""
    T = x.shape[1]
    if T < width - 1:
        raise ValueError(
            f"hidden_states: a segment of context parallelism needs at least conv_size - 1 = {width - 1} tokens "
            f"(the next rank's short convolution reads them), received T={T}"
        )
    return x[:, T - (width - 1) :]


def left_context(gathered, rank: int):
    """The rows before this rank's first token (``gathered`` from ``conv_tail`` of every rank), or
    None on rank 0 (zeros: the sequence starts there)."""
    return None if rank == 0 else gathered[rank - 1]


def conv_context(layer, x, attention_mask, cache, rank: int, gather_tails):
    """``(x, (q, k, v) convolution states)`` for ``layer`` on this rank's segment ``x``: the q, k
    and v projections of the previous rank's last ``conv_size - 1`` inputs (None on rank 0).
    ``gather_tails(tails, x)`` is the framework's differentiable all-gather, returning
    ``(gathered, x)``; use the returned ``x`` from here on: the gradient of the sent rows flows
    back to the rank they came from through it."""
    if attention_mask is not None or cache is not None:
        raise ValueError("context_parallel: attention_mask and cache are not supported; pass neither")
    if not layer.use_short_conv:
        return x, (None, None, None)
    gathered, x = gather_tails(conv_tail(x, layer.conv_size), x)
    left = left_context(gathered, rank)
    if left is None:
        return x, (None, None, None)
    return x, (layer.q_proj(left), layer.k_proj(left), layer.v_proj(left))



# ---------------------------------------------------------------------------------------------
# One call, for either framework
# ---------------------------------------------------------------------------------------------


def make_segment(comm: Collectives, B: int, T: int, cu_seqlens, like) -> Segment:
    """This rank's ``Segment``: from nothing (no packing), from the global offsets of the packed
    sequences (every rank's segment length is gathered once), or one made already."""
    from .spec import parse_cu_seqlens

    if isinstance(cu_seqlens, Segment):
        if (cu_seqlens.rank, cu_seqlens.size, cu_seqlens.length) != (comm.rank, comm.size, T):
            raise ValueError(
                f"cu_seqlens: a Segment of rank {cu_seqlens.rank} of {cu_seqlens.size} with {cu_seqlens.length} tokens, "
                f"used on rank {comm.rank} of {comm.size} with T={T}"
            )
        return cu_seqlens
    if cu_seqlens is None:
        return plain_segment(comm.rank, comm.size, B, T)
    lengths = [row[0] for row in comm.gather_ints([T], like)]
    sequences = parse_cu_seqlens(cu_seqlens, B, sum(lengths))
    return packed_segment(comm.rank, comm.size, lengths, sequences)


def run(ops: Ops, framework: str, comm: Collectives, operator, combine, q, k, v, g, b, w, *, scale, initial_state,
        output_final_state: bool, chunk_size: int, path, cu_seqlens):
    """One context-parallel call on this rank's segment.

    ``operator``: the framework's ``chunk_gdn2`` (the segment run, differentiated by the
    framework); ``combine(o_wide, final_wide, segment, K, output_final_state)``: the framework's
    differentiable wrapper of ``combine_forward`` / ``combine_backward``.
    """
    from .spec import _dtype_name, _shape, check_array_types, default_scale, validate

    dims = validate(q, k, v, g, b, w, scale, None, chunk_size, None, framework=framework,  # this segment alone
                    output_final_state=output_final_state)
    B, T, H, K, V = dims.B, dims.T, dims.H, dims.K, dims.V
    segment = make_segment(comm, B, T, cu_seqlens, q)
    if initial_state is not None:
        check_array_types(dict(q=q, initial_state=initial_state), framework)
        expected = (segment.rows, H, K, V)
        if tuple(_shape(initial_state)) != expected:
            rows = "N (sequences in cu_seqlens)" if segment.sequences is not None else "B"
            raise ValueError(
                f"initial_state: expected shape [{rows}, H, K, V] = {list(expected)} (the whole sequence's), "
                f"received {list(_shape(initial_state))}"
            )
        allowed = ("float32", "float64") if _dtype_name(q) == "float64" else ("float32",)
        if _dtype_name(initial_state) not in allowed:
            raise ValueError(f"initial_state: expected dtype {' or '.join(allowed)}, received {_dtype_name(initial_state)}")
    scale = default_scale(K, scale)
    state_like = ops.astype(q[:1, :1, :1, :1], ops.compute_dtype(q))
    state = segment_initial_state(ops, segment, initial_state, H, K, V, state_like)
    if segment.continues:
        v, w = widen_values(ops, v, w, K)
    o_wide, final_wide = operator(
        q, k, v, g, b, w, scale=scale, initial_state=state, output_final_state=True, chunk_size=chunk_size, path=path,
        cu_seqlens=segment.local,
    )
    o, final_state = combine(o_wide, final_wide, segment, K, output_final_state)
    return o, (final_state if output_final_state else None)
