"""gdn2's Triton kernels and flash-linear-attention's ``chunk_gdn2`` against the float64 spec on the
same draws, on the CPU: both under Triton's interpreter.

    python bench/accuracy_vs_fla.py --seeds 12 13 14 --json accuracy_vs_fla.json

needs ``fla`` importable (``fla-core`` and ``flash-linear-attention`` 0.6.0) and about a minute a
draw and form on one core (``--jobs 2`` runs two draws at a time). Each draw is
``bench/triton_h200.py``'s ``check``: ``gdn2.testing.make_case`` at one of its ``CHECK_SHAPES``
(``--shapes``; the first two by default, the shapes at which its GPU run compares both), bf16
inputs (``--dtype``), optionally a hard reset (``--reset -inf``: g at one step, every channel),
forward and backward with a gradient into the final state, and the relative error
``||x - spec|| / ||spec||`` of o, the final state and every gradient against the spec on the
original float64 inputs. Forms: gdn2's kernels as they are, each ``--variant`` (launch settings,
as ``bench/kernel_resources.py --variant`` takes them, ``;`` between the settings of one form),
and fla's. gdn2's in-chunk launches take wider blocks of columns than on the GPU unless
``--gpu-blocks`` (``bench/saved_precision.py``'s ``FAST_BLOCKS``: the same arithmetic per column).

Under the interpreter every product is exact float32 in both (on the GPU each uses TF32 and
bfloat16 products where it chooses), and fla's autotuner takes its first configuration (there is
nothing to time). gdn2's interpreter corrections (``gdn2/torch/triton/interpreter.py``: bfloat16
products, conversions and elementwise operations by value, as on the GPU) hold for fla's kernels
too; one more shim is fla's own: its kernels cast their ``range`` indices (``i_t.to(tl.int64)``),
which the interpreter runs as Python ints, so fla's modules get a ``range`` of ints that can.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from gdn2.testing import GRAD_NAMES  # no Triton import: the workers import it under the interpreter

GRADIENTS = tuple(f"d{name}" for name in GRAD_NAMES)


class LoopIndex(int):
    """A kernel's ``range`` index under the interpreter that casts as a GPU loop index does."""

    def to(self, dtype, **kwargs):
        import triton.language as tl

        return tl.full([], int(self), dtype)


def _range(*args):
    return map(LoopIndex, builtins.range(*args))


def fla_under_interpreter():
    """fla's ``chunk_gdn2`` ready to run under the interpreter: every loaded fla module's ``range``
    gives ``LoopIndex``es (ints elsewhere), its autotuners run their first configuration."""
    import triton.runtime.autotuner as autotuner

    import triton_h200  # bench/, next to this script

    fla = triton_h200.fla_function()  # imports fla's modules, whose range is set next
    autotuner.Autotuner._bench = lambda self, *args, config=None, **kwargs: [1.0, 1.0, 1.0]  # all equal: the first
    for name, module in list(sys.modules.items()):
        if name == "fla" or name.startswith("fla."):
            module.range = _range
    return fla


def parse_form(text: str) -> dict:
    """``NAME=VALUE;NAME=VALUE`` (VALUE a Python literal) as launch settings."""
    settings = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, value = item.partition("=")
        if not value:
            raise ValueError(f"--variant: expected NAME=VALUE, received {item!r}")
        settings[name.strip()] = ast.literal_eval(value.strip())
    return settings


def draw(shape: tuple, seed: int, reset: tuple[float, int] | None = None) -> dict:
    """``bench/triton_h200.py``'s check case at ``shape`` and ``seed`` (the same inputs), with
    ``reset`` = (value, step): g set to value at that step (every batch row, head and channel);
    the spec's results on it."""
    from gdn2.testing import make_case, with_expected

    B, T, H, K, V, decay = shape
    case = make_case(B, T, H, K, V, seed, log_decay_range=decay, reference=False)
    if reset is not None:
        case["inputs"]["g"][:, reset[1]] = reset[0]
    return with_expected(case)


def _task(shape_index: int, seed: int, forms: list[str], gpu_blocks: bool, dtype: str,
          reset: tuple[float, int] | None) -> list[dict]:
    """Every form on one draw (a fresh worker process)."""
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    import triton_h200  # bench/, next to this script
    from gdn2.testing import torch_gradients, worst_error
    from kernel_resources import set_launch
    from saved_precision import FAST_BLOCKS

    torch.set_num_threads(1)
    if not gpu_blocks:
        set_launch(FAST_BLOCKS)
    case = draw(triton_h200.CHECK_SHAPES[shape_index], seed, reset)
    rows = []
    for form in forms:
        start = time.time()
        if form == "fla":
            errors = worst_error(torch_gradients(case, dtype, fla_under_interpreter(), "cpu"), case["expected"])[2]
        else:
            previous = set_launch(parse_form(form))
            try:
                with triton_h200.no_fallback():
                    result = torch_gradients(case, dtype, triton_h200.gdn2_kernel, "cpu")
            finally:
                set_launch(previous)
            errors = worst_error(result, case["expected"])[2]
        row = dict(shape=shape_index, seed=seed, form=form, errors=errors, seconds=round(time.time() - start, 1))
        worst = max(GRADIENTS, key=errors.get)
        print(f"shape {shape_index} seed {seed} {form or 'gdn2'}: o {errors['o']:.2e}, worst gradient "
              f"{errors[worst]:.2e} ({worst}), {row['seconds']:.0f} s", flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict], forms: list[str]) -> str:
    """Markdown: per draw, each form's worst error (o, the final state and the gradients) with
    its quantity; then per form the median and worst over draws and the draws it beats fla at."""
    draws = sorted({(r["shape"], r["seed"]) for r in rows})
    cell = {(r["shape"], r["seed"], r["form"]): r["errors"] for r in rows}
    label = lambda form: "gdn2" if form == "" else form  # noqa: E731
    lines = ["| shape, seed | " + " | ".join(label(f) for f in forms) + " |", "|---" * (len(forms) + 1) + "|"]
    for shape, seed in draws:
        cells = []
        for form in forms:
            errors = cell.get((shape, seed, form))
            worst = max(errors, key=errors.get) if errors else None
            cells.append(f"{errors[worst]:.2e} ({worst})" if errors else "-")
        lines.append(f"| {shape}, {seed} | " + " | ".join(cells) + " |")
    lines.append("")
    for form in forms:
        worst = [max(cell[(s, d, form)].values()) for s, d in draws if (s, d, form) in cell]
        o = [cell[(s, d, form)]["o"] for s, d in draws if (s, d, form) in cell]
        if not worst:
            continue
        text = (f"- {label(form)}: worst error median {statistics.median(worst):.2e}, largest {max(worst):.2e}; "
                f"o median {statistics.median(o):.2e}")
        if form != "fla" and "fla" in forms:
            pairs = [(max(cell[(s, d, form)].values()), max(cell[(s, d, 'fla')].values()))
                     for s, d in draws if (s, d, form) in cell and (s, d, "fla") in cell]
            text += f"; at or below fla's worst at {sum(a <= b for a, b in pairs)} of {len(pairs)} draws"
        lines.append(text)
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[12, 13, 14])
    parser.add_argument("--shapes", type=int, nargs="+", default=[0, 1], help="indices into CHECK_SHAPES")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[;NAME=VALUE]",
                        help="a form of gdn2's kernels: launch settings (repeat for more forms)")
    parser.add_argument("--no-fla", action="store_true", help="gdn2's forms only")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the inputs' dtype")
    parser.add_argument("--reset", type=float, metavar="VALUE",
                        help="a hard reset: g = VALUE (e.g. -inf, -1e4) at one step of every draw")
    parser.add_argument("--reset-step", type=int, metavar="STEP", help="its step (default: the middle of T)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (one draw each at a time)")
    parser.add_argument("--gpu-blocks", action="store_true",
                        help="gdn2's launch settings as on the GPU (slower; by default the in-chunk launches take "
                             "wider blocks of columns under the interpreter, bench/saved_precision.py's FAST_BLOCKS: "
                             "the same arithmetic per column)")
    parser.add_argument("--json", help="write every row here as it arrives")
    args = parser.parse_args(argv)
    for form in args.variant:
        parse_form(form)  # a malformed form fails here, before any work
    if args.reset_step is not None and args.reset is None:
        raise ValueError(f"--reset-step: expected with --reset, received {args.reset_step} without it")
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton (the workers inherit it)
    import triton_h200  # bench/, next to this script

    resets = {}
    for index in args.shapes:
        if not 0 <= index < len(triton_h200.CHECK_SHAPES):
            raise ValueError(f"--shapes: expected indices 0 to {len(triton_h200.CHECK_SHAPES) - 1}, received {index}")
        T = triton_h200.CHECK_SHAPES[index][1]
        step = T // 2 if args.reset_step is None else args.reset_step
        if args.reset is not None and not 0 <= step < T:
            raise ValueError(f"--reset-step: expected 0 <= step < T = {T} at shape {index}, received {step}")
        resets[index] = None if args.reset is None else (args.reset, step)
    forms = [""] + args.variant + ([] if args.no_fla else ["fla"])
    if not args.no_fla:
        try:
            import fla  # noqa: F401
        except ImportError as error:
            raise SystemExit(f"fla is not importable ({error}): install fla-core and flash-linear-attention "
                             "0.6.0, or pass --no-fla")
    rows = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(_task, shape, seed, forms, args.gpu_blocks, args.dtype, resets[shape])
                   for seed in args.seeds for shape in args.shapes]
        for future in futures:
            rows.extend(future.result())
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(forms=forms, dtype=args.dtype, resets=resets, rows=rows), f, indent=1)
    print(f"{args.dtype} inputs" + ("" if args.reset is None else
                                    f", g = {args.reset:g} at step {', '.join(f'{resets[i][1]} (shape {i})' for i in args.shapes)}"))
    print(table(rows, forms))


if __name__ == "__main__":
    sys.exit(main())
