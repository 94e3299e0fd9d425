"""Data-parallel training from the same command (``gdn2.distributed``): ``torchrun --nproc_per_node 2
-m gdn2 train`` (DDP, Gloo) and ``mlx.launch -n 2 -- python -m gdn2 train --framework mlx`` give the
loss curve of one process with the same global batch, print once, and write weights that load in
one process."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from gdn2 import __main__ as cli
from gdn2.distributed import World
from gdn2.spec import relative_error
from gdn2.train import IGNORE
from gdn2.weights import load_numpy
from tests.launchers import fresh_seed, mlx_launch, torchrun

# A tiny run: 4 steps of a global batch of 4 MQAR sequences of 32 tokens, evaluated at the end.
RUN = ["--steps", "4", "--batch-size", "4", "--seq-len", "32", "--num-kv-pairs", "4", "--eval-size", "6",
       "--eval-every", "2", "--hidden-size", "32", "--num-heads", "2", "--head-dim", "16", "--chunk-size", "8"]


def read_losses(folder) -> dict[str, np.ndarray]:
    with open(folder / "loss.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    columns = {}
    for name in ("loss", "heldout_loss", "heldout_accuracy"):
        columns[name] = np.array([float(row[name]) for row in rows if row[name] != ""])
    return columns


def check_same_run(one, many, seed: int) -> None:
    """The multi-process run's loss curve, held-out numbers and weights are the one-process run's."""
    a, b = read_losses(one), read_losses(many)
    assert len(a["loss"]) == len(b["loss"]) == 4 and len(a["heldout_loss"]) == len(b["heldout_loss"]) == 2
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=2e-5, atol=2e-6, err_msg=f"seed {seed}: {name}")
    weights_one, _ = load_numpy(one / "model.safetensors")
    weights_many, config = load_numpy(many / "model.safetensors")
    assert config is not None and sorted(weights_one) == sorted(weights_many)
    error = relative_error(np.concatenate([weights_many[n].ravel() for n in sorted(weights_many)]),
                           np.concatenate([weights_one[n].ravel() for n in sorted(weights_one)]))
    assert error < 1e-5, f"seed {seed}: weights differ by {error:.2e}"


def test_torchrun_two_processes(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    seed = fresh_seed() % 10_000
    arguments = ["train", *RUN, "--seed", str(seed), "--device", "cpu", "--dtype", "float32"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's processes run (OMP_NUM_THREADS=1); much faster on a busy CPU
    try:
        cli.main([*arguments, "--out", str(tmp_path / "one"), "--quiet"])
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    result = torchrun(2, ["-m", "gdn2", *arguments, "--out", str(tmp_path / "two")])
    assert result.stdout.count("gdn2 train: torch on cpu x 2 processes (torchrun)") == 1, result.stdout
    assert result.stdout.count("wrote ") == 1
    check_same_run(tmp_path / "one", tmp_path / "two", seed)
    # The saved weights load in one process, as a model.
    from gdn2.torch.layer import load_model

    model = load_model(tmp_path / "two" / "model.safetensors")
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 128)


def test_mlx_launch_two_processes(tmp_path, capsys):
    pytest.importorskip("mlx.core")
    seed = fresh_seed() % 10_000
    arguments = ["train", "--framework", "mlx", *RUN, "--seed", str(seed)]
    cli.main([*arguments, "--out", str(tmp_path / "one"), "--quiet"])
    capsys.readouterr()
    result = mlx_launch(2, ["-m", "gdn2", *arguments, "--out", str(tmp_path / "two")])
    assert result.stdout.count("gdn2 train: mlx on cpu x 2 processes (mlx.launch)") == 1, result.stdout
    assert result.stdout.count("wrote ") == 1
    check_same_run(tmp_path / "one", tmp_path / "two", seed)
    from gdn2.mlx.layer import load_model

    import mlx.core as mx

    assert load_model(tmp_path / "two" / "model.safetensors")(mx.zeros((1, 5), dtype=mx.int32)).shape == (1, 5, 128)


CLOSE_GROUP = """
import gc, os, sys
import torch
from gdn2.distributed import TorchWorld, _destroy

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
world = TorchWorld(torch.device("cpu"))
model = world.wrap(torch.nn.Linear(4, 4))  # DDP imports torch._dynamo, unless it was imported already
model(torch.randn(2, 4)).sum().backward()
del model
gc.collect()
during = threads()
_destroy(world.dist)
gc.collect()
print(before, during, threads())
"""


def test_closing_the_group_joins_its_threads():
    """The group of a torchrun process (``TorchWorld``), after a DDP model, closed as at exit
    (``_destroy``): Gloo's worker threads are joined. Left running (the group kept alive by
    references that torch._dynamo, imported after the group existed, holds), one freeing a
    finished collective's tensors during interpreter shutdown aborted a process of
    ``bench/multi_gpu.py`` about once in 15 runs."""
    import os
    import socket
    import subprocess
    import sys

    from tests.launchers import subprocess_environment

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads through /proc (Linux)")
    pytest.importorskip("torch.distributed")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = dict(subprocess_environment(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0")
    result = subprocess.run([sys.executable, "-c", CLOSE_GROUP], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    before, during, after = map(int, result.stdout.split()[-3:])
    assert during > before, "the group started no threads: the test would not see them left running"
    assert after == before, f"{after - before} threads left running after the group was closed"


# ---- the split of a batch, in one process -----------------------------------------------------


class Rank(World):
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def test_shards_cover_the_batch_once():
    rng = np.random.default_rng(fresh_seed())
    inputs = rng.integers(0, 100, (6, 5))
    targets = np.where(rng.random((6, 5)) < 0.4, IGNORE, inputs)
    for size in (2, 3):
        shards = [Rank(r, size).shard(inputs, targets) for r in range(size)]
        np.testing.assert_array_equal(np.concatenate([s[0] for s in shards]), inputs)
        np.testing.assert_array_equal(np.concatenate([s[1] for s in shards]), targets)
        assert all(len(s[0]) == 6 // size for s in shards)
        # Loss weights: each process's share of the counted positions, summing to 1.
        counted = [np.count_nonzero(s[1] != IGNORE) for s in shards]
        assert [s[2] for s in shards] == pytest.approx([c / sum(counted) for c in counted])
    rows = [Rank(r, 4).rows(6) for r in range(4)]  # uneven (evaluation batches): contiguous, sizes 1 or 2
    assert rows[0].start == 0 and rows[-1].stop == 6 and all(a.stop == b.start for a, b in zip(rows, rows[1:]))
    assert sorted(r.stop - r.start for r in rows) == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="batch_size: expected a multiple of the 4 processes"):
        Rank(1, 4).check_batch(6)


# ---- bench/multi_gpu.py at a tiny size on the CPU -----------------------------------------------


def test_multi_gpu_bench_runs_small_on_the_cpu(tmp_path):
    """``bench/multi_gpu.py --device cpu --small``: one process, then two under torchrun (Gloo);
    the rows, the scaling numbers, context parallelism's agreement with one process, and NVLink
    multicast off in the recorded environment."""
    import json
    import subprocess
    import sys

    from tests.launchers import ROOT, subprocess_environment

    out = tmp_path / "multi_gpu.json"
    command = [sys.executable, str(ROOT / "bench" / "multi_gpu.py"), "--device", "cpu", "--small", "--steps", "1",
               "--warmup", "0", "--repeats", "1", "--cp-warmup", "0", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=subprocess_environment())
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    written = json.loads(out.read_text())
    rows = {(row["what"], row["gpus"]): row for row in written["rows"]}
    assert set(rows) == {("data parallel", 1), ("data parallel", 2), ("context parallel", 1), ("context parallel", 2)}
    two = rows["data parallel", 2]
    assert two["tokens_per_second"] == pytest.approx(2 * two["B_per_gpu"] * two["T"] / (two["step_ms"] / 1e3))
    assert two["scaling_efficiency"] == pytest.approx(two["tokens_per_second"] / (2 * rows["data parallel", 1]["tokens_per_second"]))
    split = rows["context parallel", 2]
    assert split["tokens_per_gpu"] == split["T"] // 2 and split["forward_backward_ms"] > 0
    errors = split["relative_error_vs_one_process"]
    assert set(errors) == {"o", "dq", "dk", "dv", "dg", "db", "dw"} and max(errors.values()) < 1e-5, errors
    assert written["meta"]["environment"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
