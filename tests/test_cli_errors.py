"""The command line: help with defaults, its own name, one-line errors that name the option and
come before any run output, outputs checked before training and written atomically."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("mlx.core")
pytest.importorskip("safetensors")

from gdn2.__main__ import main  # noqa: E402
from gdn2.train import MQARTask, RunResult, TrainConfig, moving_average, plot_training, run_training  # noqa: E402

TINY = ["--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--head-dim", "16", "--batch-size", "4",
        "--eval-size", "8", "--vocab-size", "32", "--seq-len", "24", "--num-kv-pairs", "4", "--quiet"]
ROOT = Path(__file__).resolve().parents[1]


def fails(argv, capsys):
    """Run the CLI expecting a usage error: (stdout, stderr lines)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    return captured.out, captured.err.strip().splitlines()


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, default in [("--steps STEPS optimizer steps", "500"), ("--lr LR peak learning rate (AdamW, cosine decay)", "0.01"),
                            ("--batch-size BATCH_SIZE sequences per step", "32"), ("--hidden-size HIDDEN_SIZE model width", "64"),
                            ("--eval-every EVAL_EVERY evaluate every N steps (0: at the end only)", "100"),
                            ("--framework {torch,mlx} which framework trains", "torch"), ("--seed SEED", None)]:
        assert option in text
        if default is not None:
            assert f"{option} (default: {default})" in text
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--steps STEPS optimizer steps (default: 100)" in text and "--torch-device TORCH_DEVICE torch device (default: cpu)" in text


def _usage_line(command):
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[0]


def test_prog_is_how_it_was_run():
    assert _usage_line([sys.executable, "-m", "gdn2", "--help"]).startswith("usage: python -m gdn2 [-h]")
    # what the console script does: import main and call it
    command = [sys.executable, "-c", "import sys; from gdn2.__main__ import main; sys.argv[0] = 'gdn2'; sys.exit(main())"]
    assert _usage_line([*command, "--help"]).startswith("usage: gdn2 [-h]")
    script = shutil.which("gdn2", path=os.path.dirname(sys.executable))
    if script is not None:  # the installed console script itself
        assert _usage_line([script, "--help"]).startswith("usage: gdn2 [-h]")


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps: expected an integer >= 1, received 0"),
    (["--eval-every", "-5"], "--eval-every: expected an integer >= 0, received -5"),
    (["--warmup-steps", "-1"], "--warmup-steps: expected an integer >= 0, received -1"),
    (["--warmup-steps", "2.5"], "--warmup-steps: expected an integer >= 0, received '2.5'"),
    (["--seed", "-1"], "--seed: expected an integer >= 0, received -1"),
    (["--eval-size", "0"], "--eval-size: expected an integer >= 1, received 0"),
    (["--batch-size", "x"], "--batch-size: expected an integer >= 1, received 'x'"),
    (["--lr", "0"], "--lr: expected a finite number > 0, received 0"),
    (["--lr", "nan"], "--lr: expected a finite number > 0, received nan"),
    (["--grad-clip", "-1"], "--grad-clip: expected a finite number >= 0, received -1"),
    (["--weight-decay", "inf"], "--weight-decay: expected a finite number >= 0, received inf"),
    (["--expand-v", "0"], "--expand-v: expected a finite number > 0, received 0"),
    (["--num-v-heads", "3"], "--num-v-heads: expected a multiple of num_heads=2, received 3"),
    (["--framework", "jax"], "--framework: invalid choice: 'jax'"),
])
def test_errors_are_one_line_naming_the_option(argv, message, capsys):
    out, err = fails(["train", *TINY, *argv], capsys)
    assert out == ""  # no run header before an error
    assert len(err) == 2 and not any(line.startswith("usage:") for line in err)
    assert err[0].startswith(f"gdn2 train: error: {message}")
    assert err[1] == "(see 'gdn2 train --help' for the options)"


def test_training_config_checks_its_counts():
    for name, value, least in [("warmup_steps", -1, 0), ("eval_every", -5, 0), ("steps", 0, 1), ("seed", -3, 0)]:
        with pytest.raises(ValueError, match=rf"^{name}: expected an integer >= {least}, received {value}$"):
            TrainConfig(**{name: value})
    with pytest.raises(ValueError, match=r"^lr: expected a finite number > 0, received nan$"):
        TrainConfig(lr=float("nan"))


def test_device_errors_come_before_the_run_header(tmp_path, capsys):
    out, err = fails(["train", "--framework", "mlx", "--device", "tpu", "--out", str(tmp_path), *TINY], capsys)
    assert out == "" and err[0] == "gdn2 train: error: --device: expected cpu or gpu for MLX, received 'tpu'"
    # compare: the MLX device is checked before the torch run, not after it
    out, err = fails(["compare", "--mlx-device", "tpu", "--steps", "2", "--out", str(tmp_path), *TINY], capsys)
    assert out == "" and err[0] == "gdn2 compare: error: --mlx-device: expected cpu or gpu for MLX, received 'tpu'"


def test_data_that_is_not_a_utf8_file(tmp_path, capsys):
    _, err = fails(["train", "--data", str(tmp_path), *TINY], capsys)
    assert err[0] == f"gdn2 train: error: --data: expected a UTF-8 text file, received a directory: {tmp_path}"
    binary = tmp_path / "data.bin"
    binary.write_bytes(("a" * 5000).encode() + b"\xff\xfe" + b"b" * 100)
    _, err = fails(["train", "--data", str(binary), *TINY], capsys)
    assert err[0] == (f"gdn2 train: error: --data: expected a UTF-8 text file, received {binary}, "
                      "whose byte 5000 (0xff) is not UTF-8 (invalid start byte)")
    _, err = fails(["train", "--data", str(tmp_path / "missing.txt"), *TINY], capsys)
    assert err[0] == f"gdn2 train: error: --data: expected a UTF-8 text file, received a path that does not exist: {tmp_path / 'missing.txt'}"


def test_demo_with_no_tokens(capsys):
    out, err = fails(["demo", "--T", "0"], capsys)
    assert out == "" and err == ["gdn2 demo: error: --T: expected an integer >= 1, received 0",
                                 "(see 'gdn2 demo --help' for the options)"]


def test_out_is_checked_before_training(tmp_path, capsys):
    a_file = tmp_path / "a file"
    a_file.write_text("keep me")
    _, err = fails(["train", "--out", str(a_file), *TINY], capsys)
    assert err[0] == f"gdn2 train: error: --out: expected a folder, received a file: {a_file}"
    _, err = fails(["train", "--out", str(a_file / "run"), *TINY], capsys)
    assert err[0].startswith(f"gdn2 train: error: --out: cannot create the folder {a_file / 'run'} (")
    assert a_file.read_text() == "keep me"


def test_unwritable_out_is_checked_before_training(tmp_path, capsys):
    if os.geteuid() != 0:  # permissions hold for this user: a read-only folder of our own
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
    elif os.path.isdir("/sys"):
        folder = Path("/sys")  # sysfs: no new files, even for root
    else:
        pytest.skip("running as root with no sysfs: no folder this user cannot write into")
    out, err = fails(["train", "--out", str(folder), *TINY], capsys)
    assert out == ""
    assert err[0].startswith(f"gdn2 train: error: --out: cannot write into the folder {folder} (")


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_outputs_are_replaced_atomically_with_the_usual_mode(framework, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    replaced = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((Path(a), Path(b))), real(a, b))[1])
    assert main(["train", "--framework", framework, "--steps", "2", "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    assert f"{framework} (cpu)" in printed and "Device(" not in printed
    targets = {b.name: a for a, b in replaced}
    assert set(targets) == {"loss.csv", "loss.png", "model.safetensors"}
    assert all(a.parent == out and a.name != b.name for a, b in replaced)
    modes = {name: stat.S_IMODE((out / name).stat().st_mode) for name in targets}
    assert len(set(modes.values())) == 1 and modes["model.safetensors"] == 0o666 & ~_umask(), modes
    assert sorted(p.name for p in out.iterdir()) == ["loss.csv", "loss.png", "model.safetensors"]


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


class WarningTrainer:
    """A stand-in trainer whose first step warns, as a kernel giving way does."""

    framework, device = "torch", "cpu"

    def step(self, inputs, targets, lr):
        warnings.warn("gdn2.torch: chunk (Triton kernel failed: CompilationError:\nline two)", RuntimeWarning)
        return 1.0

    def evaluate(self, inputs, targets):
        return 1.0, 1, 2

    def synchronize(self):
        pass


def test_a_warning_during_training_is_one_line(capsys):
    train = TrainConfig(steps=3, batch_size=2, eval_every=0, eval_size=2, warmup_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        run_training(WarningTrainer(), MQARTask(32, 24, 4), train, progress=True)
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if "warning" in line.lower()]
    assert lines and all(
        line.strip() == "warning: gdn2.torch: chunk (Triton kernel failed: CompilationError: line two) (RuntimeWarning)"
        for line in lines
    ), err
    assert ".py:" not in err and "warnings.warn" not in err


def test_the_moving_average_is_over_full_windows():
    values = np.arange(1.0, 26.0)
    steps, averages = moving_average(values, 20)
    assert steps.tolist() == [20, 21, 22, 23, 24, 25]
    np.testing.assert_allclose(averages, [np.mean(values[s - 20 : s]) for s in steps])
    assert len(moving_average(values[:19], 20)[0]) == 0


def test_the_plot_names_its_average_honestly(tmp_path, monkeypatch):
    import gdn2.train as train_module

    figures = []
    monkeypatch.setattr(train_module, "save_figure", lambda fig, path, dpi: figures.append(fig))
    losses = list(np.linspace(5, 1, 100))
    result = RunResult("torch", "cpu", losses, [0.1] * 100, [{"step": 100, "loss": 1.0, "accuracy": 0.5}], 10.0,
                       {"step": 100, "loss": 1.0, "accuracy": 0.5})
    plot_training(tmp_path / "loss.png", result, "title")
    lines = {line.get_label(): line for axis in figures[0].axes for line in axis.get_lines()}
    assert "loss (mean of the last 20 steps)" in lines and not any("moving average" in label for label in lines)
    assert lines["loss (mean of the last 20 steps)"].get_xdata()[0] == 20
