"""Training: the MQAR and text tasks, short runs whose loss goes down in both frameworks, the two
frameworks on the same weights and batches, and the command line (tiny configs, few steps)."""

from __future__ import annotations

import csv

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("mlx.core")
pytest.importorskip("safetensors")

from gdn2.__main__ import main  # noqa: E402
from gdn2.train import IGNORE, CharTask, MQARTask, TrainConfig, make_trainer, run_training, starting_weights  # noqa: E402
from gdn2.weights import ModelConfig, load_numpy  # noqa: E402

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, head_dim=16, chunk_size=8)
TINY_ARGS = ["--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--head-dim", "16",
             "--batch-size", "4", "--eval-size", "8", "--quiet"]


def test_mqar_batches_ask_for_the_values_of_earlier_keys(seed):
    task = MQARTask(vocab_size=40, seq_len=30, num_kv_pairs=5)
    tokens, targets = task.batch(np.random.default_rng(seed), 16)
    again, _ = task.batch(np.random.default_rng(seed), 16)
    np.testing.assert_array_equal(tokens, again)
    assert tokens.shape == targets.shape == (16, 30)
    for row, target in zip(tokens, targets):
        keys, values = row[0:10:2], row[1:10:2]
        assert len(set(keys.tolist())) == 5 and keys.min() >= 1 and keys.max() < 20
        assert values.min() >= 20 and values.max() < 40
        table = dict(zip(keys.tolist(), values.tolist()))
        asked = np.nonzero(target != IGNORE)[0]
        assert len(asked) == 10 and np.all(asked >= 10)
        for position in asked:
            assert table[int(row[position])] == target[position] == row[position + 1]


def test_char_task_splits_and_shifts(seed):
    text = "".join(np.random.default_rng(seed).choice(list("abcdefgh \n"), 4000))
    task = CharTask(text, seq_len=16)
    inputs, targets = task.batch(np.random.default_rng(seed), 4)
    assert task.vocab_size == len(set(text)) and inputs.shape == (4, 16)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    with pytest.raises(ValueError, match="data: the text has 10 characters"):
        CharTask("short text", seq_len=16)


def test_learning_rate_schedule():
    train = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert train.lr_at(0) == pytest.approx(1e-4)
    assert train.lr_at(9) == pytest.approx(1e-3)
    assert train.lr_at(99) == pytest.approx(1e-4, rel=0.01)
    assert all(train.lr_at(i) >= train.lr_at(i + 1) for i in range(10, 99))


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_short_training_run_lowers_the_loss(framework, seed):
    task = MQARTask(vocab_size=32, seq_len=24, num_kv_pairs=4)
    config = ModelConfig(vocab_size=32, **TINY)
    train = TrainConfig(steps=30, batch_size=16, lr=1e-2, warmup_steps=3, seed=seed, eval_every=0, eval_size=32)
    result = run_training(make_trainer(framework, config, starting_weights(config, seed), train), task, train, progress=False)
    assert np.all(np.isfinite(result.losses))
    first, last = np.mean(result.losses[:3]), np.mean(result.losses[-5:])
    assert last < first - 0.3, f"loss did not go down: {first:.3f} -> {last:.3f}"
    assert 0 <= result.final["accuracy"] <= 1


def test_frameworks_agree_step_by_step_on_the_same_weights_and_batches(seed):
    task = MQARTask(vocab_size=32, seq_len=24, num_kv_pairs=4)
    config = ModelConfig(vocab_size=32, **TINY)
    train = TrainConfig(steps=8, batch_size=8, lr=3e-3, warmup_steps=2, seed=seed, eval_every=0, eval_size=16)
    weights = starting_weights(config, seed)
    torch_run, mlx_run = (
        run_training(make_trainer(f, config, weights, train), task, train, progress=False) for f in ("torch", "mlx")
    )
    np.testing.assert_allclose(torch_run.losses, mlx_run.losses, rtol=1e-4, atol=1e-5)
    assert abs(torch_run.final["loss"] - mlx_run.final["loss"]) < 1e-3


def _rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_cli_train_writes_csv_png_and_weights(framework, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--framework", framework, "--steps", "3", "--eval-every", "2",
                 "--vocab-size", "32", "--seq-len", "24", "--num-kv-pairs", "4", "--out", str(out), *TINY_ARGS])
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-out recall accuracy" in printed
    rows = _rows(out / "loss.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert rows[1]["heldout_accuracy"] != "" and rows[0]["heldout_accuracy"] == ""
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    arrays, config = load_numpy(out / "model.safetensors")
    assert config.vocab_size == 32 and "layers.0.attn.q_proj.weight" in arrays


def test_cli_train_on_a_text_file(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    code = main(["train", "--data", str(data), "--seq-len", "16", "--steps", "2", "--out", str(tmp_path / "chars"), *TINY_ARGS])
    assert code == 0
    assert "bits/char" in capsys.readouterr().out
    assert len(_rows(tmp_path / "chars" / "loss.csv")) == 2


def test_cli_compare_reports_loss_difference(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main(["compare", "--steps", "3", "--vocab-size", "32", "--seq-len", "24", "--num-kv-pairs", "4",
                 "--out", str(out), *TINY_ARGS])
    assert code == 0
    printed = capsys.readouterr().out
    assert "|loss torch - loss mlx|" in printed and "median step time" in printed
    rows = _rows(out / "compare.csv")
    assert len(rows) == 3 and max(float(r["abs_diff"]) for r in rows) < 1e-3
    assert (out / "compare.png").stat().st_size > 1000


def test_cli_errors_name_the_option(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--num-kv-pairs", "100", "--out", str(tmp_path)])
    assert "--num-kv-pairs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--num-heads", "2", "--num-v-heads", "3", "--out", str(tmp_path)])
    assert "--num-v-heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--framework", "mlx", "--device", "tpu", "--steps", "1", "--out", str(tmp_path), *TINY_ARGS])
    assert "--device" in capsys.readouterr().err
