"""Training and the operator on more than one GPU of one host: data parallelism and context parallelism.

    python bench/multi_gpu.py                          # CUDA: 1 and 2 GPUs (it launches torchrun itself)
    python bench/multi_gpu.py --device cpu --small     # tiny sizes on the CPU (Gloo): a check that it runs

Data-parallel rows (``--what dp``): ``gdn2.train.TorchTrainer`` with ``data_parallel`` (DDP, as
``torchrun -m gdn2 train`` runs it): the language model of ``bench/layer.py`` (4 blocks, hidden
1024, 8 heads x 128, vocabulary 32000, float32 weights, AdamW, bf16 autocast on CUDA) on random
tokens, B=8 sequences of T=2048 per GPU; median step time, global tokens per second, peak memory
per GPU, and the scaling efficiency (tokens per second over N times one GPU's).

Context-parallel rows (``--what cp``): forward and forward+backward of one sequence, B=1,
T=131,072, H=16, K=V=128, bf16 (float32 on the CPU): ``chunk_gdn2`` on one GPU,
``gdn2.torch.context_parallel.context_parallel_gdn2`` with the sequence split in equal segments on
N; median ms, peak memory per GPU, and (on by default, ``--no-check`` skips it) each rank's
relative error of its outputs and input gradients against ``chunk_gdn2`` on the whole sequence in
the same process. Every rank but 0 runs its segment with K + V value columns (its map of the
state), rank 0 with V: ``--cp-first 0.6`` gives rank 0 60% of the tokens to even the work out.

Each GPU count runs in processes of its own (one GPU: ``python``, more: ``torchrun --standalone``),
with NVLink multicast left off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
set here for every process). Writes the rows as JSON (``--json``, default
``bench/out/multi_gpu.json``; ``bench/out/`` is not tracked).
"""

from __future__ import annotations

import os

# NVLink multicast (NVLS, symmetric-memory multicast) stays off in every process this script starts.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

OUT = Path(__file__).with_name("out")
ROOT = Path(__file__).resolve().parents[1]
FULL = dict(layers=4, hidden=1024, heads=8, vocab=32000, B=8, T=2048, chunk=64, steps=10, warmup=3,
            cp_T=131072, cp_H=16, cp_K=128, cp_V=128, repeats=5, cp_warmup=2)
SMALL = dict(layers=2, hidden=64, heads=2, vocab=128, B=2, T=40, chunk=8, steps=2, warmup=1,
             cp_T=96, cp_H=2, cp_K=16, cp_V=16, repeats=2, cp_warmup=1)


# ---- in each process ---------------------------------------------------------------------------


class Ranks:
    """This process among the others (torchrun), or alone."""

    def __init__(self, device_name: str):
        import torch

        from gdn2.distributed import TorchWorld

        self.torch = torch
        device = torch.device(device_name)
        if TorchWorld.launched():
            self.world = TorchWorld(device)
            self.rank, self.size, self.device = self.world.rank, self.world.size, self.world.device
        else:
            self.world, self.rank, self.size, self.device = None, 0, 1, device

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        if self.world is not None:
            self.world.dist.barrier()

    def gather(self, value: float) -> list[float]:
        """Every rank's ``value``."""
        if self.world is None:
            return [value]
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        out = [self.torch.empty_like(t) for _ in range(self.size)]
        self.world.dist.all_gather(out, t)
        return [x.item() for x in out]

    def reset_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> list[float] | None:
        """Every rank's peak allocated memory since ``reset_memory``, GiB (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        return self.gather(self.torch.cuda.max_memory_allocated(self.device) / 2**30)

    def timed(self, run, repeats: int, warmup: int) -> float:
        """Median ms of ``run()`` over ``repeats`` after ``warmup``, every rank starting together."""
        for _ in range(warmup):
            run()
        times = []
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            run()
            self.sync()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


def data_parallel_row(ranks: Ranks, sizes: dict, dtype: str | None, seed: int) -> dict:
    import numpy as np

    from gdn2.train import TorchTrainer, TrainConfig, starting_weights
    from gdn2.weights import ModelConfig

    config = ModelConfig(vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], num_layers=sizes["layers"],
                         num_heads=sizes["heads"], head_dim=sizes["hidden"] // sizes["heads"], chunk_size=sizes["chunk"])
    batch = sizes["B"] * ranks.size  # the global batch: B per GPU
    steps = sizes["steps"] + sizes["warmup"]
    train = TrainConfig(steps=steps, batch_size=batch, lr=1e-3, warmup_steps=0, eval_every=0)
    ranks.reset_memory()
    # The device type only: under torchrun the trainer takes the GPU of its LOCAL_RANK itself.
    trainer = TorchTrainer(config, starting_weights(config, seed), train, ranks.device.type, dtype, data_parallel=True)
    rng = np.random.default_rng(seed)
    batches = [rng.integers(0, sizes["vocab"], (batch, sizes["T"] + 1)) for _ in range(2)]
    step = [0]

    def run():
        tokens = batches[step[0] % 2]
        trainer.step(tokens[:, :-1], tokens[:, 1:], 1e-3)
        step[0] += 1

    ms = ranks.timed(run, sizes["steps"], sizes["warmup"])
    row = dict(what="data parallel", gpus=ranks.size, device=str(ranks.device.type), dtype=trainer.dtype,
               model=f"{sizes['layers']} layers, hidden {sizes['hidden']}, {sizes['heads']} heads x "
                     f"{sizes['hidden'] // sizes['heads']}, vocabulary {sizes['vocab']}",
               B_per_gpu=sizes["B"], T=sizes["T"], step_ms=ms, tokens_per_second=batch * sizes["T"] / (ms / 1e3),
               peak_gib_per_gpu=ranks.peak_gib())
    return row


def context_parallel_row(ranks: Ranks, sizes: dict, dtype_name: str, check: bool, seed: int,
                         first_share: float | None = None) -> dict:
    torch = ranks.torch
    from gdn2.context_parallel import split_offsets
    from gdn2.torch import chunk_gdn2, which_path

    T, H, K, V = sizes["cp_T"], sizes["cp_H"], sizes["cp_K"], sizes["cp_V"]
    dtype = getattr(torch, dtype_name)
    device = ranks.device
    generator = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)

    # The whole sequence, the same on every rank (one generator seed), in the regime layers produce.
    q = torch.nn.functional.normalize(rand(1, T, H, K) - 0.5, dim=-1)
    k = torch.nn.functional.normalize(rand(1, T, H, K) - 0.5, dim=-1)
    whole = dict(q=q, k=k, v=rand(1, T, H, V) - 0.5, g=-0.1 * rand(1, T, H, K), b=rand(1, T, H, K), w=rand(1, T, H, V))
    whole = {name: x.to(dtype) for name, x in whole.items()}
    d_o = (rand(1, T, H, V) - 0.5).to(dtype)
    del q, k
    lengths = None
    if first_share is not None and ranks.size > 1:  # rank 0 runs the plain width: it may take more tokens
        first = round(T * first_share)
        lengths = [first] + [(T - first) // (ranks.size - 1) + (r < (T - first) % (ranks.size - 1)) for r in range(ranks.size - 1)]
    bounds = split_offsets(T, ranks.size, lengths)
    lo, hi = bounds[ranks.rank], bounds[ranks.rank + 1]
    if ranks.size == 1:
        operator = chunk_gdn2
    else:
        from gdn2.torch.context_parallel import ContextParallel

        operator = ContextParallel().gdn2
    names = ("q", "k", "v", "g", "b", "w")
    mine = {name: whole[name][:, lo:hi].contiguous().requires_grad_() for name in names}
    d_mine = d_o[:, lo:hi].contiguous()
    path = str(which_path(*(mine[n] for n in names)))

    def forward():
        with torch.no_grad():
            operator(*(mine[n] for n in names))

    def forward_backward():
        o, _ = operator(*(mine[n] for n in names))
        o.backward(d_mine)

    forward_ms = ranks.timed(forward, sizes["repeats"], sizes["cp_warmup"])
    ranks.reset_memory()
    forward_backward_ms = ranks.timed(forward_backward, sizes["repeats"], sizes["cp_warmup"])
    row = dict(what="context parallel", gpus=ranks.size, device=str(device.type), dtype=dtype_name, B=1, T=T, H=H, K=K,
               V=V, tokens_per_gpu=hi - lo, segments=list(map(int, bounds)), path=path, forward_ms=forward_ms, forward_backward_ms=forward_backward_ms,
               peak_gib_per_gpu=ranks.peak_gib())
    if check and ranks.size > 1:
        # Each rank's part of the outputs and input gradients against chunk_gdn2 on the whole sequence.
        for x in mine.values():
            x.grad = None
        o, _ = operator(*(mine[n] for n in names))
        o.backward(d_mine)
        got = dict(o=o.detach(), **{f"d{n}": mine[n].grad for n in names})
        del o
        leaves = {n: whole[n].clone().requires_grad_() for n in names}
        o_whole, _ = chunk_gdn2(*(leaves[n] for n in names))
        o_whole.backward(d_o)
        expected = dict(o=o_whole.detach(), **{f"d{n}": leaves[n].grad for n in names})
        errors = {}
        for name, value in got.items():
            reference = expected[name][:, lo:hi].float()
            errors[name] = max(ranks.gather(((value.float() - reference).norm() / reference.norm()).item()))
        row["relative_error_vs_one_process"] = errors
    return row


def worker(args) -> None:
    import torch

    sizes = dict(SMALL if args.small else FULL, **{k: v for k, v in vars(args).items() if k in FULL and v is not None})
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ranks = Ranks(device)
    rows = []
    if "dp" in args.what:
        rows.append(data_parallel_row(ranks, sizes, args.dtype, args.seed))
    if "cp" in args.what:
        ranks.reset_memory()
        dtype = args.dtype or ("bfloat16" if ranks.device.type == "cuda" else "float32")
        rows.append(context_parallel_row(ranks, sizes, dtype, args.check, args.seed, args.cp_first))
    if ranks.rank == 0:
        Path(args.worker).write_text(json.dumps(rows))
    ranks.sync()  # then gdn2.distributed closes the process group at exit, on every rank together


# ---- the driver ----------------------------------------------------------------------------------


def launch(gpus: int, argv: list[str], out: Path, timeout: float) -> list[dict]:
    """This script's worker on ``gpus`` processes; its rows."""
    worker_argv = [str(Path(__file__).resolve()), *argv, "--worker", str(out)]
    if gpus == 1:
        command = [sys.executable, *worker_argv]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", *worker_argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for its processes: CPU rows compare alike
    print(f"running on {gpus} {'GPU' if gpus == 1 else 'GPUs'}: {' '.join(command)}", flush=True)
    subprocess.run(command, env=env, check=True, timeout=timeout)
    return json.loads(out.read_text())


def add_scaling(rows: list[dict]) -> None:
    """Scaling efficiency (data parallel) and speedup (context parallel) against the one-GPU row."""
    one = {row["what"]: row for row in rows if row["gpus"] == 1}
    for row in rows:
        base = one.get(row["what"])
        if base is None:
            continue
        if row["what"] == "data parallel":
            row["scaling_efficiency"] = row["tokens_per_second"] / (row["gpus"] * base["tokens_per_second"])
        else:
            row["speedup_forward"] = base["forward_ms"] / row["forward_ms"]
            row["speedup_forward_backward"] = base["forward_backward_ms"] / row["forward_backward_ms"]


def print_table(rows: list[dict]) -> None:
    def memory(row):
        peaks = row.get("peak_gib_per_gpu")
        return "-" if not peaks else "/".join(f"{p:.2f}" for p in peaks)

    for row in rows:
        unit = ("GPU", "GPUs") if row["device"] == "cuda" else ("process", "processes")
        gpus = f"{row['gpus']} {unit[row['gpus'] > 1]}"
        if row["what"] == "data parallel":
            efficiency = f", efficiency {100 * row['scaling_efficiency']:.1f}%" if "scaling_efficiency" in row else ""
            print(f"data parallel, {gpus}: step {row['step_ms']:.1f} ms, {row['tokens_per_second']:,.0f} "
                  f"tokens/s{efficiency}, peak GiB per GPU {memory(row)}")
        else:
            check = row.get("relative_error_vs_one_process")
            worst = f", worst relative error vs one process {max(check.values()):.1e}" if check else ""
            print(f"context parallel, {gpus}, T={row['T']}: forward {row['forward_ms']:.1f} ms, "
                  f"forward+backward {row['forward_backward_ms']:.1f} ms, peak GiB per GPU {memory(row)}{worst} "
                  f"[{row['path']}]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench/multi_gpu.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda or cpu (default cuda when available)")
    parser.add_argument("--small", action="store_true", help="tiny sizes: a check that everything runs")
    parser.add_argument("--gpus", default="1,2", help="process counts to run, comma-separated")
    parser.add_argument("--what", default="dp,cp", help="dp (data parallel), cp (context parallel), or both")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--cp-first", type=float, default=None,
                        help="context parallel: the share of the tokens rank 0 takes (default: equal segments); "
                             "the other ranks run K + V value columns, rank 0 only V")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="context parallel: skip the comparison with one process on the whole sequence")
    for name in FULL:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {FULL[name]}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per GPU count")
    parser.add_argument("--json", type=Path, default=OUT / "multi_gpu.json")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one process's part
    return parser


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        worker(args)
        return []
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for gpus in (int(n) for n in args.gpus.split(",")):
            rows += launch(gpus, argv, Path(folder) / f"rows{gpus}.json", args.timeout)
    add_scaling(rows)
    print_table(rows)
    meta = dict(python=platform.python_version(), machine=platform.machine(), argv=argv,
                environment={name: os.environ[name] for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")})
    if any(row["device"] == "cuda" for row in rows):
        import torch

        meta.update(torch=torch.__version__, gpu=torch.cuda.get_device_name(0))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
