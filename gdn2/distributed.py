"""Data-parallel training: the processes of a ``torchrun`` or ``mlx.launch`` run, seen by a trainer.

``--batch-size`` stays the global batch: every process draws the same global batch (one seed)
and takes its contiguous share of the rows, so N processes see exactly the batches one process
would. Each process's loss is weighted by its share of the counted target positions, so that the
averaged gradient (DDP's all-reduce in PyTorch, ``mlx.nn.average_gradients`` in MLX) is the
gradient of the global batch's mean loss, whatever the split of counted positions; the loss a
step reports is the global mean. Only rank 0 prints, plots and writes files.

A ``World`` of one process (``single``) leaves everything as it was.
"""

from __future__ import annotations

import atexit
import os

import numpy as np

from .train import IGNORE


class World:
    """The processes training together. This base class is one process alone."""

    rank, size = 0, 1
    name = "one process"

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def rows(self, batch: int) -> slice:
        """This process's contiguous share of ``batch`` rows (as equal as possible; may be empty)."""
        bounds = np.linspace(0, batch, self.size + 1).round().astype(int) if self.size > 1 else (0, batch)
        return slice(int(bounds[self.rank]), int(bounds[self.rank + 1]))

    def shard(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """This process's rows of a global training batch, and its share of the batch's counted
        target positions (its loss weight; the shares sum to 1)."""
        if self.size == 1:
            return inputs, targets, 1.0
        rows = self.rows(len(inputs))
        counted = max(int(np.count_nonzero(targets != IGNORE)), 1)
        return inputs[rows], targets[rows], int(np.count_nonzero(targets[rows] != IGNORE)) / counted

    def sum(self, values: list[float]) -> list[float]:
        """Every process's ``values``, summed (the same on every process)."""
        return list(values)

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.size:
            raise ValueError(
                f"batch_size: expected a multiple of the {self.size} processes of {self.name} (the global batch is "
                f"split evenly), received {batch_size}"
            )


single = World()


class TorchWorld(World):
    """The processes of ``torchrun`` (``torch.distributed``: NCCL for CUDA devices, Gloo else)."""

    name = "torchrun"

    def __init__(self, device):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        if not dist.is_initialized():
            # torch._dynamo imported first: imported while a group exists (DDP imports it), it keeps
            # references to the group that outlive destroy_process_group, so the group's worker
            # threads live on into interpreter shutdown, where one freeing a finished collective's
            # tensors aborts the process ("terminate called without an active exception").
            import torch._dynamo  # noqa: F401

            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            atexit.register(_destroy, dist)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        if device.type == "cuda":
            if device.index is not None and self.size > 1 and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > 1:
                raise ValueError(
                    f"device: {device} names one GPU for all {self.size} processes; pass cuda (each process "
                    "takes the GPU of its LOCAL_RANK)"
                )
            device = torch.device("cuda", local if device.index is None else device.index)
            torch.cuda.set_device(device)
        self.device = device

    @classmethod
    def launched(cls) -> bool:
        """Whether this process is one of several started by torchrun."""
        return int(os.environ.get("WORLD_SIZE", "1")) > 1

    def wrap(self, model):
        """The model under ``DistributedDataParallel`` (gradients averaged over processes)."""
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def sum(self, values):
        t = self.torch.tensor(values, dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return t.tolist()


def _destroy(dist) -> None:
    """At exit: wait for every process, then close the group (a process closing it while another
    still talks to it can abort that one), which joins its worker threads."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class MLXWorld(World):
    """The processes of ``mlx.launch`` (``mx.distributed``)."""

    name = "mlx.launch"

    def __init__(self, group):
        import mlx.core as mx

        self.mx, self.group = mx, group
        self.rank, self.size = group.rank(), group.size()

    @classmethod
    def start(cls) -> World:
        """The world of ``mlx.launch`` (``mx.distributed.init()``), or ``single`` when alone."""
        import mlx.core as mx

        if TorchWorld.launched():
            raise ValueError("framework: torchrun starts PyTorch's processes; launch MLX's with mlx.launch")
        group = mx.distributed.init()
        return cls(group) if group.size() > 1 else single

    def average(self, gradients):
        """The gradients averaged over processes (``mlx.nn.average_gradients``: a few all-sums)."""
        import mlx.nn as nn

        return nn.average_gradients(gradients, group=self.group)

    def sum(self, values):
        mx = self.mx
        return mx.distributed.all_sum(mx.array(values, dtype=mx.float32), group=self.group).tolist()


def torch_world(device, data_parallel: bool):
    """``(world, device)`` for a PyTorch trainer: torchrun's processes when launched by it and
    ``data_parallel``, else ``single`` (the device unchanged)."""
    if data_parallel and "MLX_RANK" in os.environ:
        raise ValueError("framework: mlx.launch starts MLX's processes; launch PyTorch's with torchrun")
    if not data_parallel or not TorchWorld.launched():
        return single, device
    world = TorchWorld(device)
    return world, world.device
