"""Which saved buffers can the Triton op keep in bfloat16? A paired precision study on the CPU.

    python bench/saved_precision.py --jobs 2 --json saved_precision.json     # about 30 min on 2 cores

For bfloat16 inputs the op keeps the saved buffers named in ``gdn2.torch.triton.SAVED_IN_BFLOAT16``
in bfloat16, the others in float32. This runs the kernels under the Triton interpreter
(``TRITON_INTERPRET=1``, CPU only) with each set of bfloat16 buffers in ``CONFIGS`` on the same
draws (paired: every configuration sees the same inputs), forward and backward with a nonzero
gradient into the final state, and reports the relative error ``||x - spec|| / ||spec||`` of o,
the final state and every gradient against the float64 spec (``gdn2.spec``):

  (a) against the spec on the original float64 inputs: what ``bench/triton_h200.py``'s check
      reports (dominated by rounding the inputs, g above all, to bfloat16);
  (b) against the spec on the bfloat16-rounded inputs (the initial state rounded to float32):
      the kernels' own arithmetic error.

Shapes (``SHAPES``): B=1 T=200 H=2 K=V=128 with g in [-20, 0], and B=2 T=300 H=2 K=V=128 with g
in [-3, 0] (``bench/triton_h200.py``'s two small check shapes); draws
``gdn2.spec.random_inputs(..., seed)`` with the upstream gradients of ``gdn2.testing.make_case``.

Under the interpreter every product is exact float32 (on the GPU they are TF32), so (b) isolates
the rounding of the saved buffers and of the inputs' own bf16 products. To run in minutes, the
in-chunk launches use wider blocks of key and value columns than on the GPU (``FAST_BLOCKS``):
those split independent columns or reorder float32 sums only (``--gpu-blocks`` runs the launch
settings as they are; the two agree far below the bf16 effects measured here).

The table: per configuration and shape, the median and worst over the seeds of the o error and
of the worst gradient error (with its name), in (a) and (b), and the paired change against the
default configuration (median over seeds of the ratio of worst gradient errors).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from gdn2.testing import GRAD_NAMES  # no Triton import: the workers import it under the interpreter

DEFAULT = ("states", "qd", "kd", "Wk", "U", "P", "inverse")
# Each configuration: the saved buffers in bfloat16 and, where it differs from the default, a
# launch constant (kernel_resources.set_launch).
CONFIGS = {
    "default": dict(SAVED_IN_BFLOAT16=DEFAULT),
    "P in float32": dict(SAVED_IN_BFLOAT16=("states", "qd", "kd", "Wk", "U", "inverse")),
    "P, inverse in float32": dict(SAVED_IN_BFLOAT16=("states", "qd", "kd", "Wk", "U"), DECAYED_ERASE_KEYS_IN_WK=False),
    "U in float32": dict(SAVED_IN_BFLOAT16=("states", "qd", "kd", "Wk", "P", "inverse")),
    "Wk, U in float32": dict(SAVED_IN_BFLOAT16=("states", "qd", "kd", "P", "inverse")),
    "+Uw": dict(SAVED_IN_BFLOAT16=DEFAULT + ("Uw",)),
}
# (B, T, H, K, V, log decay range); the third is the shape of tests/test_triton.py's
# test_kernel_bfloat16_saved_buffers_widest (not run unless asked for: --shapes 2).
SHAPES = [(1, 200, 2, 128, 128, (-20.0, 0.0)), (2, 300, 2, 128, 128, (-3.0, 0.0)), (1, 130, 2, 64, 48, (-20.0, 0.0))]
# Launch constants for the interpreter: fewer, wider programs (the same arithmetic per column).
FAST_BLOCKS = dict(INTRA_BACKWARD_KEYS_BLOCK=128, INTRA_BACKWARD_KEY_BLOCK=128, INTRA_BACKWARD_VALUE_BLOCK=128,
                   DIAGONAL_KEY_BLOCK=128, INTRA_FORWARD_KEY_BLOCK=64)
GRADIENTS = tuple(f"d{name}" for name in GRAD_NAMES)


def _task(shape_index: int, seed: int, configs: list[str], gpu_blocks: bool) -> list[dict]:
    """Every configuration on one draw: rows of errors (a) and (b)."""
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported (a fresh worker process)
    import warnings

    import torch

    from gdn2.testing import make_case, rounded_case, run_torch
    from gdn2.spec import relative_error
    from kernel_resources import set_launch  # bench/, next to this script

    warnings.simplefilter("error", RuntimeWarning)  # a kernel giving way to the chunk path is an error here
    torch.set_num_threads(1)
    if not gpu_blocks:
        set_launch(FAST_BLOCKS)
    B, T, H, K, V, decay = SHAPES[shape_index]
    case = make_case(B, T, H, K, V, seed, log_decay_range=decay)
    rounded = rounded_case(case, lambda x: torch.tensor(x).to(torch.bfloat16).double().numpy())
    rows = []
    for config in configs:
        previous = set_launch(CONFIGS[config])
        start = time.time()
        result = run_torch(case, "bfloat16", path="kernel")  # the same bf16 inputs as ``rounded``'s
        set_launch(previous)
        row = dict(shape=shape_index, seed=seed, config=config, seconds=round(time.time() - start, 1))
        for label, reference in (("a", case["expected"]), ("b", rounded["expected"])):
            row[label] = {name: relative_error(value, reference[name]) for name, value in result.items()}
        rows.append(row)
        print(f"shape {shape_index} seed {seed} {config:20s} o (a) {row['a']['o']:.2e} (b) {row['b']['o']:.2e}  "
              f"worst gradient (a) {_worst_gradient(row['a'])[0]:.2e} (b) {_worst_gradient(row['b'])[0]:.2e}  "
              f"{row['seconds']:.0f} s", flush=True)
    return rows


def _worst_gradient(errors: dict) -> tuple[float, str]:
    name = max(GRADIENTS, key=lambda n: errors[n])
    return errors[name], name


def table(rows: list[dict], configs: list[str]) -> str:
    """Markdown: per shape and configuration, median / worst over seeds of the o, final state and
    worst gradient errors in (a) and (b), and the paired ratio of worst gradients to the default's."""
    lines = []
    for shape_index in sorted({r["shape"] for r in rows}):
        B, T, H, K, V, decay = SHAPES[shape_index]
        seeds = sorted({r["seed"] for r in rows if r["shape"] == shape_index})
        lines.append(f"\nB={B} T={T} H={H} K={K} V={V}, g in [{decay[0]:g}, {decay[1]:g}], seeds {seeds} "
                     "(median / worst over seeds)\n")
        lines.append("| bf16 buffers | o (a) | worst grad (a) | o (b) | final state (b) | worst grad (b) "
                     "| grad (b) / default's, median | o (b) / default's, median |")
        lines.append("|---|---|---|---|---|---|---|---|")
        base = {r["seed"]: r for r in rows if r["shape"] == shape_index and r["config"] == "default"}
        for config in configs:
            mine = [r for r in rows if r["shape"] == shape_index and r["config"] == config]
            if not mine:
                continue

            def cell(values, names=None):
                text = f"{statistics.median(values):.2e} / {max(values):.2e}"
                if names:
                    text += f" ({'/'.join(sorted(set(names)))})"
                return text

            worst_a = [_worst_gradient(r["a"]) for r in mine]
            worst_b = [_worst_gradient(r["b"]) for r in mine]
            paired = [_worst_gradient(r["b"])[0] / _worst_gradient(base[r["seed"]]["b"])[0]
                      for r in mine if r["seed"] in base]
            paired_o = [r["b"]["o"] / base[r["seed"]]["b"]["o"] for r in mine if r["seed"] in base]
            ratios = f"{statistics.median(paired):.2f} | {statistics.median(paired_o):.2f}" if paired else "- | -"
            lines.append(
                f"| {config} | {cell([r['a']['o'] for r in mine])} | {cell([e for e, _ in worst_a], [n for _, n in worst_a])} "
                f"| {cell([r['b']['o'] for r in mine])} | {cell([r['b']['final_state'] for r in mine])} "
                f"| {cell([e for e, _ in worst_b], [n for _, n in worst_b])} | {ratios} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--shapes", type=int, nargs="+", default=[0, 1], help="indices into SHAPES")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (one draw each at a time)")
    parser.add_argument("--gpu-blocks", action="store_true", help="the launch settings as on the GPU (slower)")
    parser.add_argument("--json", help="write every row here as it arrives")
    parser.add_argument("--table", nargs="+", metavar="JSON",
                        help="only print the table of --json files written before (their rows together)")
    args = parser.parse_args(argv)
    if args.table:
        rows = []
        for name in args.table:
            with open(name) as f:
                rows.extend(json.load(f)["rows"])
        print(table(rows, [c for c in CONFIGS if any(r["config"] == c for r in rows)]))
        return
    tasks = [(shape, seed) for seed in args.seeds for shape in args.shapes]
    rows = []

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(configs={c: CONFIGS[c] for c in args.configs}, shapes=SHAPES,
                               gpu_blocks=args.gpu_blocks, rows=rows), f, indent=1)

    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(_task, shape, seed, args.configs, args.gpu_blocks) for shape, seed in tasks]
        for future in futures:
            rows.extend(future.result())
            save()
    print(table(rows, args.configs))


if __name__ == "__main__":
    sys.exit(main())
