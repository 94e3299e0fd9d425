"""Context parallelism in PyTorch: one sequence split along T across the ranks of a
``torch.distributed`` process group (Gloo on CPUs, NCCL on GPUs, launched by ``torchrun``).

``context_parallel_gdn2`` is ``chunk_gdn2`` on this rank's contiguous segment of the tokens; its
outputs and gradients are those of one process running the whole sequence (the algorithm and its
conventions: ``gdn2.context_parallel``). ``ContextParallel`` puts a model's layers in that mode::

    torch.distributed.init_process_group("nccl")          # under torchrun
    cp = ContextParallel()                                 # the default group
    cp.apply(model)                                        # every GatedDeltaNet2 in model
    logits = model(cp.split(input_ids))                    # this rank's segment of [B, T]
    loss = cross_entropy(logits, cp.split(targets), reduction="sum")   # this rank's tokens
    loss.backward()                                        # then all-reduce (sum) the parameters'
                                                           # gradients over the group, as DDP does

Each rank's parameter gradients are its tokens' share (the layers' convolution and state
exchanges carry the cross-rank terms); summed over ranks they are one process's gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import context_parallel as cp_algorithm
from ..context_parallel import Collectives, Segment
from .ops import chunk_gdn2
from .xp import torch_ops

__all__ = ["TorchCollectives", "ContextParallel", "context_parallel_gdn2"]


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor, deprecated there, before).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchCollectives(Collectives):
    """``gdn2.context_parallel.Collectives`` on ``torch.distributed`` (``group``: a process group,
    None for the default one, which must be initialised)."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "group: context parallelism needs torch.distributed initialised "
                "(torch.distributed.init_process_group, for example under torchrun)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_gather(self, x):
        x = x.contiguous().reshape(1, *x.shape)
        out = torch.empty((self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x, group=self.group)
        return out

    def all_sum(self, x):
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def gather_ints(self, values, like):
        gathered = self.all_gather(torch.tensor(values, dtype=torch.int64, device=like.device))
        return gathered.tolist()


class _Combine(torch.autograd.Function):
    """``gdn2.context_parallel.combine_forward`` / ``combine_backward`` as one autograd node."""

    @staticmethod
    def forward(ctx, o_wide, final_wide, comm, segment, K, output_final_state):
        o, final_state, saved = cp_algorithm.combine_forward(
            torch_ops, comm, segment, o_wide, final_wide, K, output_final_state
        )
        if o is o_wide:
            o = o.clone()
        ctx.saved, ctx.comm, ctx.segment, ctx.K = saved, comm, segment, K
        ctx.output_final_state = output_final_state
        ctx.dtypes = (o_wide.dtype, final_wide.dtype)
        return (o, final_state) if output_final_state else o

    @staticmethod
    def backward(ctx, d_o, d_final_state=None):
        d_o_wide, d_final_wide = cp_algorithm.combine_backward(
            torch_ops, ctx.comm, ctx.segment, ctx.saved, d_o, d_final_state, ctx.K, ctx.output_final_state
        )
        return d_o_wide.to(ctx.dtypes[0]), d_final_wide.to(ctx.dtypes[1]), None, None, None, None


def _combine(o_wide, final_wide, segment, K, output_final_state, comm):
    if output_final_state:
        return _Combine.apply(o_wide, final_wide, comm, segment, K, True)
    return _Combine.apply(o_wide, final_wide, comm, segment, K, False), None


class _GatherTails(torch.autograd.Function):
    """All-gather ``tail`` (``[size, ...]``); ``anchor`` passes through, so that every rank runs
    the backward (an all-sum) even where it reads none of the gathered rows."""

    @staticmethod
    def forward(ctx, tail, anchor, comm):
        ctx.comm = comm
        return comm.all_gather(tail), anchor.view_as(anchor)

    @staticmethod
    def backward(ctx, d_gathered, d_anchor):
        return ctx.comm.all_sum(d_gathered)[ctx.comm.rank], d_anchor, None


class ContextParallel:
    """Context parallelism over a ``torch.distributed`` group (None: the default group).

    ``gdn2(...)``: ``context_parallel_gdn2`` on this group. ``split(x, dim=1)``: this rank's
    contiguous segment of a whole tensor. ``apply(model)``: every ``GatedDeltaNet2`` in ``model``
    runs in this mode (``None`` turns it off); the layer's short convolutions then read their
    left context (the last ``conv_size - 1`` inputs) from the previous rank, and its
    ``cu_seqlens`` are the offsets of the whole split sequence.
    """

    def __init__(self, group=None):
        self.comm = TorchCollectives(group)
        self.rank, self.size = self.comm.rank, self.comm.size

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        bounds = cp_algorithm.split_offsets(x.shape[dim], self.size)
        return x.narrow(dim, bounds[self.rank], bounds[self.rank + 1] - bounds[self.rank])

    def gdn2(self, q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
             path=None, cu_seqlens=None):
        return context_parallel_gdn2(q, k, v, g, b, w, scale, initial_state, output_final_state, chunk_size, path,
                                     cu_seqlens, comm=self.comm)

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        from .layer import GatedDeltaNet2

        for module in model.modules():
            if isinstance(module, GatedDeltaNet2):
                module.context_parallel = self
        return model

    def segment(self, cu_seqlens, hidden_states: torch.Tensor) -> Segment:
        """This rank's ``Segment`` of the packed sequences ``cu_seqlens`` (the whole sequence's
        offsets): what the layer passes on to ``gdn2`` and reads its positions from."""
        B, T = hidden_states.shape[:2]
        return cp_algorithm.make_segment(self.comm, B, T, cu_seqlens, hidden_states)

    def conv_context(self, layer, x: torch.Tensor, attention_mask=None, cache=None):
        """``(x, (q, k, v) convolution states)``: see ``gdn2.context_parallel.conv_context``."""
        return cp_algorithm.conv_context(layer, x, attention_mask, cache, self.rank,
                                         lambda tails, x: _GatherTails.apply(tails, x, self.comm))


def context_parallel_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    path: str | None = None,
    cu_seqlens=None,
    group=None,
    *,
    comm: Collectives | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``chunk_gdn2`` over a sequence split along T across the ranks of ``group``.

    q, k, v, g, b, w: this rank's contiguous segment ``[B, T_rank, H, D]`` (rank 0 holds the first
    tokens; segments may differ in length). initial_state: ``[N, H, K, V]`` for the whole sequence,
    the same on every rank. cu_seqlens: the offsets ``[N + 1]`` of the sequences packed along the
    whole split sequence (B = 1), the same on every rank; they may cross rank boundaries.
    path, chunk_size: as in ``chunk_gdn2``, for each rank's segment run.

    Returns ``(o, final_state)``: this rank's outputs ``[B, T_rank, H, V]``, and with
    ``output_final_state`` the whole sequence's final states (the same on every rank). Gradients
    treat the loss as the sum of the ranks' losses: each rank's ``initial_state`` gradient is its
    share (sum them over ranks), and the gradients reaching ``final_state`` on every rank are summed.
    Every rank of the group must call it (and run the backward) with the same arguments apart from
    its segment.
    """
    comm = TorchCollectives(group) if comm is None else comm
    return cp_algorithm.run(
        torch_ops, "torch", comm, chunk_gdn2, lambda *a: _combine(*a, comm=comm), q, k, v, g, b, w, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size, path=path,
        cu_seqlens=cu_seqlens,
    )
