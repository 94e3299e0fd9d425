"""Time GDN-2 forward and forward+backward on every available path of every installed framework.

    python bench/ops.py --B 1 --T 2048 --H 4 --K 64 --V 64 --dtype float32
    python bench/ops.py --framework mlx            # every MLX path on this machine (a Mac: Metal)
    python bench/ops.py --framework mlx --paths kernel --B 8 --T 4096 --H 16 --K 128 --V 128 \
        --dtype bfloat16 --metal-kernel chunked     # one Metal kernel family (scan, chunked, auto)

Prints a table (median ms, tokens/s, peak memory where the framework reports it) and writes the
rows as JSON (``--json``, default ``bench/out/ops.json``; ``bench/out/`` is not tracked). Each path is timed on the device the
framework uses by default here (torch: CUDA when available; MLX: its default device). A path that
cannot run is listed with the reason, not timed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from gdn2.spec import INPUT_NAMES, PATHS, random_inputs
from gdn2.testing import median_ms
from gdn2.train import device_name

OUT = Path(__file__).with_name("out")


def bench_torch(inputs, args, path):
    import torch

    from gdn2.torch import chunk_gdn2, which_path

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    tensors = [torch.tensor(inputs[n], dtype=dtype, device=device) for n in INPUT_NAMES]
    state = torch.tensor(inputs["initial_state"], dtype=torch.float32, device=device)
    choice = which_path(*tensors, initial_state=state, chunk_size=args.chunk_size, path=path)
    if choice.path != path:
        return dict(skipped=choice.reason)
    d_o = torch.randn(tensors[2].shape, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def forward():
        with torch.no_grad():
            chunk_gdn2(*tensors, initial_state=state, output_final_state=True, chunk_size=args.chunk_size, path=path)

    leaves = [t.clone().requires_grad_(True) for t in tensors] + [state.clone().requires_grad_(True)]

    def forward_backward():
        o, final_state = chunk_gdn2(
            *leaves[:6], initial_state=leaves[6], output_final_state=True, chunk_size=args.chunk_size, path=path
        )
        torch.autograd.backward([o, final_state], [d_o, torch.ones_like(final_state)])
        for leaf in leaves:
            leaf.grad = None

    row = dict(device=device, reason=choice.reason)
    for name, run in (("forward", forward), ("forward_backward", forward_backward)):
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        row[f"{name}_ms"] = median_ms(run, args.repeats, args.warmup, sync)
        if device.startswith("cuda"):
            row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def bench_mlx(inputs, args, path):
    import mlx.core as mx

    from gdn2.mlx import chunk_gdn2, which_path

    if args.device:
        mx.set_default_device(getattr(mx, args.device))
    dtype = getattr(mx, args.dtype)
    arrays = [mx.array(inputs[n], dtype=mx.float32).astype(dtype) for n in INPUT_NAMES]
    state = mx.array(inputs["initial_state"], dtype=mx.float32)
    choice = which_path(*arrays, initial_state=state, chunk_size=args.chunk_size, path=path)
    if choice.path != path:
        return dict(skipped=choice.reason)
    d_o = mx.random.normal(arrays[2].shape).astype(dtype)
    mx.eval(arrays, state, d_o)

    def forward():
        mx.eval(chunk_gdn2(*arrays, initial_state=state, output_final_state=True, chunk_size=args.chunk_size, path=path))

    def loss(*xs):
        o, final_state = chunk_gdn2(
            *xs[:6], initial_state=xs[6], output_final_state=True, chunk_size=args.chunk_size, path=path
        )
        return (o * d_o).sum() + final_state.sum()

    grad = mx.grad(loss, argnums=tuple(range(7)))

    def forward_backward():
        mx.eval(grad(*arrays, state))

    row = dict(device=device_name(mx.default_device()), reason=choice.reason)
    if path == "kernel":
        row.update(metal_counted(args, dtype))
    for name, run in (("forward", forward), ("forward_backward", forward_backward)):
        mx.reset_peak_memory()
        row[f"{name}_ms"] = median_ms(run, args.repeats, args.warmup)
        row[f"{name}_peak_gib"] = mx.get_peak_memory() / 2**30
    return row


def metal_counted(args, dtype) -> dict:
    """The Metal kernels this shape runs (``GDN2_METAL_KERNEL`` forces them) with their counted,
    ESTIMATED times on an M3 Max and the backward's transient buffers (``gdn2.mlx.metal.dispatch``,
    the functions the tests check), to set beside the measurement."""
    from gdn2.mlx.metal import dispatch

    plan = dispatch.plan(args.B, args.T, args.H, args.K, args.V, dtype)
    counts = dispatch.counted(args.B, args.T, args.H, args.K, args.V, dtype)
    forward, backward = counts[plan.forward], counts[plan.backward]
    return dict(
        metal_forward=plan.forward,
        metal_backward=plan.backward,
        estimated_forward_ms=forward["forward_seconds"] * 1e3,
        estimated_forward_backward_ms=(forward["forward_seconds"] + backward["backward_seconds"]) * 1e3,
        counted_backward_buffers_gib=backward["backward_bytes"] / 2**30,
    )


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("B", 1), ("T", 2048), ("H", 4), ("K", 64), ("V", 64)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--framework", choices=["torch", "mlx", "all"], default="all")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of reference,chunk,kernel")
    parser.add_argument("--device", default=None, help="torch: cpu/cuda; mlx: cpu/gpu (default: the framework's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", default=str(OUT / "ops.json"))
    parser.add_argument("--metal-kernel", choices=["auto", "scan", "chunked"], default="auto",
                        help="MLX kernel path: let the counted cost choose, or force the scan or the chunked kernels")
    args = parser.parse_args(argv)
    if args.metal_kernel != "auto":
        os.environ["GDN2_METAL_KERNEL"] = args.metal_kernel

    inputs = random_inputs(args.B, args.T, args.H, args.K, args.V, seed=0)
    frameworks = ["torch", "mlx"] if args.framework == "all" else [args.framework]
    tokens = args.B * args.T
    rows = []
    for framework in frameworks:
        try:
            __import__(framework)
        except ImportError:
            print(f"{framework}: not installed, skipped")
            continue
        for path in args.paths.split(","):
            print(f"timing {framework} {path} ...", flush=True)
            row = (bench_torch if framework == "torch" else bench_mlx)(inputs, args, path)
            row.update(framework=framework, path=path, B=args.B, T=args.T, H=args.H, K=args.K, V=args.V, dtype=args.dtype)
            rows.append(row)

    header = f"{'framework':<9} {'path':<9} {'device':<10} {'fwd ms':>9} {'fwd tok/s':>11} {'fwd+bwd ms':>11} {'fwd+bwd tok/s':>14} {'peak GiB':>9}"
    print(f"\nB={args.B} T={args.T} H={args.H} K={args.K} V={args.V} {args.dtype} chunk={args.chunk_size}")
    print(header)
    for row in rows:
        if "skipped" in row:
            print(f"{row['framework']:<9} {row['path']:<9} not run: {row['skipped']}")
            continue
        peak = row.get("forward_backward_peak_gib")
        print(
            f"{row['framework']:<9} {row['path']:<9} {row['device'][:10]:<10} {row['forward_ms']:>9.2f} "
            f"{tokens / row['forward_ms'] * 1e3:>11.0f} {row['forward_backward_ms']:>11.2f} "
            f"{tokens / row['forward_backward_ms'] * 1e3:>14.0f} {'' if peak is None else f'{peak:.3f}':>9}"
        )
        if "metal_forward" in row:
            print(f"{'':<9} Metal: {row['metal_forward']} forward, {row['metal_backward']} backward; ESTIMATED on an "
                  f"M3 Max {row['estimated_forward_ms']:.2f} / {row['estimated_forward_backward_ms']:.2f} ms, counted "
                  f"backward buffers {row['counted_backward_buffers_gib']:.2f} GiB")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    print(f"\nwrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
