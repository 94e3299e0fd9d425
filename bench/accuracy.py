"""Worst relative error against the float64 spec, per framework, path and input dtype.

    python bench/accuracy.py                 # every path; kernels on the CPU (see below)

For each case it runs forward and backward (with a gradient into the final state) and reports the
largest ``||x - spec|| / ||spec||`` over the output, the final state and all seven gradients. On a
machine without the kernels' devices, the Triton kernels run under the Triton interpreter and the
Metal kernels through the g++ harness of ``tests/metal_harness`` (their exact generated source).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# (B, T, H, K, V, log decay range): a mild and a strong-decay case, K != V, T not a chunk multiple.
CASES = [(2, 150, 2, 32, 48, (-5.0, 0.0)), (1, 130, 2, 48, 80, (-20.0, 0.0))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-size", type=int, default=64)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: run the kernels on the CPU
    import mlx.core as mx  # noqa: F401
    from frameworks import make_case, run_mlx, run_torch, worst_error

    from gdn2.mlx import metal

    harness = None
    if metal.unsupported_reason(*(mx.zeros((1, 1, 1, 8)) for _ in range(6))) is not None:
        from tests.metal_harness import harness

    warnings.simplefilter("error", RuntimeWarning)  # a path that gives way to another is an error here
    rows = []
    for index, (B, T, H, K, V, decay) in enumerate(CASES):
        case = make_case(B, T, H, K, V, args.seed + index, log_decay_range=decay)
        label = f"B={B} T={T} H={H} K={K} V={V} g in [{decay[0]:g}, {decay[1]:g}]"
        for dtype in ("float32", "bfloat16"):
            for path in ("reference", "chunk", "kernel"):
                if path == "reference" and dtype != "float32":
                    continue
                print(f"{label} {dtype} {path} ...", flush=True)
                torch_result = run_torch(case, dtype, args.chunk_size, path, device="cuda" if torch.cuda.is_available() else "cpu")
                if path == "kernel" and harness is not None:
                    with metal.use_launcher(harness.harness_launcher):
                        original = metal.unsupported_reason
                        metal.unsupported_reason = lambda *a, **k: None
                        try:
                            mlx_result = run_mlx(case, dtype, args.chunk_size, path)
                        finally:
                            metal.unsupported_reason = original
                else:
                    mlx_result = run_mlx(case, dtype, args.chunk_size, path)
                for framework, result in (("torch", torch_result), ("mlx", mlx_result)):
                    error, name, _ = worst_error(result, case["expected"])
                    rows.append((label, dtype, framework, path, error, name))

    print(f"\n{'case':<42} {'dtype':<9} {'framework':<9} {'path':<9} worst rel. error (where)")
    for label, dtype, framework, path, error, name in rows:
        print(f"{label:<42} {dtype:<9} {framework:<9} {path:<9} {error:.1e} ({name})")


if __name__ == "__main__":
    main()
