"""``python -m gdn2 demo``: GDN-2 forward and backward in every installed framework, checked.

Runs each available path (reference, chunk, kernel) of PyTorch and MLX on the same random inputs,
compares outputs and every gradient with the float64 spec and across frameworks, and prints the
agreement and the time of each call.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .spec import INPUT_NAMES, relative_error
from .testing import make_case, run_mlx, run_torch, worst_error


def _torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _run(framework: str, case: dict, path: str, chunk_size: int):
    """Forward and backward on one path: (float64 results, seconds, the path choice)."""
    choice = _which_path(framework, case["inputs"], chunk_size, path)
    start = time.perf_counter()  # the results come back as numpy: the time includes the device's work
    if framework == "torch":
        result = run_torch(case, "float32", chunk_size, path, device=_torch_device())
    else:
        result = run_mlx(case, "float32", chunk_size, path)
    return result, time.perf_counter() - start, choice


def _which_path(framework: str, inputs, chunk_size: int, path: str):
    if framework == "torch":
        import torch

        from .torch import which_path

        arrays = [torch.tensor(inputs[n], dtype=torch.float32, device=_torch_device()) for n in INPUT_NAMES]
    else:
        import mlx.core as mx

        from .mlx import which_path

        arrays = [mx.array(inputs[n], dtype=mx.float32) for n in INPUT_NAMES]
    return which_path(*arrays, chunk_size=chunk_size, path=path)


def main(argv=None, prog: str = "python -m gdn2 demo") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--B", type=int, default=2)
    parser.add_argument("--T", type=int, default=200)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--K", type=int, default=32)
    parser.add_argument("--V", type=int, default=48)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh random seed")
    args = parser.parse_args(argv)

    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    print(f"GDN-2 demo: B={args.B} T={args.T} H={args.H} K={args.K} V={args.V} float32, seed {seed}")
    start = time.perf_counter()
    case = make_case(args.B, args.T, args.H, args.K, args.V, seed, log_decay_range=(-5.0, 0.0))
    expected = case["expected"]
    print(f"float64 spec (numpy): {time.perf_counter() - start:.2f} s")

    frameworks = []
    for framework in ("torch", "mlx"):
        try:
            __import__(framework)
            frameworks.append(framework)
        except ImportError:
            print(f"{framework}: not installed, skipped (pip install 'gdn2[{framework}]')")
    results, worst = {}, 0.0
    print(f"\n{'framework':<9} {'path':<10} {'fwd+bwd s':>9}  {'worst rel. error vs spec':<30} path taken")
    for framework in frameworks:
        for path in ("reference", "chunk", "kernel"):
            if path == "kernel":
                choice = _which_path(framework, case["inputs"], args.chunk_size, path)
                if choice.path != "kernel":
                    print(f"{framework:<9} {path:<10} {'':>9}  not run: {choice.reason}")
                    continue
            result, seconds, choice = _run(framework, case, path, args.chunk_size)
            error, name, _ = worst_error(result, expected)
            worst = max(worst, error)
            results[(framework, choice.path)] = result
            print(f"{framework:<9} {path:<10} {seconds:>9.3f}  {error:.1e} ({name}){'':<17} {choice}")
    if "torch" in frameworks and "mlx" in frameworks:
        print()
        for path in ("reference", "chunk"):
            a, b = results.get(("torch", path)), results.get(("mlx", path))
            if a is not None and b is not None:
                diff = max(relative_error(b[n], a[n]) for n in a)
                print(f"torch vs mlx, {path} path: worst relative difference over outputs and gradients {diff:.1e}")
    ok = worst <= 1e-4
    print(f"\n{'OK' if ok else 'MISMATCH'}: every path within {worst:.1e} of the float64 spec")
    return 0 if ok else 1
