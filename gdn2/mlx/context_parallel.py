"""Context parallelism in MLX: one sequence split along T across the ranks of an ``mx.distributed``
group (launched by ``mlx.launch``; the ring backend runs several processes on one machine).

The same algorithm, arguments and conventions as ``gdn2.torch.context_parallel``
(``gdn2.context_parallel`` is the algorithm)::

    group = mx.distributed.init()                          # under mlx.launch
    cp = ContextParallel(group)
    cp.apply(model)                                        # every GatedDeltaNet2 in model
    logits = model(cp.split(input_ids))                    # this rank's segment of [B, T]

Each rank's parameter gradients are its tokens' share: sum them over the group
(``mx.distributed.all_sum``), as data parallelism averages them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import context_parallel as cp_algorithm
from ..context_parallel import Collectives, Segment
from .ops import chunk_gdn2
from .xp import mlx_ops

__all__ = ["MLXCollectives", "ContextParallel", "context_parallel_gdn2"]


class MLXCollectives(Collectives):
    """``gdn2.context_parallel.Collectives`` on ``mx.distributed`` (``group``: a group, None for
    ``mx.distributed.init()``)."""

    def __init__(self, group=None):
        self.group = mx.distributed.init() if group is None else group
        self.rank = self.group.rank()
        self.size = self.group.size()

    def all_gather(self, x):
        return mx.distributed.all_gather(x[None], group=self.group)

    def all_sum(self, x):
        return mx.distributed.all_sum(x, group=self.group)

    def gather_ints(self, values, like):
        return self.all_gather(mx.array(values, dtype=mx.int64)).tolist()

    def depends(self, x, on):
        return mx.depends(x, list(on)) if on else x


def _combine_function(comm: MLXCollectives, segment: Segment, K: int, output_final_state: bool):
    """``combine_forward`` / ``combine_backward`` as an ``mx.custom_function`` of ``(o_wide,
    final_wide)``; the gathered maps are a third output, for the vjp (callers drop it)."""

    @mx.custom_function
    def combine(o_wide, final_wide):
        o, final_state, saved = cp_algorithm.combine_forward(
            mlx_ops, comm, segment, o_wide, final_wide, K, output_final_state
        )
        if final_state is None:
            final_state = mx.zeros((1,), dtype=final_wide.dtype)
        return o, final_state, saved.gathered

    @combine.vjp
    def combine_vjp(primals, cotangents, outputs):
        o_wide, final_wide = primals
        d_o, d_final_state, _ = cotangents
        saved = cp_algorithm.saved_from(mlx_ops, segment, o_wide, final_wide, outputs[2], K)
        d_o_wide, d_final_wide = cp_algorithm.combine_backward(
            mlx_ops, comm, segment, saved, d_o, d_final_state if output_final_state else None, K, output_final_state,
            after=[outputs[1]] if output_final_state else [],
        )
        return d_o_wide.astype(o_wide.dtype), d_final_wide.astype(final_wide.dtype)

    return combine


def _combine(o_wide, final_wide, segment, K, output_final_state, comm):
    o, final_state, _ = _combine_function(comm, segment, K, output_final_state)(o_wide, final_wide)
    return o, (final_state if output_final_state else None)


def _gather_tails_function(comm: MLXCollectives):
    """All-gather ``tail`` (``[size, ...]``); ``anchor`` passes through (after the gather), so
    that every rank takes part in the gather and in its backward (an all-sum) even where it reads
    none of the gathered rows."""

    @mx.custom_function
    def gather(tail, anchor):
        gathered = comm.all_gather(tail)
        return gathered, mx.depends(anchor, [gathered])

    @gather.vjp
    def gather_vjp(primals, cotangents, outputs):
        d_gathered, d_anchor = cotangents
        d_tail = comm.all_sum(mx.depends(d_gathered, [d_anchor]))[comm.rank]
        return d_tail, mx.depends(d_anchor, [d_tail])

    return gather


class ContextParallel:
    """Context parallelism over an ``mx.distributed`` group (None: ``mx.distributed.init()``).

    The same methods as ``gdn2.torch.context_parallel.ContextParallel``: ``gdn2``, ``split``,
    ``apply`` (every ``GatedDeltaNet2`` of a model), ``segment`` and ``conv_context`` (what the
    layer calls).
    """

    def __init__(self, group=None):
        self.comm = MLXCollectives(group)
        self.rank, self.size = self.comm.rank, self.comm.size

    def split(self, x: mx.array, axis: int = 1) -> mx.array:
        bounds = cp_algorithm.split_offsets(x.shape[axis], self.size)
        index = [slice(None)] * x.ndim
        index[axis] = slice(bounds[self.rank], bounds[self.rank + 1])
        return x[tuple(index)]

    def gdn2(self, q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
             path=None, cu_seqlens=None):
        return context_parallel_gdn2(q, k, v, g, b, w, scale, initial_state, output_final_state, chunk_size, path,
                                     cu_seqlens, comm=self.comm)

    def apply(self, model: nn.Module) -> nn.Module:
        from .layer import GatedDeltaNet2

        for _, module in model.named_modules():
            if isinstance(module, GatedDeltaNet2):
                module.context_parallel = self
        return model

    def segment(self, cu_seqlens, hidden_states: mx.array) -> Segment:
        B, T = hidden_states.shape[:2]
        return cp_algorithm.make_segment(self.comm, B, T, cu_seqlens, hidden_states)

    def conv_context(self, layer, x: mx.array, attention_mask=None, cache=None):
        """``(x, (q, k, v) convolution states)``: see ``gdn2.context_parallel.conv_context``."""
        return cp_algorithm.conv_context(layer, x, attention_mask, cache, self.rank, _gather_tails_function(self.comm))


def context_parallel_gdn2(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    b: mx.array,
    w: mx.array,
    scale: float | None = None,
    initial_state: mx.array | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    path: str | None = None,
    cu_seqlens=None,
    group=None,
    *,
    comm: Collectives | None = None,
) -> tuple[mx.array, mx.array | None]:
    """``chunk_gdn2`` over a sequence split along T across the ranks of ``group`` (MLX); the same
    arguments, results and gradient conventions as ``gdn2.torch.context_parallel.context_parallel_gdn2``."""
    comm = MLXCollectives(group) if comm is None else comm
    return cp_algorithm.run(
        mlx_ops, "mlx", comm, chunk_gdn2, lambda *a: _combine(*a, comm=comm), q, k, v, g, b, w, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size, path=path,
        cu_seqlens=cu_seqlens,
    )
