"""Command line: ``python -m gdn2 {train,compare,demo}``.

- ``train``: train the small GDN-2 language model in PyTorch or MLX, by default on multi-query
  associative recall (MQAR), or on a text file with ``--data`` (character level); prints held-out
  accuracy and writes ``loss.csv``, ``loss.png`` and ``model.safetensors`` into ``--out``.
- ``compare``: the same model, initial weights and batches in both frameworks; per-step loss
  difference and step time, as CSV and PNG.
- ``demo``: dispatched to ``gdn2.demo.main(argv)`` when that module exists.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

DEFAULTS = dict(
    # MQAR with 16 key-value pairs in sequences of 128: about 99% held-out recall after 500 steps,
    # about a minute on a 2-core CPU with PyTorch (measured numbers in the README).
    vocab_size=128, seq_len=128, num_kv_pairs=16,
    hidden_size=64, num_layers=2, num_heads=2, head_dim=32, chunk_size=8,
    steps=500, batch_size=32, lr=1e-2, eval_every=100, eval_size=512,
)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and a pointer to ``--help``.

    argparse prints the whole usage block before each error; here the error names the option
    (``--steps: expected an integer >= 1, received 0``) and one line says where the usage is.
    """

    def error(self, message: str):
        message = re.sub(r"^argument ([^:]+?): ", r"\1: ", message)
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help' for the options)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` after every option that has a default its help does not state."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _number(kind, least, strict=False):
    """An argparse ``type``: an int or a finite float ``>= least`` (``> least`` when ``strict``)."""
    wanted = f"{'an integer' if kind is int else 'a finite number'} {'>' if strict else '>='} {least}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, received {text!r}") from None
        if not math.isfinite(value) or value < least or (strict and value == least):
            raise argparse.ArgumentTypeError(f"expected {wanted}, received {text}")
        return value

    parse.__name__ = wanted  # what argparse would print for an unexpected failure
    return parse


POSITIVE, COUNT = _number(int, 1), _number(int, 0)
POSITIVE_FLOAT, NON_NEGATIVE_FLOAT = _number(float, 0, strict=True), _number(float, 0)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    task = parser.add_argument_group("task")
    task.add_argument("--data", type=Path, default=None,
                      help="a UTF-8 text file: character-level language modelling instead of MQAR")
    task.add_argument("--seq-len", type=POSITIVE, default=None,
                      help=f"tokens per sequence (default {DEFAULTS['seq_len']} for MQAR, 128 for --data)")
    task.add_argument("--vocab-size", type=POSITIVE, default=DEFAULTS["vocab_size"], help="MQAR vocabulary size")
    task.add_argument("--num-kv-pairs", type=POSITIVE, default=DEFAULTS["num_kv_pairs"],
                      help="MQAR key-value pairs per sequence")

    model = parser.add_argument_group("model")
    model.add_argument("--hidden-size", type=POSITIVE, default=DEFAULTS["hidden_size"], help="model width")
    model.add_argument("--num-layers", type=POSITIVE, default=DEFAULTS["num_layers"], help="GDN-2 blocks")
    model.add_argument("--num-heads", type=POSITIVE, default=DEFAULTS["num_heads"], help="query-key heads")
    model.add_argument("--head-dim", type=POSITIVE, default=DEFAULTS["head_dim"], help="key channels per head")
    model.add_argument("--num-v-heads", type=POSITIVE, default=None,
                       help="grouped value heads, a multiple of --num-heads (default: --num-heads)")
    model.add_argument("--expand-v", type=POSITIVE_FLOAT, default=1.0, help="value channels per head / --head-dim")
    model.add_argument("--allow-neg-eigval", action="store_true", help="erase gate in [0, 2] instead of [0, 1]")
    model.add_argument("--chunk-size", type=POSITIVE, default=DEFAULTS["chunk_size"],
                       help="chunk length of the chunked GDN-2 form (small is fastest on a CPU)")
    model.add_argument("--path", choices=("reference", "chunk", "kernel"), default=None,
                       help="force a GDN-2 path (default: automatic)")

    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=POSITIVE, default=DEFAULTS["steps"], help="optimizer steps")
    train.add_argument("--batch-size", type=POSITIVE, default=DEFAULTS["batch_size"], help="sequences per step")
    train.add_argument("--lr", type=POSITIVE_FLOAT, default=DEFAULTS["lr"], help="peak learning rate (AdamW, cosine decay)")
    train.add_argument("--warmup-steps", type=COUNT, default=None, help="linear warmup steps (default: 5%% of --steps)")
    train.add_argument("--weight-decay", type=NON_NEGATIVE_FLOAT, default=0.0, help="AdamW weight decay")
    train.add_argument("--grad-clip", type=NON_NEGATIVE_FLOAT, default=1.0, help="clip the gradient norm (0: off)")
    train.add_argument("--seed", type=COUNT, default=0, help="seed of the initial weights and of the batches")
    train.add_argument("--eval-every", type=COUNT, default=DEFAULTS["eval_every"],
                       help="evaluate every N steps (0: at the end only)")
    train.add_argument("--eval-size", type=POSITIVE, default=DEFAULTS["eval_size"], help="held-out sequences")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _as_option(message: str) -> str:
    """'num_kv_pairs: expected ...' -> '--num-kv-pairs: expected ...' (errors name the option)."""
    name, sep, rest = message.partition(":")
    if sep and name.isidentifier():
        return f"--{name.replace('_', '-')}:{rest}"
    return message


def _read_text(parser: argparse.ArgumentParser, path: Path) -> str:
    """The text of ``--data``, or a one-line error naming the option and the file."""
    if path.is_dir():
        parser.error(f"--data: expected a UTF-8 text file, received a directory: {path}")
    if not path.exists():
        parser.error(f"--data: expected a UTF-8 text file, received a path that does not exist: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        parser.error(f"--data: expected a UTF-8 text file, received {path}, whose byte {error.start} "
                     f"(0x{error.object[error.start]:02x}) is not UTF-8 ({error.reason})")
    except OSError as error:
        parser.error(f"--data: cannot read {path} ({error.strerror or error})")


def _build(parser: argparse.ArgumentParser, args):
    """(task, ModelConfig, TrainConfig) from the arguments, with errors naming the option."""
    from .train import CharTask, MQARTask, TrainConfig
    from .weights import ModelConfig, check_mixer_sizes

    try:
        if args.data is not None:
            task = CharTask(_read_text(parser, args.data), seq_len=args.seq_len or 128)
        else:
            task = MQARTask(args.vocab_size, args.seq_len or DEFAULTS["seq_len"], args.num_kv_pairs)
        model_config = ModelConfig(
            vocab_size=task.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
            num_heads=args.num_heads, head_dim=args.head_dim, num_v_heads=args.num_v_heads,
            expand_v=args.expand_v, allow_neg_eigval=args.allow_neg_eigval, chunk_size=args.chunk_size,
            path=args.path,
        )
        check_mixer_sizes(args.hidden_size, args.expand_v, args.head_dim, args.num_heads, args.num_v_heads, 4)
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20)
        train = TrainConfig(
            steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=warmup,
            weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed,
            eval_every=args.eval_every, eval_size=args.eval_size,
        )
    except ValueError as error:
        parser.error(_as_option(str(error)))
    return task, model_config, train


def _output_folder(parser: argparse.ArgumentParser, out: Path) -> Path:
    """``--out`` checked (a folder this process can write into) before anything trains."""
    from .train import check_output_folder

    try:
        return check_output_folder(out)
    except ValueError as error:
        parser.error(_as_option(str(error)))


def _metric_name(task) -> str:
    return "recall accuracy" if task.name == "mqar" else "next-character accuracy"


def _device_error(parser, error: ValueError, option: str):
    parser.error(str(error).replace("device:", f"{option}:", 1))


def cmd_train(parser, args) -> int:
    from .train import device_name, make_trainer, run_training, save_run, starting_weights

    task, model_config, train = _build(parser, args)
    out = _output_folder(parser, args.out or Path("runs") / f"train-{args.framework}-{task.name}")
    try:
        weights = starting_weights(model_config, train.seed, args.framework)
        trainer = make_trainer(args.framework, model_config, weights, train, args.device,
                               args.dtype, args.compile, data_parallel=True)
    except ValueError as error:  # --device, --dtype, --compile, or --batch-size over processes
        parser.error(_as_option(str(error)))
    # Under torchrun or mlx.launch (gdn2.distributed) only rank 0 prints, plots and writes files.
    world = trainer.world
    say = print if world.leader else (lambda *lines: None)
    args.quiet = args.quiet or not world.leader
    processes = f" x {world.size} processes ({world.name})" if world.size > 1 else ""
    # Every check is done: the run header comes after them, and after it only the run.
    precision = "float32" if trainer.dtype == "float32" else "bfloat16 compute, float32 weights"
    say(f"gdn2 train: {args.framework} on {device_name(trainer.device)}{processes}, {precision}"
        f"{', torch.compile' if args.compile else ''}; {task.describe()}")
    say(f"  model: {model_config.num_layers} layers, hidden {model_config.hidden_size}, "
        f"{model_config.num_heads} heads x {model_config.head_dim}; {train.steps} steps of {train.batch_size}, lr {train.lr}")
    result = run_training(trainer, task, train, progress=not args.quiet)
    if not world.leader:
        return 0
    title = f"GDN-2 {args.framework}, {task.describe()}"
    paths = save_run(out, result, trainer, train, model_config, title)
    final = result.final
    print(result.summary())
    extra = "" if task.name == "mqar" else f", {final['loss'] / math.log(2):.3f} bits/char"
    print(f"held-out {_metric_name(task)}: {100 * final['accuracy']:.2f}% (loss {final['loss']:.4f}{extra})")
    print(f"wrote {paths['csv']}, {paths['png']}, {paths['weights']}")
    return 0


def cmd_compare(parser, args) -> int:
    import numpy as np

    from .train import device_name, make_trainer, plot_compare, run_training, starting_weights, write_compare_csv

    task, model_config, train = _build(parser, args)
    out = _output_folder(parser, args.out or Path("runs") / f"compare-{task.name}")
    weights = starting_weights(model_config, train.seed)
    trainers = []
    for framework, device in (("torch", args.torch_device), ("mlx", args.mlx_device)):
        try:
            trainers.append(make_trainer(framework, model_config, weights, train, device))
        except ValueError as error:
            _device_error(parser, error, f"--{framework}-device")
    torch_trainer, mlx_trainer = trainers
    print(f"gdn2 compare: torch ({device_name(torch_trainer.device)}) vs mlx ({device_name(mlx_trainer.device)}), "
          f"{task.describe()}, {train.steps} steps, same initial weights and batches")
    results = []
    for trainer in trainers:
        results.append(run_training(trainer, task, train, progress=not args.quiet, label=f"compare {trainer.framework}"))
        print("  " + results[-1].summary())
    a, b = results
    diff = np.abs(np.asarray(a.losses) - np.asarray(b.losses))
    rel = diff / np.maximum(np.abs(np.asarray(a.losses)), 1e-12)
    first = {n: float(diff[: n].max()) for n in (1, 10, 100) if n <= len(diff)}
    print("per-step |loss torch - loss mlx|: "
          + ", ".join(f"max over first {n} steps {v:.2e}" for n, v in first.items())
          + f", max {diff.max():.2e} (relative {rel.max():.2e}), mean {diff.mean():.2e}")
    print(f"median step time: torch {1000 * np.median(a.step_seconds):.1f} ms, mlx {1000 * np.median(b.step_seconds):.1f} ms")
    print(f"held-out {_metric_name(task)}: torch {100 * a.final['accuracy']:.2f}%, mlx {100 * b.final['accuracy']:.2f}%")
    csv_path, png_path = out / "compare.csv", out / "compare.png"
    write_compare_csv(csv_path, results)
    plot_compare(png_path, results, f"GDN-2 torch vs mlx, {task.describe()}")
    print(f"wrote {csv_path}, {png_path}")
    return 0


DEMO_SIZES = ("--B", "--T", "--H", "--K", "--V", "--chunk-size")


def cmd_demo(argv: list[str], prog: str) -> int:
    """Run ``gdn2.demo.main(argv)``; its sizes checked first and its input errors as one line."""
    prog = f"{prog} demo"
    try:
        from . import demo
    except ImportError as error:
        print(f"{prog}: not available ({error})", file=sys.stderr)
        return 2
    sizes = Parser(prog=prog, add_help=False)
    for name in DEMO_SIZES:
        sizes.add_argument(name, type=POSITIVE)
    if not {"-h", "--help"} & set(argv):
        sizes.parse_known_args(argv)  # --T 0 -> "--T: expected an integer >= 1, received 0"
    try:
        return demo.main(argv, prog) or 0
    except ValueError as error:  # bad input the demo's own options let through: one line, no traceback
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2


def build_parser(prog: str = "gdn2") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description="Gated DeltaNet-2 in PyTorch and MLX", formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,compare,demo}")

    train = commands.add_parser("train", help="train the small GDN-2 language model (MQAR by default)",
                                formatter_class=HelpFormatter,
                                description="Train the small GDN-2 language model; MQAR by default, or a text file "
                                            "with --data. Writes loss.csv, loss.png and model.safetensors.")
    train.add_argument("--framework", choices=("torch", "mlx"), default="torch", help="which framework trains")
    train.add_argument("--device", default=None,
                       help="torch: cpu, cuda, cuda:1, mps (default cuda if available); mlx: cpu or gpu (default MLX's)")
    train.add_argument("--out", type=Path, default=None, help="output folder (default runs/train-FRAMEWORK-TASK)")
    train.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                       help="compute dtype; bfloat16: torch autocast, or a bfloat16 copy of the weights in MLX, while "
                            "the weights and AdamW stay float32 (default: bfloat16 on CUDA, float32 elsewhere)")
    train.add_argument("--compile", action="store_true",
                       help="torch.compile the model for training (torch only; the first step waits for the compilation)")
    _add_model_arguments(train)
    train.set_defaults(subparser=train)

    compare = commands.add_parser("compare", help="train in both frameworks from the same weights and batches",
                                  formatter_class=HelpFormatter,
                                  description="Train the same model from the same initial weights on the same batches "
                                              "in PyTorch and in MLX; report per-step loss difference and step time.")
    compare.add_argument("--torch-device", default="cpu", help="torch device")
    compare.add_argument("--mlx-device", default=None, help="mlx device: cpu or gpu (default MLX's)")
    compare.add_argument("--out", type=Path, default=None, help="output folder (default runs/compare-TASK)")
    _add_model_arguments(compare)
    compare.set_defaults(steps=100, eval_every=0, eval_size=256, subparser=compare)

    commands.add_parser("demo", help="the operator on every path against the float64 spec (arguments passed on)",
                        add_help=False)
    return parser


def main(argv: list[str] | None = None, prog: str = "gdn2") -> int:
    """The command line. ``prog`` is how the user ran it: ``gdn2`` (the console script) or
    ``python -m gdn2`` (set below), and what usage lines and errors call it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        return cmd_demo(argv[1:], prog)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    code = {"train": cmd_train, "compare": cmd_compare}[args.command](args.subparser, args)
    if not getattr(args, "quiet", False):
        print(f"total wall time {time.perf_counter() - started:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main(prog="python -m gdn2"))
