"""The GDN-2 layer against flash-linear-attention's, side by side in one run, and a language-model
training step with each.

    python bench/layer.py --device cuda                  # hidden 2048, 16 heads x 128, B=4 T=4096, bf16
    python bench/layer.py --device cpu --small           # tiny shapes: checks that everything runs
    python bench/layer.py --resources                    # glue kernels' sm_90a registers and spills, no GPU
    python bench/layer.py --device cuda --check          # fused glue = plain glue on the GPU, every gradient
    python bench/layer.py --saved                        # what the layer saves for its backward (CPU), by tensor
    python bench/layer.py --device cuda --skip-lm --profile   # with each layer row, its kernels' GPU times
    python bench/layer.py --device cuda --skip-lm --variants  # also the glue's launch-setting variants

Layer rows (the layer's parameters and input in ``--dtype``): ``fla`` (``fla.layers.gdn2.GatedDeltaNet2``,
when flash-linear-attention is installed; our layer loads its ``state_dict``), ``gdn2`` (the
fused Triton glue, ``use_kernels=True``) and ``gdn2-plain-glue`` (``use_kernels=False``). Each row:
forward (no autograd graph) and forward+backward median ms, peak memory during forward+backward
(CUDA), the difference of output and input gradient to the first row, and the same two times
with the operator replaced by a no-op of the same output shape (zero gradients): the glue, all
that is not the operator. fla's operator L2-normalises q and k inside itself; ours outside it.
A layer's times move between timings by more than the rows differ (fla's forward by up to 1.4 ms
from one process to the next), so every row is timed ``--rounds`` times, the rows in turn, and
reports the median of its rounds (each round's numbers are printed and kept in the JSON).

Language-model rows: ``GDN2LanguageModel`` (``--lm-layers`` blocks, hidden ``--lm-hidden``,
vocabulary ``--lm-vocab``), float32 weights, AdamW, bf16 autocast, B x T random tokens: a whole
training step (forward, loss, backward, optimizer) in ms and tokens per second, for our layer
and for the same model with fla's layer swapped into every block (same weights).

Writes the rows as JSON (``--json``, default ``bench/out/layer.json``; ``bench/out/`` is not
tracked). Without flash-linear-attention the fla rows are left out with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch
import torch.nn as nn

from gdn2.testing import cuda_kernel_times, median_ms
from gdn2.torch import layer as layer_module
from gdn2.torch.layer import GatedDeltaNet2, GDN2LanguageModel
from gdn2.weights import ModelConfig

OUT = Path(__file__).with_name("out")
FLA_ARGUMENTS = ("hidden_size", "expand_v", "head_dim", "num_heads", "num_v_heads", "use_short_conv",
                 "allow_neg_eigval", "conv_size", "conv_bias", "norm_eps")
FULL = dict(hidden=2048, heads=16, head_dim=128, B=4, T=4096,
            lm_layers=4, lm_hidden=1024, lm_heads=8, lm_vocab=32000, lm_B=8, lm_T=2048, repeats=20, warmup=3,
            rounds=3)
OPERATOR_INPUTS = ("float32", "projections")
# Launch-setting variants of the fused glue ("module.CONSTANT" of gdn2.torch.triton's conv, gates
# and norm), each timed on the layer rows' inputs and compared with the default settings
# (``--variants``): here the convolution's pre-activation launch at fewer warps.
GLUE_VARIANTS: list[dict] = [
    {"conv.BACKWARD_WARPS": 1},  # the pre-activation launch at one warp, as the other glue launches
    {"conv.BACKWARD_WARPS": 4},
]
SMALL = dict(hidden=64, heads=2, head_dim=32, B=2, T=40,
             lm_layers=2, lm_hidden=64, lm_heads=2, lm_vocab=128, lm_B=2, lm_T=40, repeats=2, warmup=1,
             rounds=2)


def fla_layer_class():
    """flash-linear-attention's ``GatedDeltaNet2`` class, or None with the reason it cannot be imported."""
    try:
        from fla.layers.gdn2 import GatedDeltaNet2 as FlaGatedDeltaNet2
    except ImportError as error:
        return None, f"flash-linear-attention is not installed or has no GDN-2 layer ({error}); pip install flash-linear-attention"
    return FlaGatedDeltaNet2, None


class FlaMixer(nn.Module):
    """fla's layer as a block's token mixer: the output alone (fla returns ``(o, None, cache)``)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x, cache=None):
        return self.layer(x)[0]


class NoOpOperator(torch.autograd.Function):
    """The operator's output shape (zeros) and zero gradients for q, k, v, g, b, w: what is left
    of a layer with it is the glue."""

    @staticmethod
    def forward(ctx, q, k, v, g, b, w):
        ctx.shapes = [(x.shape, x.dtype) for x in (q, k, v, g, b, w)]
        return torch.zeros(v.shape, dtype=q.dtype, device=v.device)

    @staticmethod
    def backward(ctx, d_o):
        return tuple(torch.zeros(shape, dtype=dtype, device=d_o.device) for shape, dtype in ctx.shapes)


def noop_operator(*arguments, **options):
    """Stands in for ``chunk_gdn2`` of either layer (ours passes q ... w by position, fla by name)."""
    names = ("q", "k", "v", "g", "b", "w")
    tensors = [options[name] if name in options else arguments[i] for i, name in enumerate(names)]
    return NoOpOperator.apply(*tensors), None


class operator_replaced:
    """Within the block, both layers call ``noop_operator`` in place of their operator."""

    def __init__(self, fla_available: bool):
        self.targets = [(layer_module, "chunk_gdn2")]
        if fla_available:
            import fla.layers.gdn2 as fla_module

            self.targets.append((fla_module, "chunk_gdn2"))

    def __enter__(self):
        self.saved = [getattr(module, name) for module, name in self.targets]
        for module, name in self.targets:
            setattr(module, name, noop_operator)

    def __exit__(self, *exc):
        for (module, name), original in zip(self.targets, self.saved):
            setattr(module, name, original)


def output_of(layer, x):
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


def relative_difference(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


class Device:
    def __init__(self, name: str):
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self):
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None


def time_layer(layer, x, d_out, device: Device, repeats: int, warmup: int) -> dict:
    """Forward (no graph) and forward+backward median ms; peak memory of forward+backward."""
    def forward():
        with torch.no_grad():
            output_of(layer, x)

    def forward_backward():
        x.grad = None
        output_of(layer, x).backward(d_out)

    row = {"forward_ms": median_ms(forward, repeats, warmup, device.sync)}
    device.reset_peak()
    row["forward_backward_ms"] = median_ms(forward_backward, repeats, warmup, device.sync)
    row["peak_gib"] = device.peak_gib()
    return row


def profile_layer(layer, x, d_out) -> list[dict]:
    """GPU time per kernel of one forward+backward (``torch.profiler``)."""
    def forward_backward():
        x.grad = None
        output_of(layer, x).backward(d_out)

    return cuda_kernel_times(forward_backward)


def bench_layers(args, device: Device, fla_class) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    config = dict(hidden_size=args.hidden, head_dim=args.head_dim, num_heads=args.heads, expand_v=1.0,
                  use_short_conv=True, allow_neg_eigval=False, conv_size=4, conv_bias=False, norm_eps=1e-5)
    torch.manual_seed(args.seed)
    layers = {}
    if fla_class is not None:
        layers["fla"] = fla_class(**config).to(device.device, dtype)
    ours = GatedDeltaNet2(**config).to(device.device, dtype)
    if "fla" in layers:
        ours.load_state_dict(layers["fla"].state_dict(), strict=True)
    plain = GatedDeltaNet2(**config).to(device.device, dtype)
    plain.load_state_dict(ours.state_dict(), strict=True)
    ours.use_kernels, plain.use_kernels = True, False
    layers["gdn2"], layers["gdn2-plain-glue"] = ours, plain

    generator = torch.Generator(device=device.device).manual_seed(args.seed)
    x = torch.randn(args.B, args.T, args.hidden, generator=generator, device=device.device, dtype=dtype).requires_grad_(True)
    d_out = torch.randn(x.shape, generator=generator, device=device.device, dtype=dtype)
    rows, first, timed = [], None, []
    for name, layer, setting in gdn2_rows(layers.items(), args.operator_inputs):
        layer_module.OPERATOR_INPUT_DTYPE = setting
        row = {"what": "layer", "name": name, "operator_inputs": setting}
        if name.startswith("gdn2") and layer.use_kernels:
            choice = layer.which_glue(x)
            row["glue"] = str(choice)
            if choice.path != "kernels":
                row["skipped"] = f"fused glue kernels cannot run: {choice.reason}"
                rows.append(row)
                print(f"  {name}: skipped ({row['skipped']})", flush=True)
                continue
        x.grad = None
        out = output_of(layer, x)
        out.backward(d_out)
        if first is None:
            first = (name, out.detach(), x.grad.detach().clone())
        else:
            row[f"output_difference_to_{first[0]}"] = relative_difference(out, first[1])
            row[f"input_grad_difference_to_{first[0]}"] = relative_difference(x.grad, first[2])
        del out
        row.update(time_layer(layer, x, d_out, device, args.repeats, args.warmup))
        row["forward_ms_rounds"], row["forward_backward_ms_rounds"] = [row["forward_ms"]], [row["forward_backward_ms"]]
        with operator_replaced("fla" in layers):
            glue = time_layer(layer, x, d_out, device, args.repeats, args.warmup)
        row["glue_forward_ms"], row["glue_forward_backward_ms"] = glue["forward_ms"], glue["forward_backward_ms"]
        rows.append(row)
        timed.append((row, layer, setting))
        print("  " + layer_line(row), flush=True)
        if args.profile and device.cuda:
            row["profile"] = profile_layer(layer, x, d_out)
            for entry in row["profile"]:
                print(f"      {entry['ms']:8.4f} ms  {entry['calls']:3d} x  {entry['kernel']}", flush=True)
    time_rounds(timed, x, d_out, device, args)
    if args.variants:
        rows += glue_variants(args, layers["gdn2"], x, d_out, device)
    return rows


def time_rounds(timed, x, d_out, device: Device, args) -> None:
    """Time every layer row again, ``args.rounds - 1`` more times in turn (a layer's times move
    between rounds by more than the rows differ), and make each row's forward and forward+backward
    the median over its rounds (each round's in ``*_rounds``)."""
    for _ in range(1, args.rounds):
        for row, layer, setting in timed:
            layer_module.OPERATOR_INPUT_DTYPE = setting
            again = time_layer(layer, x, d_out, device, args.repeats, args.warmup)
            row["forward_ms_rounds"].append(again["forward_ms"])
            row["forward_backward_ms_rounds"].append(again["forward_backward_ms"])
    if args.rounds > 1:
        print(f"  median of {args.rounds} rounds, each row timed in turn (each round's ms):", flush=True)
    for row, _, _ in timed:
        row["forward_ms"] = statistics.median(row["forward_ms_rounds"])
        row["forward_backward_ms"] = statistics.median(row["forward_backward_ms_rounds"])
        if args.rounds > 1:
            rounds = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(row["forward_ms_rounds"], row["forward_backward_ms_rounds"]))
            print(f"  {row['name']:30s} fwd {row['forward_ms']:8.2f} ms  fwd+bwd {row['forward_backward_ms']:8.2f} ms"
                  f"  (rounds fwd/fwd+bwd: {rounds})", flush=True)


def set_glue_constants(settings: dict) -> dict:
    """Set launch constants (``"conv.NAME"``, ``"gates.NAME"``, ``"norm.NAME"``) of the glue
    kernels' modules; returns the old values."""
    from gdn2.torch.triton import conv, gates, norm

    modules = {"conv": conv, "gates": gates, "norm": norm}
    previous = {}
    for key, value in settings.items():
        module_name, _, name = key.partition(".")
        module = modules[module_name]
        if not hasattr(module, name):
            raise ValueError(f"GLUE_VARIANTS: {module_name} has no launch constant {name!r}")
        previous[key] = getattr(module, name)
        setattr(module, name, value)
    return previous


def glue_variants(args, layer, x, d_out, device: Device) -> list[dict]:
    """The fused layer under each of ``GLUE_VARIANTS``: times, and output and input gradient
    against the default settings' (the first operator-input setting)."""
    layer_module.OPERATOR_INPUT_DTYPE = args.operator_inputs[0]

    def outputs():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        out = output_of(layer, x)
        out.backward(d_out)
        return out.detach(), x.grad.detach().clone(), {n: p.grad.detach().clone() for n, p in layer.named_parameters()}

    default = outputs()
    rows = []
    for variant in GLUE_VARIANTS:
        previous = set_glue_constants(variant)
        row = {"what": "layer variant", "name": f"gdn2 {variant}", "variant": variant}
        try:
            out, dx, grads = outputs()
            row["output_difference_to_default"] = relative_difference(out, default[0])
            row["input_grad_difference_to_default"] = relative_difference(dx, default[1])
            worst = max(grads, key=lambda n: relative_difference(grads[n], default[2][n]))
            row["worst_parameter_grad_difference_to_default"] = (worst, relative_difference(grads[worst], default[2][worst]))
            row.update(time_layer(layer, x, d_out, device, args.repeats, args.warmup))
            with operator_replaced(False):
                glue = time_layer(layer, x, d_out, device, args.repeats, args.warmup)
            row["glue_forward_ms"], row["glue_forward_backward_ms"] = glue["forward_ms"], glue["forward_backward_ms"]
            print("  " + layer_line(row), flush=True)
        except Exception as error:  # report, keep going
            row["error"] = f"{type(error).__name__}: {error}"[:300]
            print(f"  {row['name']}: {row['error']}", flush=True)
        finally:
            set_glue_constants(previous)
        rows.append(row)
    return rows


def gdn2_rows(items, settings: list[str]):
    """``(name, thing, operator-input setting)`` for each row: the gdn2 rows once per setting (named
    with it when there are several), the others once (their setting is unused)."""
    for name, thing in items:
        if not name.startswith("gdn2") or len(settings) == 1:
            yield name, thing, settings[0]
        else:
            for setting in settings:
                yield f"{name} [{setting}]", thing, setting


def layer_line(row: dict) -> str:
    text = (f"{row['name']:30s} fwd {row['forward_ms']:8.2f} ms  fwd+bwd {row['forward_backward_ms']:8.2f} ms  "
            f"glue fwd {row['glue_forward_ms']:7.2f} / fwd+bwd {row['glue_forward_backward_ms']:7.2f} ms")
    if row.get("peak_gib") is not None:
        text += f"  peak {row['peak_gib']:.2f} GiB"
    for key, value in row.items():
        if key.startswith("output_difference_to_"):
            text += f"  out diff {value:.2e}"
        if key.startswith("input_grad_difference_to_"):
            text += f"  dx diff {value:.2e}"
        if key.startswith("worst_parameter_grad_difference_to_"):
            text += f"  worst parameter grad diff {value[1]:.2e} ({value[0]})"
    return text


def language_model(args, device: Device, fla_class, kind: str) -> nn.Module:
    config = ModelConfig(vocab_size=args.lm_vocab, hidden_size=args.lm_hidden, num_layers=args.lm_layers,
                         num_heads=args.lm_heads, head_dim=args.head_dim)
    torch.manual_seed(args.seed)
    model = GDN2LanguageModel(config)
    for i, block in enumerate(model.layers):
        if kind == "fla":
            swapped = fla_class(**{key: config.mixer_kwargs()[key] for key in FLA_ARGUMENTS}, layer_idx=i)
            swapped.load_state_dict(block.attn.state_dict(), strict=True)
            block.attn = FlaMixer(swapped)
        else:
            block.attn.use_kernels = kind == "gdn2"
    return model.to(device.device)


def bench_language_models(args, device: Device, fla_class) -> list[dict]:
    kinds = (["fla"] if fla_class is not None else []) + ["gdn2", "gdn2-plain-glue"]
    generator = torch.Generator(device=device.device).manual_seed(args.seed)
    tokens = torch.randint(0, args.lm_vocab, (args.lm_B, args.lm_T + 1), generator=generator, device=device.device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    rows = []
    for name, kind, setting in gdn2_rows(((kind, kind) for kind in kinds), args.operator_inputs):
        layer_module.OPERATOR_INPUT_DTYPE = setting
        row = {"what": "language model step", "name": name, "operator_inputs": setting, "B": args.lm_B, "T": args.lm_T}
        model = language_model(args, device, fla_class, kind)
        if kind == "gdn2":
            choice = model.layers[0].attn.which_glue(torch.empty(1, 1, args.lm_hidden, device=device.device))
            if choice.path != "kernels":
                row["skipped"] = f"fused glue kernels cannot run: {choice.reason}"
                rows.append(row)
                print(f"  {name}: skipped ({row['skipped']})", flush=True)
                continue
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.cuda)
        forward = torch.compile(model) if args.compile else model

        def step():
            with torch.autocast(device.device.type, dtype=torch.bfloat16):
                logits = forward(inputs)
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        device.reset_peak()
        row["step_ms"] = median_ms(step, args.repeats, args.warmup, device.sync)
        row["peak_gib"] = device.peak_gib()
        row["tokens_per_second"] = args.lm_B * args.lm_T / (row["step_ms"] / 1e3)
        rows.append(row)
        peak = f"  peak {row['peak_gib']:.2f} GiB" if row["peak_gib"] is not None else ""
        print(f"  {name:30s} step {row['step_ms']:8.2f} ms  {row['tokens_per_second']:12,.0f} tokens/s{peak}", flush=True)
        model = optimizer = forward = None  # this row's model freed before the next one is built
    return rows


def _outputs(layer, use_kernels: bool, x, d_out, options) -> list:
    """Output and the gradients of x and of every parameter."""
    layer.use_kernels = use_kernels
    leaf = x.clone().requires_grad_(True)
    out = layer(leaf, **options)
    return [out] + list(torch.autograd.grad(out, [leaf] + list(layer.parameters()), d_out))


def check_glue(args, device: Device) -> list[dict]:
    """The layer with the fused glue against the plain glue on ``device``: output and every
    gradient, with padding, packed sequences, grouped value heads and decoding from a cache.

    float32: the two agree within 1e-4. bfloat16: both against the plain layer in float32 (same
    weights and inputs), the fused glue at most twice the plain glue's error plus 2e-2 (the plain
    glue rounds its convolution to bf16, the fused one does not; gradients summed over many
    tokens, as A_log's, carry errors of a few percent in both, more on a few tokens). Prints each
    case's worst; returns the rows ({dtype, mixer, case, worst, error, margin}: margin > 1 fails)."""
    # Exact float32 products on a GPU: the operator's (GDN2_TRITON_DOT=ieee) and cuDNN's convolution
    # in the plain glue (TF32 by default): TF32 rounding would hide the glue's own differences.
    previous = os.environ.get("GDN2_TRITON_DOT"), torch.backends.cudnn.allow_tf32
    os.environ["GDN2_TRITON_DOT"] = "ieee"
    torch.backends.cudnn.allow_tf32 = False
    try:
        return _check_glue(args, device)
    finally:
        if previous[0] is None:
            os.environ.pop("GDN2_TRITON_DOT", None)
        else:
            os.environ["GDN2_TRITON_DOT"] = previous[0]
        torch.backends.cudnn.allow_tf32 = previous[1]


def _check_glue(args, device: Device) -> list[dict]:
    hidden, heads, head_dim = args.hidden // 4, max(1, args.heads // 4), args.head_dim
    mixers = {"plain": dict(hidden_size=hidden, head_dim=head_dim, num_heads=heads),
              "grouped": dict(hidden_size=hidden, head_dim=head_dim // 2, num_heads=heads, num_v_heads=2 * heads,
                              conv_bias=True, allow_neg_eigval=True)}
    T = 2 * args.T // 3 + 1  # not a multiple of any block
    rows = []
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        for mixer, config in mixers.items():
            torch.manual_seed(args.seed)
            exact = GatedDeltaNet2(**config).to(device.device)
            with torch.no_grad():
                for name, p in exact.named_parameters():
                    if name.endswith(("o_norm.weight", ".bias")):  # away from their initial values
                        p.uniform_(0.5, 1.5)
            layer = GatedDeltaNet2(**config).to(device.device, dtype)
            layer.load_state_dict(exact.state_dict())
            names = ["output", "x"] + [name for name, _ in layer.named_parameters()]
            for case in ("dense", "padding", "packed"):
                B = 1 if case == "packed" else 2
                x = torch.randn(B, T, hidden, device=device.device, dtype=dtype)
                d_out = torch.randn(B, T, hidden, device=device.device, dtype=dtype)
                options = {}
                if case == "padding":
                    mask = torch.ones(B, T, dtype=torch.int64, device=device.device)
                    mask[0, : T // 5] = 0
                    mask[1, T - T // 3 :] = 0
                    options["attention_mask"] = mask
                if case == "packed":
                    options["cu_seqlens"] = torch.tensor([0, 1, T // 3, T], device=device.device)
                fused, plain = (_outputs(layer, flag, x, d_out, options) for flag in (True, False))
                if dtype == torch.float32:
                    errors = {n: relative_difference(a, b) for n, a, b in zip(names, fused, plain)}
                    margins = {n: e / 1e-4 for n, e in errors.items()}
                else:
                    reference = _outputs(exact, False, x.float(), d_out.float(), options)
                    errors = {n: relative_difference(a, r) for n, a, r in zip(names, fused, reference)}
                    allowed = {n: 2 * relative_difference(b, r) + 2e-2 for n, b, r in zip(names, plain, reference)}
                    margins = {n: errors[n] / allowed[n] for n in names}
                worst = max(margins, key=margins.get)
                rows.append(dict(dtype=dtype_name, mixer=mixer, case=case, worst=worst, error=errors[worst],
                                 output_error=errors["output"], margin=margins[worst]))
                print(f"  {dtype_name:9s} {mixer:8s} {case:8s} output {errors['output']:.1e}, worst {worst} "
                      f"{errors[worst]:.1e} ({100 * margins[worst]:.0f}% of the tolerance)", flush=True)
            with torch.no_grad():
                x = torch.randn(2, 9, hidden, device=device.device, dtype=dtype)
                outs = {}
                for use_kernels in (False, True):
                    layer.use_kernels = use_kernels
                    cache = layer_module.GDN2Cache()
                    pieces = [layer(x[:, :5], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(5, 9)]
                    outs[use_kernels] = torch.cat(pieces, 1)
                error = relative_difference(outs[True], outs[False])
                tolerance = 1e-4 if dtype == torch.float32 else 3e-2
                rows.append(dict(dtype=dtype_name, mixer=mixer, case="decode", worst="output", error=error,
                                 output_error=error, margin=error / tolerance))
                print(f"  {dtype_name:9s} {mixer:8s} decode   output {error:.1e} ({100 * error / tolerance:.0f}% of the "
                      "tolerance)", flush=True)
    return rows


def saved_tensors(args) -> list[dict]:
    """Every tensor the layer keeps for its backward (``torch.autograd.graph.saved_tensors_hooks``),
    counted once per storage (the channel slices of the projections' output are one tensor), the
    parameters and the input left out. Runs on the CPU (the fused glue under the Triton
    interpreter) at the hidden size and heads of the bench with ``--saved-tokens`` tokens in one
    row and scales each tensor that grows with the tokens to the bench's B x T. Rows: the fused
    and the plain glue, each with the operator replaced by a no-op (the glue alone) and with the
    operator (its kernel path; the buffers it keeps are its own and are counted apart)."""
    import traceback

    os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = getattr(torch, args.dtype)
    T = args.saved_tokens
    scale = args.B * args.T / T
    config = dict(hidden_size=args.hidden, head_dim=args.head_dim, num_heads=args.heads)
    rows = []
    for glue, use_kernels in (("fused", True), ("plain", False)):
        for operator in ("no-op", "kernel"):
            torch.manual_seed(args.seed)
            layer = GatedDeltaNet2(**config, use_kernels=use_kernels, path="kernel").to(dtype)
            x = torch.randn(1, T, args.hidden, dtype=dtype, requires_grad=True)
            leaves = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
            seen = {}

            def pack(t):
                key = t.untyped_storage().data_ptr()
                if key not in seen and key not in leaves:
                    frames = [f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()[:-1]
                              if "gdn2" in f.filename or "bench" in f.filename]
                    per_token = any(n in (T, T + layer.conv_size - 1) for n in t.shape)
                    seen[key] = dict(shape=list(t.shape), dtype=str(t.dtype).rsplit(".", 1)[-1], per_token=per_token,
                                     mib=t.untyped_storage().nbytes() * (scale if per_token else 1) / 2**20,
                                     where=" < ".join(reversed(frames[-3:])))
                return t

            replaced = operator_replaced(False) if operator == "no-op" else None
            if replaced:
                replaced.__enter__()
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    layer(x)
            finally:
                if replaced:
                    replaced.__exit__(None, None, None)
            tensors = list(seen.values())
            rows.append(dict(glue=glue, operator=operator, tensors=tensors, total_mib=sum(t["mib"] for t in tensors)))
            print(f"{glue} glue, operator {operator}: tensors saved for the backward at B*T = {args.B * args.T}, "
                  f"hidden {args.hidden} ({T} tokens measured, scaled)", flush=True)
            for t in tensors:
                print(f"  {str(t['shape']):24s} {t['dtype']:9s} {t['mib']:8.1f} MiB  {t['where']}", flush=True)
            print(f"  total {rows[-1]['total_mib']:.1f} MiB", flush=True)
    return rows


def glue_kernels(hidden: int, head_dim: int, inp: str) -> dict:
    """Each glue kernel with the pointer dtypes and constants its launcher uses in the layer
    (``inp``: the projections' dtype; training: no bias, no state, no padding, no packing)."""
    from gdn2.torch.triton import conv, gates, norm

    f32, i32, none = "fp32", "i32", dict(HAS_BIAS=False, HAS_STATE=False, HAS_POSITIONS=False, HAS_MASK=False)
    every = dict(HAS_BIAS=True, HAS_STATE=True, HAS_POSITIONS=True, HAS_MASK=True)
    conv_pointers = dict(x=inp, weight=f32, bias=f32, state=inp, positions=i32, mask="u8")
    backward_pointers = dict(conv_pointers, dy=f32, d_pre=f32)
    input_grad_pointers = dict(d_pre=f32, weight=f32, positions=i32, mask="u8", x=inp, state=inp, dx=inp, d_state=inp,
                               d_weight_parts=f32, d_bias_parts=f32)
    out = {}
    for label, channels, normalize in (("q/k", head_dim, True), ("v", conv.CHANNEL_BLOCK, False)):
        shape = dict(W=4, CH=channels, BT=conv.step_block(channels), BD=channels, NORMALIZE=normalize)
        out[f"conv forward {label}"] = (conv._conv_forward_kernel, dict(conv_pointers, y=f32), dict(eps=f32),
                                        dict(shape, **none), conv.FORWARD_WARPS)
        for flags, name in ((none, ""), (every, " +all options")):
            out[f"conv backward {label}{name}"] = (
                conv._conv_backward_kernel, backward_pointers, dict(eps=f32),
                dict(shape, BT=conv.step_block(channels, conv.BACKWARD_TILE_ELEMENTS), **flags),
                conv.BACKWARD_WARPS)
            out[f"conv input grad {label}{name}"] = (
                conv._conv_input_grad_kernel, input_grad_pointers, {},
                dict(W=4, CH=channels, BT=conv.step_block(channels, conv.INPUT_GRAD_TILE_ELEMENTS), BD=channels,
                     BS=4, **flags),
                conv.INPUT_GRAD_WARPS)
    rows, block = norm._row_block(head_dim)
    out["l2 forward"] = (norm._l2_forward_kernel, dict(x=inp, y=f32), dict(eps=f32),
                         dict(K=head_dim, BR=rows, BK=block, SILU=True), norm.WARPS)
    out["l2 backward"] = (norm._l2_backward_kernel, dict(x=inp, dy=f32, dx=inp), dict(eps=f32),
                          dict(K=head_dim, BR=rows, BK=block, SILU=True), norm.WARPS)
    out["gated rms forward"] = (norm._gated_rms_forward_kernel, dict(x=f32, gate=inp, weight=f32, y=inp), dict(eps=f32),
                                dict(V=head_dim, BR=rows, BV=block), norm.WARPS)
    out["gated rms backward"] = (norm._gated_rms_backward_kernel,
                                 dict(x=f32, gate=inp, weight=f32, dy=inp, dx=f32, d_gate=inp, d_weight_parts=f32),
                                 dict(eps=f32), dict(V=head_dim, BR=rows, BV=block), norm.WARPS)
    channels = min(gates.CHANNEL_BLOCK, 1 << (hidden - 1).bit_length())
    out["decay forward"] = (gates._decay_forward_kernel, dict(f=inp, A_log=f32, dt_bias=f32, g=f32), {},
                            dict(BR=gates.ROW_BLOCK, BD=channels), gates.WARPS)
    out["decay backward"] = (gates._decay_backward_kernel,
                             dict(f=inp, A_log=f32, dt_bias=f32, dg=f32, df=inp, d_shift_parts=f32, d_rate_parts=f32),
                             {}, dict(BR=gates.ROW_BLOCK, BD=channels), gates.WARPS)
    _, sigmoid_rows, sigmoid_channels = gates._sigmoid_grid(1, hidden)
    sigmoid_blocks = dict(BR=sigmoid_rows, BD=sigmoid_channels)
    out["sigmoid forward"] = (gates._sigmoid_forward_kernel, dict(x=inp, y=f32), dict(scale=f32),
                              sigmoid_blocks, gates.WARPS)
    out["sigmoid backward"] = (gates._sigmoid_backward_kernel, dict(x=inp, dy=f32, dx=inp), dict(scale=f32),
                               sigmoid_blocks, gates.WARPS)
    return out


def print_resources(args) -> None:
    """Registers, spills and shared memory of every glue kernel for sm_90a (no GPU needed)."""
    import os
    import sys

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("TRITON_INTERPRET is set: unset it to compile")
    sys.path.insert(0, str(Path(__file__).parent))
    from kernel_resources import compile_kernel, summary

    inp = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    for name, (kernel, pointers, scalars, constants, warps) in glue_kernels(args.hidden, args.head_dim, inp).items():
        try:
            shared, report = compile_kernel(kernel, pointers, scalars, constants, warps)
            print(f"{name:28s} {warps} warps, shared {shared / 1024:.1f} KiB, {summary(report)}", flush=True)
        except Exception as error:  # report every kernel, keep going
            print(f"{name:28s} failed: {type(error).__name__}: {str(error)[:400]}", flush=True)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="bench/layer.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda or cpu (default cuda when available)")
    parser.add_argument("--small", action="store_true", help="tiny shapes and 2 repeats: a check that everything runs")
    for name, value in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default {value} ({SMALL[name]} with --small)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the layer rows' parameters and input (the language model: float32 weights, bf16 autocast)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the language models")
    parser.add_argument("--skip-layer", action="store_true", help="language-model rows only")
    parser.add_argument("--skip-lm", action="store_true", help="layer rows only")
    parser.add_argument("--variants", action="store_true",
                        help="after the layer rows, the fused layer under each of GLUE_VARIANTS (launch settings)")
    parser.add_argument("--profile", action="store_true",
                        help="with each layer row, GPU time per kernel of one forward+backward (CUDA only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=OUT / "layer.json")
    parser.add_argument("--check", action="store_true",
                        help="compare the fused glue with the plain glue on the device (every gradient); no timing")
    parser.add_argument("--saved", action="store_true",
                        help="list the tensors the layer saves for its backward (CPU, Triton interpreter), scaled to B x T")
    parser.add_argument("--saved-tokens", type=int, default=64, help="tokens measured with --saved (default 64)")
    parser.add_argument("--resources", action="store_true",
                        help="compile the glue kernels for sm_90a and print registers, spills, shared memory; no timing")
    parser.add_argument("--operator-inputs", default=None,
                        help="the dtype of q, k, v, b, w handed to the operator (gdn2.torch.layer.OPERATOR_INPUT_DTYPE: "
                             f"float32 or projections; default {layer_module.OPERATOR_INPUT_DTYPE}); a comma list "
                             "times the gdn2 rows once per setting, in one run")
    args = parser.parse_args(argv)
    settings = [layer_module.OPERATOR_INPUT_DTYPE] if args.operator_inputs is None else args.operator_inputs.split(",")
    for setting in settings:
        if setting not in OPERATOR_INPUTS:
            parser.error(f"--operator-inputs: expected a comma list of {', '.join(OPERATOR_INPUTS)}, received {setting!r}")
    args.operator_inputs = settings
    layer_module.OPERATOR_INPUT_DTYPE = settings[0]  # --check and --saved use the first
    sizes = SMALL if args.small else FULL
    for name, value in sizes.items():
        least = 0 if name == "warmup" else 1
        if getattr(args, name) is None:
            setattr(args, name, value)
        elif getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')}: expected an integer >= {least}, received {getattr(args, name)}")
    if args.resources:
        print_resources(args)
        return []
    if args.saved:
        return saved_tensors(args)
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device: {name} requested but this torch has no usable CUDA device")
    device = Device(name)
    if args.check:
        print(f"fused glue against plain glue on {name} (relative differences):", flush=True)
        rows = check_glue(args, device)
        failed = [f"{r['dtype']} {r['mixer']} {r['case']} ({r['worst']})" for r in rows if not r["margin"] <= 1]
        if failed:
            raise SystemExit(f"bench/layer.py --check: over the tolerance: {', '.join(failed)}")
        print("every case within its tolerance")
        return rows

    fla_class, fla_problem = fla_layer_class()
    if fla_problem is not None:
        print(f"note: {fla_problem}: timing gdn2 only", flush=True)
    meta = dict(device=torch.cuda.get_device_name(device.device) if device.cuda else platform.processor() or "cpu",
                torch=torch.__version__, fla=None if fla_problem else _fla_version(), dtype=args.dtype,
                sizes={key: getattr(args, key) for key in FULL}, compile=args.compile,
                operator_inputs=args.operator_inputs)
    rows = []
    if not args.skip_layer:
        print(f"layer: hidden {args.hidden}, {args.heads} heads x {args.head_dim}, B={args.B} T={args.T}, {args.dtype}, "
              f"median of {args.repeats} after {args.warmup} warm-up, operator inputs {', '.join(args.operator_inputs)}", flush=True)
        rows += bench_layers(args, device, fla_class)
    if not args.skip_lm:
        print(f"language model: {args.lm_layers} layers, hidden {args.lm_hidden}, {args.lm_heads} heads x {args.head_dim}, "
              f"vocabulary {args.lm_vocab}, B={args.lm_B} T={args.lm_T}, AdamW, bf16 autocast"
              f"{', torch.compile' if args.compile else ''}", flush=True)
        rows += bench_language_models(args, device, fla_class)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.json}")
    return rows


def _fla_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("flash-linear-attention")
    except Exception:  # the version is a label only
        return None


if __name__ == "__main__":
    main()
