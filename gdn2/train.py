"""Training the GDN-2 language model in PyTorch or MLX on the same data, and comparing the two.

Everything here that decides *what* is learned is numpy and framework-neutral: the tasks (MQAR,
character-level text), the batches (drawn from one seed), the initial weights
(``gdn2.weights.initial_weights``), the learning-rate schedule. Only the training step is
framework-specific (``TorchTrainer``, ``MLXTrainer``, each importing its framework lazily), so a
torch run and an MLX run with the same seed start from the same model and see the same batches.

Outputs of a run: ``loss.csv`` (step, loss, learning rate, seconds, held-out metrics where
evaluated), ``loss.png`` and ``model.safetensors`` (loadable by either framework).
"""

from __future__ import annotations

import csv
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .weights import ModelConfig, initial_weights, write_atomically

IGNORE = -100  # target value of positions that carry no loss


# ---------------------------------------------------------------------------------------------
# Tasks: numpy batches of (inputs [B, T] int64, targets [B, T] int64 with IGNORE)
# ---------------------------------------------------------------------------------------------


@dataclass
class MQARTask:
    """Multi-query associative recall (Zoology's MQAR, the standard recall test for linear attention).

    A sequence lists ``num_kv_pairs`` key-value pairs, then asks for keys again: after each
    queried key the model must output its value. Tokens: 0 is unused, keys are
    ``1 .. vocab_size // 2 - 1``, values ``vocab_size // 2 .. vocab_size - 1``. Layout of one
    sequence of ``seq_len`` tokens::

        k1 v1 k2 v2 ... kn vn | q1 a1 q2 a2 ...       (q_i drawn from the n keys, a_i its value)

    Loss and accuracy count only the positions of the queried keys (predicting ``a_i``).
    """

    vocab_size: int = 128
    seq_len: int = 128
    num_kv_pairs: int = 16
    name: str = "mqar"

    def __post_init__(self):
        num_keys = self.vocab_size // 2 - 1
        if self.num_kv_pairs < 1 or self.num_kv_pairs > num_keys:
            raise ValueError(
                f"num_kv_pairs: expected 1 .. {num_keys} (distinct keys of a vocabulary of {self.vocab_size}), "
                f"received {self.num_kv_pairs}"
            )
        if self.seq_len % 2 or self.seq_len < 2 * self.num_kv_pairs + 2:
            raise ValueError(
                f"seq_len: expected an even number >= 2 * num_kv_pairs + 2 = {2 * self.num_kv_pairs + 2}, "
                f"received {self.seq_len}"
            )

    def batch(self, rng: np.random.Generator, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        n, T = self.num_kv_pairs, self.seq_len
        half = self.vocab_size // 2
        # Distinct keys per sequence: the first n of a random permutation of the key range.
        keys = np.argsort(rng.random((batch_size, half - 1)), axis=1)[:, :n] + 1
        values = rng.integers(half, self.vocab_size, (batch_size, n))
        num_queries = (T - 2 * n) // 2
        asked = rng.integers(0, n, (batch_size, num_queries))
        rows = np.arange(batch_size)[:, None]
        tokens = np.empty((batch_size, T), dtype=np.int64)
        tokens[:, 0 : 2 * n : 2], tokens[:, 1 : 2 * n : 2] = keys, values
        tokens[:, 2 * n :: 2], tokens[:, 2 * n + 1 :: 2] = keys[rows, asked], values[rows, asked]
        targets = np.full((batch_size, T), IGNORE, dtype=np.int64)
        targets[:, 2 * n :: 2] = tokens[:, 2 * n + 1 :: 2]
        return tokens, targets

    def describe(self) -> str:
        return f"MQAR: vocab {self.vocab_size}, {self.num_kv_pairs} key-value pairs, sequences of {self.seq_len}"


@dataclass
class CharTask:
    """Character-level language modelling on a text: random windows of ``seq_len + 1`` characters.

    The first 90% of the text trains, the last 10% is held out. The vocabulary is the sorted set of
    characters in the whole text.
    """

    text: str
    seq_len: int = 128
    name: str = "chars"
    chars: list[str] = field(init=False)

    def __post_init__(self):
        if len(self.text) < 2 * (self.seq_len + 1) * 10:
            raise ValueError(
                f"data: the text has {len(self.text)} characters; at least {20 * (self.seq_len + 1)} are needed "
                f"for sequences of {self.seq_len} (or lower --seq-len)"
            )
        self.chars = sorted(set(self.text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        ids = np.array([lookup[c] for c in self.text], dtype=np.int64)
        split = int(len(ids) * 0.9)
        self.train_ids, self.heldout_ids = ids[:split], ids[split:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def _windows(self, ids: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        windows = ids[starts[:, None] + np.arange(self.seq_len + 1)]
        return windows[:, :-1].copy(), windows[:, 1:].copy()

    def batch(self, rng: np.random.Generator, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        return self._windows(self.train_ids, rng.integers(0, len(self.train_ids) - self.seq_len - 1, batch_size))

    def heldout(self, rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
        return self._windows(self.heldout_ids, rng.integers(0, len(self.heldout_ids) - self.seq_len - 1, count))

    def describe(self) -> str:
        return f"characters: {len(self.text)} chars, vocabulary {self.vocab_size}, sequences of {self.seq_len}"


def heldout_set(task, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed held-out set, drawn from a stream no training batch comes from."""
    rng = np.random.default_rng([seed, 1_000_003])
    if isinstance(task, CharTask):
        return task.heldout(rng, count)
    return task.batch(rng, count)


def training_batches(task, batch_size: int, seed: int):
    """The endless stream of training batches of a seed (the same for every framework)."""
    rng = np.random.default_rng([seed, 17])
    while True:
        yield task.batch(rng, batch_size)


# ---------------------------------------------------------------------------------------------
# Optimisation settings and schedule
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``; gradient clipping."""

    steps: int = 500
    batch_size: int = 32
    lr: float = 1e-2
    warmup_steps: int = 25
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_size: int = 512

    def __post_init__(self):
        counts = dict(steps=1, batch_size=1, eval_size=1, warmup_steps=0, eval_every=0, seed=0)
        for name, least in counts.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise ValueError(f"{name}: expected an integer >= {least}, received {value!r}")
        for name, positive in dict(lr=True, weight_decay=False, grad_clip=False, eps=True).items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                value <= 0 if positive else value < 0
            ):
                raise ValueError(f"{name}: expected a finite number {'> 0' if positive else '>= 0'}, received {value!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: expected a number in [0, 1], received {self.min_lr_ratio!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step`` (0-based); ``warmup_steps`` 0 starts at the peak."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


# ---------------------------------------------------------------------------------------------
# Framework-specific training steps
# ---------------------------------------------------------------------------------------------


DTYPES = ("float32", "bfloat16")


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, received {dtype!r}")


class TorchTrainer:
    """A ``gdn2.torch.layer.GDN2LanguageModel`` with torch.optim.AdamW on ``device``.

    ``dtype``: ``float32``, or ``bfloat16``: the forward under bf16 autocast while the weights,
    their gradients and AdamW's state stay float32 (None: bfloat16 on CUDA, float32 elsewhere).
    ``compile``: the training forward through ``torch.compile`` (evaluation runs the model as is,
    so that it does not compile a second graph).
    ``data_parallel``: when started by torchrun, the processes train together (``gdn2.distributed``:
    DDP, each process its share of the global batch and the GPU of its LOCAL_RANK).
    """

    framework = "torch"

    def __init__(self, model_config: ModelConfig, weights: dict[str, np.ndarray], train: TrainConfig, device: str | None,
                 dtype: str | None = None, compile: bool = False, data_parallel: bool = False):
        import torch

        from .torch.layer import GDN2LanguageModel, set_numpy_weights

        self.torch = torch
        try:
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except RuntimeError as error:
            raise ValueError(f"device: {device!r} is not a torch device ({error})") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} requested but this torch has no usable CUDA device")
        if self.device.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"device: {device!r} requested but MPS is not available")
        from .distributed import torch_world

        self.world, self.device = torch_world(self.device, data_parallel)
        self.world.check_batch(train.batch_size)
        check_dtype(dtype)
        self.dtype = dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        if self.dtype == "bfloat16":
            problem = _bf16_autocast_problem(torch, self.device)
            if problem is not None:
                raise ValueError(f"dtype: bfloat16 autocast is not available on {device_name(self.device)} ({problem}); "
                                 "use float32")
        self.model = GDN2LanguageModel(model_config)
        set_numpy_weights(self.model, weights, "initial weights")
        self.model.to(self.device)
        self.compiled = compile
        network = self.world.wrap(self.model) if self.world.size > 1 else self.model
        self.forward_model = torch.compile(network) if compile else network
        self.train_config = train
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train.lr, betas=train.betas, eps=train.eps, weight_decay=train.weight_decay
        )

    def _autocast(self):
        return self.torch.autocast(self.device.type, dtype=self.torch.bfloat16, enabled=self.dtype == "bfloat16")

    def _loss(self, inputs, targets):
        torch = self.torch
        with self._autocast():
            logits = self.forward_model(torch.from_numpy(inputs).to(self.device))
        targets = torch.from_numpy(targets).to(self.device)
        return logits, torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE
        )

    def step(self, inputs: np.ndarray, targets: np.ndarray, lr: float) -> float:
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        inputs, targets, share = self.world.shard(inputs, targets)
        _, loss = self._loss(inputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        # Weighted so that DDP's average over processes is the gradient of the global batch's mean.
        (loss * (share * self.world.size) if self.world.size > 1 else loss).backward()
        if self.train_config.grad_clip > 0:
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_config.grad_clip)
        self.optimizer.step()
        return self.world.sum([float(loss.detach()) * share])[0]

    def evaluate(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[float, int, int]:
        """``(summed loss, correct predictions, counted positions)`` over one batch."""
        return _evaluate_shared(self, inputs, targets)

    def _evaluate(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[float, int, int]:
        torch = self.torch
        self.model.eval()
        with torch.no_grad(), self._autocast():
            logits = self.model(torch.from_numpy(inputs).to(self.device)).float()
            targets_t = torch.from_numpy(targets).to(self.device)
            mask = targets_t != IGNORE
            loss = torch.nn.functional.cross_entropy(
                logits[mask], targets_t[mask], reduction="sum"
            )
            correct = (logits.argmax(-1)[mask] == targets_t[mask]).sum()
        return float(loss), int(correct), int(mask.sum())

    def weights(self) -> dict[str, np.ndarray]:
        from .torch.layer import numpy_weights

        return numpy_weights(self.model)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)


def _bf16_autocast_problem(torch, device) -> str | None:
    """None when bf16 autocast runs on ``device``, else why not (torch may only warn and disable it)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bfloat16 support"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                enabled = torch.is_autocast_enabled(device.type)
        except (RuntimeError, ValueError) as error:
            return " ".join(str(error).split())
    if not enabled:
        return " ".join(" ".join(str(w.message).split()) for w in caught) or "torch disables it"
    return None


class MLXTrainer:
    """A ``gdn2.mlx.layer.GDN2LanguageModel`` with mlx.optimizers.AdamW (bias-corrected, as torch).

    ``dtype``: ``float32`` (None), or ``bfloat16``: each step computes with a bfloat16 copy of the
    weights, and the gradients flow back through the cast to the float32 weights AdamW updates.
    ``data_parallel``: when started by mlx.launch, the processes train together
    (``gdn2.distributed``: each its share of the global batch, gradients averaged).
    """

    framework = "mlx"

    def __init__(self, model_config: ModelConfig, weights: dict[str, np.ndarray], train: TrainConfig, device: str | None,
                 dtype: str | None = None, data_parallel: bool = False):
        import mlx.core as mx
        import mlx.nn as nn
        import mlx.optimizers as optim

        from .mlx.layer import GDN2LanguageModel, set_numpy_weights

        self.mx, self.nn, self.optim = mx, nn, optim
        if device is not None:
            if device not in ("cpu", "gpu"):
                raise ValueError(f"device: expected cpu or gpu for MLX, received {device!r}")
            if device == "gpu" and not mx.is_available(mx.gpu):
                raise ValueError("device: gpu requested but this MLX has no GPU backend (Linux builds are CPU-only)")
            mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)
        self.device = device_name(mx.default_device())
        from .distributed import MLXWorld, single

        self.world = MLXWorld.start() if data_parallel else single
        self.world.check_batch(train.batch_size)
        check_dtype(dtype)
        self.dtype = dtype or "float32"
        self.model = GDN2LanguageModel(model_config)
        set_numpy_weights(self.model, weights, "initial weights")
        self.train_config = train
        self.optimizer = optim.AdamW(
            learning_rate=train.lr, betas=list(train.betas), eps=train.eps, weight_decay=train.weight_decay,
            bias_correction=True,
        )
        self._loss_and_grad = mx.value_and_grad(self._loss)

    def _compute_weights(self, weights):
        """The weights a step computes with: float32 as stored, or their bfloat16 cast."""
        if self.dtype == "float32":
            return weights
        from mlx.utils import tree_map

        return tree_map(lambda w: w.astype(self.mx.bfloat16), weights)

    def _loss(self, weights, inputs, targets):
        mx = self.mx
        self.model.update(self._compute_weights(weights))
        logits = self.model(inputs).astype(mx.float32)
        mask = targets != IGNORE
        losses = self.nn.losses.cross_entropy(logits, mx.where(mask, targets, 0), reduction="none")
        return mx.sum(losses * mask) / mx.maximum(mx.sum(mask), 1)

    def step(self, inputs: np.ndarray, targets: np.ndarray, lr: float) -> float:
        mx = self.mx
        self.model.train()
        self.optimizer.learning_rate = lr
        inputs, targets, share = self.world.shard(inputs, targets)
        weights = self.model.trainable_parameters()
        loss, grads = self._loss_and_grad(weights, mx.array(inputs), mx.array(targets))
        self.model.update(weights)  # the float32 weights back in place of the step's compute copy
        if self.world.size > 1:  # the average over processes: the gradient of the global batch's mean
            from mlx.utils import tree_map

            grads = self.world.average(tree_map(lambda g: g * (share * self.world.size), grads))
        if self.train_config.grad_clip > 0:
            grads, _ = self.optim.clip_grad_norm(grads, self.train_config.grad_clip)
        self.optimizer.update(self.model, grads)
        mx.eval(loss, self.model.parameters(), self.optimizer.state)
        return self.world.sum([float(loss) * share])[0]

    def evaluate(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[float, int, int]:
        """``(summed loss, correct predictions, counted positions)`` over one batch."""
        return _evaluate_shared(self, inputs, targets)

    def _evaluate(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[float, int, int]:
        mx = self.mx
        self.model.eval()
        weights = self.model.trainable_parameters()
        self.model.update(self._compute_weights(weights))
        logits = self.model(mx.array(inputs)).astype(mx.float32)
        self.model.update(weights)
        targets_m = mx.array(targets)
        mask = targets_m != IGNORE
        losses = self.nn.losses.cross_entropy(logits, mx.where(mask, targets_m, 0), reduction="none")
        loss = mx.sum(losses * mask)
        correct = mx.sum((mx.argmax(logits, axis=-1) == targets_m) * mask)
        mx.eval(loss, correct)
        return float(loss), int(correct), int(mx.sum(mask))

    def weights(self) -> dict[str, np.ndarray]:
        from .mlx.layer import numpy_weights

        return numpy_weights(self.model)

    def synchronize(self) -> None:
        self.mx.synchronize()


def _evaluate_shared(trainer, inputs: np.ndarray, targets: np.ndarray) -> tuple[float, int, int]:
    """``trainer._evaluate`` on this process's share of the rows, summed over processes."""
    world = trainer.world
    if world.size == 1:
        return trainer._evaluate(inputs, targets)
    rows = world.rows(len(inputs))
    local = trainer._evaluate(inputs[rows], targets[rows]) if rows.stop > rows.start else (0.0, 0, 0)
    loss, correct, count = world.sum([float(x) for x in local])
    return loss, int(round(correct)), int(round(count))


def device_name(device) -> str:
    """A device as a user writes it: ``cpu``, ``gpu``, ``cuda:0`` (not ``Device(cpu, 0)``)."""
    kind = getattr(device, "type", None)
    if kind is not None and not isinstance(kind, str):  # mlx: Device(cpu, 0) -> "cpu" (or "gpu:1")
        index = getattr(device, "index", 0)
        return kind.name if not index else f"{kind.name}:{index}"
    return str(device)


def make_trainer(framework: str, model_config: ModelConfig, weights, train: TrainConfig, device: str | None = None,
                 dtype: str | None = None, compile: bool = False, data_parallel: bool = False):
    """A ``TorchTrainer`` or an ``MLXTrainer`` starting from ``weights`` ({name: numpy array});
    ``dtype``, ``compile`` and ``data_parallel`` as the trainers take them (``compile``: torch only)."""
    if framework == "torch":
        return TorchTrainer(model_config, weights, train, device, dtype, compile, data_parallel)
    if framework == "mlx":
        if compile:
            raise ValueError("compile: torch.compile applies to --framework torch only")
        return MLXTrainer(model_config, weights, train, device, dtype, data_parallel)
    raise ValueError(f"framework: expected torch or mlx, received {framework!r}")


def starting_weights(model_config: ModelConfig, seed: int, framework: str = "torch") -> dict[str, np.ndarray]:
    """The framework-independent initial weights of a model, ``{name: float32 array}``.

    The parameter names and shapes come from building the model once in ``framework`` where it is
    installed, else in the other (both give the same names; an MLX process need not import torch);
    the values from ``gdn2.weights.initial_weights``.
    """

    def torch_shapes():
        from .torch.layer import GDN2LanguageModel

        return {name: tuple(p.shape) for name, p in GDN2LanguageModel(model_config).named_parameters()}

    def mlx_shapes():
        from mlx.utils import tree_flatten

        from .mlx.layer import GDN2LanguageModel as MLXModel

        return {name: tuple(p.shape) for name, p in tree_flatten(MLXModel(model_config).parameters())}

    first, second = (mlx_shapes, torch_shapes) if framework == "mlx" else (torch_shapes, mlx_shapes)
    try:
        shapes = first()
    except ImportError:
        shapes = second()
    return initial_weights(shapes, seed)


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    framework: str
    device: str
    losses: list[float]
    step_seconds: list[float]
    evaluations: list[dict]  # {"step", "loss", "accuracy"} per evaluation
    wall_seconds: float
    final: dict  # the last evaluation
    tokens_per_step: int = 0  # batch size x sequence length

    def tokens_per_second(self) -> float:
        """Training throughput at the median step time (evaluation and the slow first steps left out)."""
        return self.tokens_per_step / float(np.median(self.step_seconds))

    def summary(self) -> str:
        final = self.final
        median = float(np.median(self.step_seconds))
        rate = f", {self.tokens_per_second():,.0f} tokens/s" if self.tokens_per_step else ""
        text = (
            f"{self.framework} ({self.device}): {len(self.losses)} steps in {self.wall_seconds:.1f} s "
            f"(median step {1000 * median:.1f} ms{rate}); "
            f"held-out loss {final['loss']:.4f}, accuracy {100 * final['accuracy']:.2f}%"
        )
        return text


def evaluate(trainer, heldout: tuple[np.ndarray, np.ndarray], batch_size: int) -> dict:
    """Held-out loss per counted token and accuracy (recall accuracy for MQAR)."""
    inputs, targets = heldout
    total_loss = total_correct = total_count = 0
    for start in range(0, len(inputs), batch_size):
        loss, correct, count = trainer.evaluate(inputs[start : start + batch_size], targets[start : start + batch_size])
        total_loss, total_correct, total_count = total_loss + loss, total_correct + correct, total_count + count
    count = max(total_count, 1)
    return {"loss": total_loss / count, "accuracy": total_correct / count}


def run_training(trainer, task, train: TrainConfig, progress: bool = True, label: str | None = None) -> RunResult:
    """Train ``trainer`` for ``train.steps`` steps on ``task``; evaluate every ``eval_every`` steps.

    A warning raised during training (a kernel giving way, say) is written as one line above the
    progress bar (``warning: message (category)``), not as Python's file, line and source line
    through the middle of it.
    """
    from tqdm.auto import tqdm

    heldout = heldout_set(task, train.eval_size, train.seed)
    batches = training_batches(task, train.batch_size, train.seed)
    losses, step_seconds, evaluations = [], [], []
    tokens_per_step = 0
    started = time.perf_counter()
    bar = tqdm(range(train.steps), desc=label or f"train {trainer.framework}", disable=not progress, dynamic_ncols=True)
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning(tqdm)
        try:
            for step in bar:
                inputs, targets = next(batches)
                tokens_per_step = inputs.size
                tick = time.perf_counter()
                loss = trainer.step(inputs, targets, train.lr_at(step))
                step_seconds.append(time.perf_counter() - tick)
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss became {loss} at step {step}; lower --lr")
                losses.append(loss)
                last = step + 1 == train.steps
                # Tokens per second over the last 10 steps (training steps only, no evaluation).
                rate = f"{tokens_per_step * len(step_seconds[-10:]) / sum(step_seconds[-10:]):,.0f}"
                if last or (train.eval_every > 0 and (step + 1) % train.eval_every == 0):
                    evaluations.append({"step": step + 1, **evaluate(trainer, heldout, train.batch_size)})
                    bar.set_postfix(loss=f"{loss:.3f}", heldout_acc=f"{100 * evaluations[-1]['accuracy']:.1f}%", tokens_s=rate)
                elif step % 10 == 0:
                    accuracy = f"{100 * evaluations[-1]['accuracy']:.1f}%" if evaluations else "-"
                    bar.set_postfix(loss=f"{loss:.3f}", heldout_acc=accuracy, tokens_s=rate)
        finally:
            bar.close()
    trainer.synchronize()
    wall = time.perf_counter() - started
    return RunResult(trainer.framework, str(trainer.device), losses, step_seconds, evaluations, wall, evaluations[-1],
                     tokens_per_step)


def _one_line_warning(tqdm):
    """A ``warnings.showwarning`` that writes ``warning: message (category)`` through ``tqdm.write``."""

    def show(message, category, filename, lineno, file=None, line=None):
        text = " ".join(str(message).split())
        tqdm.write(f"warning: {text} ({category.__name__})", file=sys.stderr)

    return show


# ---------------------------------------------------------------------------------------------
# Files: CSV and PNG
# ---------------------------------------------------------------------------------------------


def write_csv(path, header: list[str], rows) -> None:
    """A CSV file, written atomically (``gdn2.weights.write_atomically``)."""

    def write(temporary):
        with open(temporary, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows(rows)

    write_atomically(path, write)


def save_figure(fig, path, dpi: int) -> None:
    """A matplotlib figure as PNG, written atomically."""
    write_atomically(path, lambda temporary: fig.savefig(temporary, format="png", dpi=dpi))


def write_training_csv(path, result: RunResult, train: TrainConfig) -> None:
    """Columns: step, loss, lr, step_seconds, heldout_loss, heldout_accuracy (the last two where evaluated)."""
    by_step = {e["step"]: e for e in result.evaluations}
    rows = []
    for i, (loss, seconds) in enumerate(zip(result.losses, result.step_seconds)):
        e = by_step.get(i + 1)
        rows.append([i + 1, f"{loss:.6f}", f"{train.lr_at(i):.6g}", f"{seconds:.5f}",
                     f"{e['loss']:.6f}" if e else "", f"{e['accuracy']:.6f}" if e else ""])
    write_csv(path, ["step", "loss", "lr", "step_seconds", "heldout_loss", "heldout_accuracy"], rows)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def moving_average(values, window: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """Trailing moving average over exactly ``window`` values: ``(steps, averages)``.

    Step ``s`` (1-based) gets the mean of values ``s - window + 1 .. s``; steps before the first
    full window get none (so the first points are not running means of fewer values). Fewer than
    ``window`` values give empty arrays.
    """
    values = np.asarray(values, dtype=np.float64)
    if len(values) < window:
        return np.arange(0), np.zeros(0)
    sums = np.cumsum(np.insert(values, 0, 0.0))
    return np.arange(window, len(values) + 1), (sums[window:] - sums[:-window]) / window


def plot_training(path, result: RunResult, title: str) -> None:
    """Training loss (raw and smoothed) and held-out accuracy against step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    steps = np.arange(1, len(result.losses) + 1)
    ax.plot(steps, result.losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss")
    window = min(20, max(1, len(result.losses) // 5))
    average_steps, averages = moving_average(result.losses, window)
    if window > 1:
        ax.plot(average_steps, averages, color="tab:blue", label=f"loss (mean of the last {window} steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    if result.evaluations:
        twin = ax.twinx()
        twin.plot([e["step"] for e in result.evaluations], [100 * e["accuracy"] for e in result.evaluations],
                  "o-", color="tab:orange", label="held-out accuracy")
        twin.set_ylabel("held-out accuracy (%)")
        twin.set_ylim(0, 100)
        lines, labels = ax.get_legend_handles_labels()
        more_lines, more_labels = twin.get_legend_handles_labels()
        twin.legend(lines + more_lines, labels + more_labels, loc="lower left")
    else:
        ax.legend(loc="lower left")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def write_compare_csv(path, results: list[RunResult]) -> None:
    """Columns: step, loss of each framework, |difference|, step seconds of each framework."""
    a, b = results
    header = ["step", f"loss_{a.framework}", f"loss_{b.framework}", "abs_diff",
              f"step_seconds_{a.framework}", f"step_seconds_{b.framework}"]
    rows = [[i + 1, f"{la:.7f}", f"{lb:.7f}", f"{abs(la - lb):.3e}", f"{ta:.5f}", f"{tb:.5f}"]
            for i, (la, lb, ta, tb) in enumerate(zip(a.losses, b.losses, a.step_seconds, b.step_seconds))]
    write_csv(path, header, rows)


def plot_compare(path, results: list[RunResult], title: str) -> None:
    """Both loss curves, their per-step absolute difference, and the step times."""
    plt = _pyplot()
    a, b = results
    steps = np.arange(1, len(a.losses) + 1)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(steps, a.losses, label=a.framework)
    axes[0].plot(steps, b.losses, "--", label=b.framework)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[0].legend()
    diff = np.abs(np.asarray(a.losses) - np.asarray(b.losses))
    exact = diff == 0
    axes[1].semilogy(steps[~exact], diff[~exact], ".", color="tab:red", markersize=4)
    if exact.any():  # bitwise-equal losses have no place on a log axis: marked along the bottom
        axes[1].plot(steps[exact], np.full(exact.sum(), diff[~exact].min() if (~exact).any() else 1e-12),
                     "|", color="tab:gray", label="equal")
        axes[1].legend()
    axes[1].set_xlabel("step")
    axes[1].set_ylabel(f"|loss {a.framework} - loss {b.framework}|")
    axes[2].plot(steps, 1000 * np.asarray(a.step_seconds), label=a.framework, alpha=0.8)
    axes[2].plot(steps, 1000 * np.asarray(b.step_seconds), label=b.framework, alpha=0.8)
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("step time (ms)")
    axes[2].set_yscale("log")
    axes[2].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def check_output_folder(out_dir) -> Path:
    """Make sure ``out_dir`` is a folder this process can write into (created if missing).

    Raises ``ValueError`` naming the folder, so that a run can be refused before it trains rather
    than lose its results after.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: expected a folder, received a file: {out}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"out: cannot create the folder {out} ({error.strerror or error})") from None
    try:
        handle, probe = tempfile.mkstemp(prefix=".gdn2-write-check.", dir=out)
    except OSError as error:
        raise ValueError(f"out: cannot write into the folder {out} ({error.strerror or error})") from None
    os.close(handle)
    os.unlink(probe)
    return out


def save_run(out_dir, result: RunResult, trainer, train: TrainConfig, model_config: ModelConfig, title: str) -> dict:
    """Write loss.csv, loss.png and model.safetensors into ``out_dir``; return their paths.

    Each file is written atomically (a temporary file in the same folder, then ``os.replace``).
    """
    from .weights import save_numpy

    out = check_output_folder(out_dir)
    paths = {"csv": out / "loss.csv", "png": out / "loss.png", "weights": out / "model.safetensors"}
    write_training_csv(paths["csv"], result, train)
    plot_training(paths["png"], result, title)
    save_numpy(trainer.weights(), paths["weights"], model_config)
    return paths
