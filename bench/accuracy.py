"""Worst relative error against the float64 spec, per framework, path and input dtype.

    python bench/accuracy.py                 # every path; kernels on the CPU (see below)

For each case it runs forward and backward (with a gradient into the final state) and reports the
largest ``||x - spec|| / ||spec||`` over the output, the final state and all seven gradients. On a
machine without the kernels' devices, the Triton kernels run under the Triton interpreter and the
Metal kernels through the g++ harness of ``tests/metal_harness`` (their exact generated source).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path

from gdn2.testing import Shape

HARNESS = Path(__file__).resolve().parents[1] / "tests" / "metal_harness" / "harness.py"

# A mild and a strong-decay case, K != V, T not a chunk multiple.
CASES = [Shape(2, 150, 2, 32, 48, log_decay_range=(-5.0, 0.0)), Shape(1, 130, 2, 48, 80, log_decay_range=(-20.0, 0.0))]


def load_metal_harness():
    """``tests/metal_harness/harness.py`` (a test utility, not part of the package), by its path."""
    spec = importlib.util.spec_from_file_location("metal_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def metal_on_cpu(metal, harness):
    """Every Metal launch through the CPU harness, with the kernels taken as available."""
    unsupported_reason = metal.unsupported_reason
    metal.unsupported_reason = lambda *args, **kwargs: None
    try:
        with metal.use_launcher(harness.harness_launcher):
            yield
    finally:
        metal.unsupported_reason = unsupported_reason


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-size", type=int, default=64)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: run the kernels on the CPU
    import mlx.core as mx

    from gdn2.mlx import metal
    from gdn2.testing import run_mlx, run_torch, worst_error

    harness = None
    if metal.unsupported_reason(*(mx.zeros((1, 1, 1, 8)) for _ in range(6))) is not None:
        harness = load_metal_harness()

    warnings.simplefilter("error", RuntimeWarning)  # a path that gives way to another is an error here
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for index, shape in enumerate(CASES):
        case = shape.case(args.seed + index)
        label = "B={} T={} H={} K={} V={} g in [{:g}, {:g}]".format(*shape[:5], *shape.log_decay_range)
        for dtype in ("float32", "bfloat16"):
            for path in ("reference", "chunk", "kernel"):
                if path == "reference" and dtype != "float32":
                    continue
                print(f"{label} {dtype} {path} ...", flush=True)
                torch_result = run_torch(case, dtype, args.chunk_size, path, device=device)
                on_cpu = path == "kernel" and harness is not None
                with metal_on_cpu(metal, harness) if on_cpu else contextlib.nullcontext():
                    mlx_result = run_mlx(case, dtype, args.chunk_size, path)
                for framework, result in (("torch", torch_result), ("mlx", mlx_result)):
                    error, name, _ = worst_error(result, case["expected"])
                    rows.append((label, dtype, framework, path, error, name))

    print(f"\n{'case':<42} {'dtype':<9} {'framework':<9} {'path':<9} worst rel. error (where)")
    for label, dtype, framework, path, error, name in rows:
        print(f"{label:<42} {dtype:<9} {framework:<9} {path:<9} {error:.1e} ({name})")


if __name__ == "__main__":
    main()
