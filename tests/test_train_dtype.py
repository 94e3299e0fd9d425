"""``python -m gdn2 train --dtype`` and ``--compile``, and the tokens per second it reports: tiny
runs on the CPU.

bfloat16 computes in bf16 (torch: autocast; MLX: a bf16 copy of the weights) while the weights,
their gradients and AdamW's state stay float32. ``--compile`` runs ``torch.compile``; a real
compilation takes minutes on a small CPU, so the test that compiles runs only with
``GDN2_SLOW_TESTS=1``; the default test checks that the compiled callable is the one trained.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import gdn2.train as train_module  # noqa: E402
from gdn2.__main__ import main  # noqa: E402
from gdn2.train import MQARTask, TrainConfig, make_trainer, run_training, starting_weights  # noqa: E402
from gdn2.weights import ModelConfig, load_numpy  # noqa: E402

TINY = dict(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, head_dim=16, chunk_size=8)
TINY_ARGS = ["--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--head-dim", "16", "--batch-size", "4",
             "--eval-size", "8", "--vocab-size", "32", "--seq-len", "24", "--num-kv-pairs", "4", "--quiet"]


def first_losses(framework, dtype, seed, steps=3):
    """Losses of the first steps and the trainer, from the same weights and batches for every dtype."""
    config = ModelConfig(**TINY)
    train = TrainConfig(steps=steps, batch_size=4, lr=1e-2, warmup_steps=1, seed=seed, eval_every=0, eval_size=8)
    trainer = make_trainer(framework, config, starting_weights(config, seed), train, "cpu", dtype)
    result = run_training(trainer, MQARTask(32, 24, 4), train, progress=False)
    return np.array(result.losses), trainer, result


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_bfloat16_computes_in_bf16_and_keeps_float32_weights(framework, seed):
    if framework == "mlx":
        pytest.importorskip("mlx.core")
    exact, _, _ = first_losses(framework, "float32", seed)
    rounded, trainer, result = first_losses(framework, "bfloat16", seed)
    assert trainer.dtype == "bfloat16"
    assert not np.array_equal(exact, rounded), "bfloat16 gave float32's losses bit for bit: no bf16 compute"
    np.testing.assert_allclose(rounded, exact, rtol=3e-2)
    assert all(array.dtype == np.float32 for array in trainer.weights().values())
    if framework == "torch":
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in trainer.model.parameters())
        state = trainer.optimizer.state[next(trainer.model.parameters())]
        assert state["exp_avg"].dtype == torch.float32
    else:
        from mlx.utils import tree_flatten

        assert {str(p.dtype) for _, p in tree_flatten(trainer.model.parameters())} == {"mlx.core.float32"}
    assert result.tokens_per_step == 4 * 24 and result.tokens_per_second() > 0


def test_cli_train_bfloat16_reports_tokens_per_second(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--dtype", "bfloat16", "--steps", "3", "--eval-every", "2", "--out", str(out), *TINY_ARGS]) == 0
    printed = capsys.readouterr().out
    assert "torch on cpu, bfloat16 compute, float32 weights;" in printed
    assert "tokens/s" in printed.split("held-out recall accuracy")[0]
    arrays, _ = load_numpy(out / "model.safetensors")
    assert all(a.dtype == np.float32 for a in arrays.values())


def test_progress_bar_shows_tokens_per_second(seed, capsys):
    config = ModelConfig(**TINY)
    train = TrainConfig(steps=2, batch_size=4, warmup_steps=1, seed=seed, eval_every=0, eval_size=8)
    trainer = make_trainer("torch", config, starting_weights(config, seed), train, "cpu")
    run_training(trainer, MQARTask(32, 24, 4), train, progress=True)
    assert "tokens_s=" in capsys.readouterr().err


def test_default_dtype_is_float32_off_cuda():
    config = ModelConfig(**TINY)
    trainer = make_trainer("torch", config, starting_weights(config, 0), TrainConfig(steps=1), "cpu")
    assert trainer.dtype == "float32" and trainer.forward_model is trainer.model


def test_cli_compile_trains_the_compiled_model(tmp_path, capsys, monkeypatch):
    """torch.compile replaced by a recorder: the compiled callable runs every training step, the
    weights file keeps the model's own names."""
    compiled_calls = []

    def fake_compile(model):
        def compiled(*arguments, **options):
            compiled_calls.append(arguments[0].shape)
            return model(*arguments, **options)

        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    out = tmp_path / "run"
    assert main(["train", "--compile", "--steps", "3", "--eval-every", "0", "--out", str(out), *TINY_ARGS]) == 0
    assert "torch.compile" in capsys.readouterr().out.splitlines()[0]
    assert compiled_calls == [(4, 24)] * 3
    arrays, _ = load_numpy(out / "model.safetensors")
    assert "layers.0.attn.q_proj.weight" in arrays


@pytest.mark.skipif(os.environ.get("GDN2_SLOW_TESTS") != "1", reason="torch.compile takes minutes on a small CPU; GDN2_SLOW_TESTS=1 runs it")
def test_cli_compile_really_compiles(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--compile", "--dtype", "bfloat16", "--steps", "2", "--eval-every", "0", "--out", str(out), *TINY_ARGS]) == 0
    assert "tokens/s" in capsys.readouterr().out


def test_cli_dtype_and_compile_errors_name_the_option(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["train", "--dtype", "float16", "--out", str(tmp_path), *TINY_ARGS])
    assert "--dtype: invalid choice: 'float16'" in capsys.readouterr().err
    pytest.importorskip("mlx.core")
    with pytest.raises(SystemExit):
        main(["train", "--framework", "mlx", "--compile", "--out", str(tmp_path), *TINY_ARGS])
    assert "--compile: torch.compile applies to --framework torch only" in capsys.readouterr().err
    monkeypatch.setattr(train_module, "_bf16_autocast_problem", lambda torch, device: "no bf16 kernels here")
    with pytest.raises(SystemExit):
        main(["train", "--dtype", "bfloat16", "--out", str(tmp_path), *TINY_ARGS])
    err = capsys.readouterr().err
    assert "--dtype: bfloat16 autocast is not available on cpu (no bf16 kernels here); use float32" in err


def test_bf16_autocast_problem_names_the_device():
    assert train_module._bf16_autocast_problem(torch, torch.device("cpu")) is None
    assert "meta" in train_module._bf16_autocast_problem(torch, torch.device("meta"))
    with pytest.raises(ValueError, match="dtype: expected one of float32, bfloat16, received 'float16'"):
        make_trainer("torch", ModelConfig(**TINY), starting_weights(ModelConfig(**TINY), 0), TrainConfig(steps=1), "cpu", "float16")
