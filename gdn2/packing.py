"""Packed sequences (``cu_seqlens``): the offsets, read once, and the layouts built from them.

``gdn2.spec.parse_cu_seqlens`` reads the offsets back to the host once per call, at the API
boundary (on CUDA every such read is a device sync), into a ``SequenceOffsets``; validation, the
chunk path, the kernel paths, the recurrence and the layers' convolutions all take that value.

Two layouts of packed tokens:

* the chunk layout (``ChunkLayout``): every sequence starts a new chunk and its last chunk is
  zero-padded, so no chunk holds two sequences and the state restarts at a chunk boundary
  (``chunk_table`` lists the same chunks as (first token, length));
* the padded batch (``split_sequences`` / ``join_sequences``): ``[1, T]`` -> ``[N, L_max]``, each
  sequence zero-padded at its end, for the paths without native packing.

A zero step (``k = 0``, ``g = 0``) leaves the state unchanged, so both paddings are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .xp import Ops


@dataclass(frozen=True, eq=False)
class ChunkLayout:
    """Where the packed tokens sit in the chunk layout of one chunk size."""

    token_of_slot: np.ndarray  # [chunks * C]; T marks a padding slot (a zero row appended to the input)
    slot_of_token: np.ndarray  # [T]
    chunk_ranges: tuple[tuple[int, int], ...]  # per sequence, (first chunk, end chunk)


@dataclass(frozen=True)
class SequenceOffsets:
    """The offsets ``0 = o_0 <= o_1 <= ... <= o_N = T`` of N sequences packed along T.

    Build it with ``gdn2.spec.parse_cu_seqlens`` (which checks the values); every layout below is
    computed once per value and chunk size.
    """

    offsets: tuple[int, ...]
    _layouts: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def count(self) -> int:
        """N, the number of sequences (the rows of the recurrent states)."""
        return len(self.offsets) - 1

    @property
    def total(self) -> int:
        """T, the number of packed tokens."""
        return self.offsets[-1]

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(end - start for start, end in self.spans)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of each sequence."""
        return tuple(zip(self.offsets[:-1], self.offsets[1:]))

    def positions(self) -> np.ndarray:
        """Each token's index inside its sequence, ``[T]``."""
        starts = np.asarray(self.offsets[:-1], dtype=np.int64)
        return np.arange(self.total) - np.repeat(starts, self.lengths)

    def chunk_table(self, chunk_size: int) -> np.ndarray:
        """``[chunks, 2]`` int64: (first token, length) of every chunk of the chunk layout, in order.

        A sequence of L tokens has ``ceil(L / chunk_size)`` chunks (an empty one has none); every
        chunk but a sequence's last is full.
        """
        rows = [
            (chunk_start, min(chunk_size, end - chunk_start))
            for start, end in self.spans
            for chunk_start in range(start, end, chunk_size)
        ]
        return np.asarray(rows, dtype=np.int64).reshape(-1, 2)

    def chunk_layout(self, chunk_size: int) -> ChunkLayout:
        """The chunk layout for ``chunk_size`` (built on first use, then kept)."""
        if chunk_size not in self._layouts:
            T = self.total
            token_of_slot, slot_of_token, chunk_ranges = [], np.zeros(T, dtype=np.int64), []
            for start, end in self.spans:
                first = len(token_of_slot) // chunk_size
                chunks = -(-(end - start) // chunk_size)
                slots = np.full(chunks * chunk_size, T, dtype=np.int64)
                slots[: end - start] = np.arange(start, end)
                slot_of_token[start:end] = len(token_of_slot) + np.arange(end - start)
                token_of_slot.extend(slots.tolist())
                chunk_ranges.append((first, first + chunks))
            self._layouts[chunk_size] = ChunkLayout(np.asarray(token_of_slot, dtype=np.int64), slot_of_token, tuple(chunk_ranges))
        return self._layouts[chunk_size]

    @cached_property
    def padded_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Index of each packed token in the ``[N, L_max]`` padded batch (``T`` pads), and back:
        ``([N * L_max], [T])``."""
        T, lengths = self.total, self.lengths
        longest = max(max(lengths), 1)
        padded = np.full((self.count, longest), T, dtype=np.int64)
        packed = np.zeros(T, dtype=np.int64)
        for n, (start, end) in enumerate(self.spans):
            padded[n, : end - start] = np.arange(start, end)
            packed[start:end] = n * longest + np.arange(end - start)
        return padded.reshape(-1), packed


def split_sequences(ops: Ops, x, sequences: SequenceOffsets):
    """Packed ``[1, T, H, D]`` -> ``[N, L_max, H, D]``, each sequence zero-padded at its end
    (differentiable through ``take``)."""
    padded, _ = sequences.padded_rows
    return ops.take(ops.pad_time(x, 1), padded, axis=1).reshape(sequences.count, -1, *x.shape[2:])


def join_sequences(ops: Ops, y, sequences: SequenceOffsets):
    """Inverse of ``split_sequences``: ``[N, L_max, H, D]`` -> ``[1, T, H, D]``."""
    _, packed = sequences.padded_rows
    return ops.take(y.reshape(1, -1, *y.shape[2:]), packed, axis=1)
