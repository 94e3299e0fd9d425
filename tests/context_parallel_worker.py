"""One rank of the context-parallel checks, run by ``tests/test_context_parallel.py``::

    torchrun --standalone --nproc_per_node N tests/context_parallel_worker.py torch SEED OUT
    mlx.launch -n N --backend ring -- python tests/context_parallel_worker.py mlx SEED OUT

Every rank runs the whole sequence in one process (the expected values) and its own segment with
context parallelism, and writes ``OUT/size{N}-rank{R}.json``: per case, the relative error of its outputs,
of the final state and of every gradient against the one-process run (the initial state's and
the layer's parameter gradients summed over ranks first), and, as controls, the error of running
its segment alone (no state from the previous ranks) and of the layer without the convolution's
left context, which must be large. Under torchrun with 3 processes the checks run twice: on all
three, and on a process group of ranks 0 and 1 (the third waits).
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import numpy as np

from gdn2.spec import INPUT_NAMES, random_inputs, relative_error

GRADS = INPUT_NAMES + ("initial_state",)
CHUNK = 8  # segments of 13 .. 23 tokens run several chunks, the last one partial
# Segment boundaries (uneven on purpose); every case has T = 40.
BOUNDS = {2: [0, 17, 40], 3: [0, 13, 27, 40]}
# Packed sequences: one spanning every rank, an empty one, short ones; and sequences starting
# exactly at the segment boundaries next to ones crossing them.
PACKED = {
    "packed-crossing": [5, 0, 30, 3, 2],
    "packed-at-boundaries": {2: [17, 10, 13], 3: [13, 10, 4, 13]},
}
WEAK_DECAY = (-0.2, 0.0)  # states carry across the whole sequence, so a missing carry shows


def op_cases(seed: int, size: int) -> dict:
    """name -> (inputs (float64 numpy), cu_seqlens or None, d_o, d_final_state)."""
    cases = {}
    rng = np.random.default_rng([seed, 7])
    inputs = random_inputs(2, 40, 2, 8, 6, seed, log_decay_range=WEAK_DECAY)
    cases["plain"] = (inputs, None, rng.standard_normal((2, 40, 2, 6)), rng.standard_normal((2, 2, 8, 6)))
    for i, (name, lengths) in enumerate(PACKED.items()):
        lengths = lengths[size] if isinstance(lengths, dict) else lengths
        inputs = random_inputs(1, 40, 2, 8, 6, seed + 1 + i, log_decay_range=WEAK_DECAY)
        N = len(lengths)
        inputs["initial_state"] = rng.standard_normal((N, 2, 8, 6))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        cases[name] = (inputs, offsets, rng.standard_normal((1, 40, 2, 6)), rng.standard_normal((N, 2, 8, 6)))
    return cases


def share(rank: int, size: int) -> float:
    """This rank's share of the final state's gradient (the shares sum to 1 over ranks)."""
    return (rank + 1) / (size * (size + 1) / 2)


class TorchSide:
    def __init__(self):
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        from gdn2.torch import chunk_gdn2
        from gdn2.torch.context_parallel import ContextParallel, context_parallel_gdn2

        self.torch, self.dist = torch, dist
        self.chunk_gdn2, self.context_parallel_gdn2 = chunk_gdn2, context_parallel_gdn2
        self.groups = [ContextParallel()]
        if dist.get_world_size() == 3:
            pair = dist.new_group([0, 1])  # every rank makes the group; ranks 0 and 1 use it
            if dist.get_rank() < 2:
                self.groups.append(ContextParallel(pair))

    def tensor(self, x, grad=False):
        return self.torch.tensor(np.asarray(x), dtype=self.torch.float32, requires_grad=grad)

    def offsets(self, x):
        return None if x is None else self.torch.tensor(x)

    def numpy(self, x):
        return x.detach().double().numpy()

    def sum_over_ranks(self, cp, x: np.ndarray) -> np.ndarray:
        t = self.torch.tensor(x)
        self.dist.all_reduce(t, group=cp.comm.group)
        return t.numpy()

    def run_op(self, function, inputs, d_o, d_final, **options):
        leaves = {n: self.tensor(inputs[n], grad=True) for n in GRADS}
        o, final = function(*(leaves[n] for n in INPUT_NAMES), initial_state=leaves["initial_state"],
                             output_final_state=True, chunk_size=CHUNK, **options)
        loss = (o * self.tensor(d_o)).sum() + (final * self.tensor(d_final)).sum()
        loss.backward()
        out = dict(o=self.numpy(o), final_state=self.numpy(final))
        for n, leaf in leaves.items():  # a rank that does not read an input has no gradient for it: zero
            out["d" + n] = np.zeros(leaf.shape) if leaf.grad is None else self.numpy(leaf.grad)
        return out

    def layer(self, seed):
        from gdn2.torch.layer import GatedDeltaNet2, init_weights

        layer = GatedDeltaNet2(hidden_size=16, head_dim=8, num_heads=2, chunk_size=CHUNK, use_kernels=False)
        return init_weights(layer, seed)

    def run_layer(self, layer, x, dy, cu_seqlens):
        x = self.tensor(x, grad=True)
        y = layer(x, cu_seqlens=self.offsets(cu_seqlens))
        (y * self.tensor(dy)).sum().backward()
        out = dict(y=self.numpy(y), dx=self.numpy(x.grad))
        for name, p in layer.named_parameters():
            out["d" + name] = self.numpy(p.grad)
        layer.zero_grad(set_to_none=True)
        return out

    def finish(self):
        self.dist.barrier()  # ranks 0 and 1 may still be checking the pair: close the group together
        self.dist.destroy_process_group()


class MLXSide:
    def __init__(self):
        import mlx.core as mx

        from gdn2.mlx import chunk_gdn2
        from gdn2.mlx.context_parallel import ContextParallel, context_parallel_gdn2

        self.mx = mx
        self.groups = [ContextParallel(mx.distributed.init())]
        self.chunk_gdn2, self.context_parallel_gdn2 = chunk_gdn2, context_parallel_gdn2

    def tensor(self, x, grad=False):
        return self.mx.array(np.asarray(x), dtype=self.mx.float32)

    def offsets(self, x):
        return None if x is None else self.mx.array(x)

    def numpy(self, x):
        return np.array(x.astype(self.mx.float32)).astype(np.float64)

    def sum_over_ranks(self, cp, x: np.ndarray) -> np.ndarray:
        return self.numpy(self.mx.distributed.all_sum(self.tensor(x), group=cp.comm.group))

    def run_op(self, function, inputs, d_o, d_final, **options):
        mx = self.mx
        arrays = [self.tensor(inputs[n]) for n in GRADS]
        d_o, d_final = self.tensor(d_o), self.tensor(d_final)

        def loss(*xs):
            o, final = function(*xs[:6], initial_state=xs[6], output_final_state=True, chunk_size=CHUNK, **options)
            return (o * d_o).sum() + (final * d_final).sum(), (o, final)

        (_, (o, final)), grads = mx.value_and_grad(loss, argnums=tuple(range(7)))(*arrays)
        mx.eval(o, final, grads)
        out = dict(o=self.numpy(o), final_state=self.numpy(final))
        out.update({"d" + n: self.numpy(grad) for n, grad in zip(GRADS, grads)})
        return out

    def layer(self, seed):
        from gdn2.mlx.layer import GatedDeltaNet2, init_weights

        return init_weights(GatedDeltaNet2(hidden_size=16, head_dim=8, num_heads=2, chunk_size=CHUNK), seed)

    def run_layer(self, layer, x, dy, cu_seqlens):
        import mlx.nn as nn
        from mlx.utils import tree_flatten

        mx = self.mx
        x, dy, offsets = self.tensor(x), self.tensor(dy), self.offsets(cu_seqlens)

        def loss(model, x):
            return (model(x, cu_seqlens=offsets) * dy).sum()

        # nn.value_and_grad differentiates the parameters; the input's gradient comes from mx.grad.
        # Each is evaluated before the next is built: MLX evaluates lazily, and collectives in two
        # independent graphs evaluated together could meet other ranks' in another order.
        _, d_params = nn.value_and_grad(layer, loss)(layer, x)
        mx.eval(d_params)
        dx = mx.grad(lambda x: loss(layer, x))(x)
        mx.eval(dx)
        y = layer(x, cu_seqlens=offsets)
        mx.eval(y)
        out = dict(y=self.numpy(y), dx=self.numpy(dx))
        out.update({"d" + name: self.numpy(g) for name, g in tree_flatten(d_params)})
        return out

    def finish(self):
        pass


def check(side, cp, seed: int) -> dict:
    """The errors of every case on this rank of the group of ``cp``."""
    rank, size = cp.rank, cp.size
    lo, hi = BOUNDS[size][rank], BOUNDS[size][rank + 1]
    split = partial(side.context_parallel_gdn2, comm=cp.comm)
    report = {}
    for name, (inputs, offsets, d_o, d_final) in op_cases(seed, size).items():
        whole = side.run_op(side.chunk_gdn2, inputs, d_o, d_final, cu_seqlens=side.offsets(offsets))
        mine = {n: (x[:, lo:hi] if n in INPUT_NAMES else x) for n, x in inputs.items()}
        got = side.run_op(split, mine, d_o[:, lo:hi], d_final * share(rank, size), cu_seqlens=side.offsets(offsets))
        errors = {}
        for key, value in got.items():
            expected = whole[key]
            if key == "o" or key[1:] in INPUT_NAMES:
                expected = expected[:, lo:hi]
            if key == "dinitial_state":
                value = side.sum_over_ranks(cp, value)
            errors[key] = relative_error(value, expected)
        if offsets is None:  # the control: this segment alone, from the initial state on rank 0 only
            alone = dict(mine, initial_state=inputs["initial_state"] * (rank == 0))
            errors["alone_o"] = relative_error(side.run_op(side.chunk_gdn2, alone, d_o[:, lo:hi], d_final)["o"],
                                               whole["o"][:, lo:hi])
        report[name] = errors

    rng = np.random.default_rng([seed, 11])
    # Packed: sequences crossing each boundary, and ones starting 1 or 2 tokens before one (the
    # convolution then reads only part of the previous rank's rows).
    packed = np.array([0, 5, 15, 26, 40], dtype=np.int64)
    for name, B, offsets in (("layer", 2, None), ("layer-packed", 1, packed)):
        x, dy = rng.standard_normal((B, 40, 16)), rng.standard_normal((B, 40, 16))
        layer = side.layer(seed)
        whole = side.run_layer(layer, x, dy, offsets)
        cp.apply(layer)
        got = side.run_layer(layer, x[:, lo:hi], dy[:, lo:hi], offsets)
        errors = {}
        for key, value in got.items():
            expected = whole[key]
            if key in ("y", "dx"):
                expected = expected[:, lo:hi]
            else:  # parameters: every rank's share of their gradient, summed
                value = side.sum_over_ranks(cp, value)
            errors[key] = relative_error(value, expected)
        # The control: the short convolutions without their left context from the previous rank.
        with_context = cp.conv_context
        cp.conv_context = lambda layer, x, *rest: (x, (None, None, None))
        errors["alone_y"] = relative_error(side.run_layer(layer, x[:, lo:hi], dy[:, lo:hi], offsets)["y"],
                                           whole["y"][:, lo:hi])
        cp.conv_context = with_context
        report[name] = errors
    return dict(rank=rank, size=size, bounds=[lo, hi], errors=report)


def main(framework: str, seed: int, out_dir: Path) -> None:
    side = TorchSide() if framework == "torch" else MLXSide()
    out_dir.mkdir(parents=True, exist_ok=True)
    for cp in side.groups:
        result = check(side, cp, seed)
        (out_dir / f"size{cp.size}-rank{cp.rank}.json").write_text(json.dumps(result))
    side.finish()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
