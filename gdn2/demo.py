"""``python -m gdn2 demo``: GDN-2 forward and backward in every installed framework, checked.

Runs each available path (reference, chunk, kernel) of PyTorch and MLX on the same random inputs,
compares outputs and every gradient with the float64 spec and across frameworks, and prints the
agreement and the time of each call.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .spec import INPUT_NAMES, random_inputs, reference_backward, reference_forward, relative_error

GRADS = INPUT_NAMES + ("initial_state",)


def _run_torch(inputs, d_o, d_final, path, chunk_size):
    import torch

    from .torch import chunk_gdn2, which_path

    device = "cuda" if torch.cuda.is_available() else "cpu"
    leaves = {n: torch.tensor(inputs[n], dtype=torch.float32, device=device, requires_grad=True) for n in GRADS}
    args = [leaves[n] for n in INPUT_NAMES]
    choice = which_path(*args, initial_state=leaves["initial_state"], chunk_size=chunk_size, path=path)
    start = time.perf_counter()
    o, final_state = chunk_gdn2(
        *args, initial_state=leaves["initial_state"], output_final_state=True, chunk_size=chunk_size, path=path
    )
    torch.autograd.backward(
        [o, final_state], [torch.tensor(d_o, dtype=torch.float32, device=device), torch.tensor(d_final, device=device, dtype=torch.float32)]
    )
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = dict(o=o, final_state=final_state, **{f"d{n}": leaves[n].grad for n in GRADS})
    return {n: x.detach().double().cpu().numpy() for n, x in result.items()}, seconds, choice


def _run_mlx(inputs, d_o, d_final, path, chunk_size):
    import mlx.core as mx

    from .mlx import chunk_gdn2, which_path

    arrays = [mx.array(inputs[n], dtype=mx.float32) for n in GRADS]
    choice = which_path(*arrays[:6], initial_state=arrays[6], chunk_size=chunk_size, path=path)
    d_o, d_final = mx.array(d_o, dtype=mx.float32), mx.array(d_final, dtype=mx.float32)

    def loss(*xs):
        o, final_state = chunk_gdn2(
            *xs[:6], initial_state=xs[6], output_final_state=True, chunk_size=chunk_size, path=path
        )
        return (o * d_o).sum() + (final_state * d_final).sum(), (o, final_state)

    start = time.perf_counter()
    (_, (o, final_state)), grads = mx.value_and_grad(loss, argnums=tuple(range(7)))(*arrays)
    mx.eval(o, final_state, grads)
    seconds = time.perf_counter() - start
    result = dict(o=o, final_state=final_state, **{f"d{n}": g for n, g in zip(GRADS, grads)})
    return {n: np.array(x).astype(np.float64) for n, x in result.items()}, seconds, choice


def _kernel_problem(framework: str, inputs, chunk_size: int) -> str | None:
    """Why the kernel path cannot run here (None: it can)."""
    if framework == "torch":
        import torch

        from .torch import which_path

        device = "cuda" if torch.cuda.is_available() else "cpu"
        arrays = [torch.tensor(inputs[n], dtype=torch.float32, device=device) for n in INPUT_NAMES]
    else:
        import mlx.core as mx

        from .mlx import which_path

        arrays = [mx.array(inputs[n], dtype=mx.float32) for n in INPUT_NAMES]
    choice = which_path(*arrays, chunk_size=chunk_size, path="kernel")
    return None if choice.path == "kernel" else choice.reason


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gdn2 demo", description=__doc__)
    parser.add_argument("--B", type=int, default=2)
    parser.add_argument("--T", type=int, default=200)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--K", type=int, default=32)
    parser.add_argument("--V", type=int, default=48)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh random seed")
    args = parser.parse_args(argv)

    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    print(f"GDN-2 demo: B={args.B} T={args.T} H={args.H} K={args.K} V={args.V} float32, seed {seed}")
    inputs = random_inputs(args.B, args.T, args.H, args.K, args.V, seed, log_decay_range=(-5.0, 0.0))
    rng = np.random.default_rng(seed + 1)
    d_o = rng.standard_normal((args.B, args.T, args.H, args.V))
    d_final = rng.standard_normal((args.B, args.H, args.K, args.V))
    start = time.perf_counter()
    o, final_state = reference_forward(**inputs)
    expected = dict(o=o, final_state=final_state)
    expected.update({f"d{n}": g for n, g in reference_backward(**inputs, d_o=d_o, d_final_state=d_final).items()})
    print(f"float64 spec (numpy): {time.perf_counter() - start:.2f} s")

    runners = {}
    for framework, runner in (("torch", _run_torch), ("mlx", _run_mlx)):
        try:
            __import__(framework)
            runners[framework] = runner
        except ImportError:
            print(f"{framework}: not installed, skipped (pip install 'gdn2[{framework}]')")
    results, worst = {}, 0.0
    print(f"\n{'framework':<9} {'path':<10} {'fwd+bwd s':>9}  {'worst rel. error vs spec':<30} path taken")
    for framework, runner in runners.items():
        for path in ("reference", "chunk", "kernel"):
            if path == "kernel":
                reason = _kernel_problem(framework, inputs, args.chunk_size)
                if reason is not None:
                    print(f"{framework:<9} {path:<10} {'':>9}  not run: {reason}")
                    continue
            result, seconds, choice = runner(inputs, d_o, d_final, path, args.chunk_size)
            errors = {n: relative_error(result[n], expected[n]) for n in expected}
            name = max(errors, key=errors.get)
            worst = max(worst, errors[name])
            results[(framework, choice.path)] = result
            print(f"{framework:<9} {path:<10} {seconds:>9.3f}  {errors[name]:.1e} ({name}){'':<17} {choice}")
    if "torch" in runners and "mlx" in runners:
        print()
        for path in ("reference", "chunk"):
            a, b = results.get(("torch", path)), results.get(("mlx", path))
            if a is not None and b is not None:
                diff = max(relative_error(b[n], a[n]) for n in a)
                print(f"torch vs mlx, {path} path: worst relative difference over outputs and gradients {diff:.1e}")
    ok = worst <= 1e-4
    print(f"\n{'OK' if ok else 'MISMATCH'}: every path within {worst:.1e} of the float64 spec")
    return 0 if ok else 1
