"""Packed (``cu_seqlens``) versus padded batches at the same real-token count, PyTorch.

    python bench/packed.py --sequences 16 --mean-length 512 --H 16 --K 128 --V 128 --dtype bfloat16 --path kernel

Draws ``--sequences`` lengths (uniform in [mean / 4, 7 * mean / 4], seeded), then times forward and
forward+backward of ``chunk_gdn2`` on (a) all sequences packed in one row with ``cu_seqlens`` and
(b) a ``[N, L_max]`` batch padded at the end. Reports ms and real tokens per second for each.
On CUDA the default path is the Triton kernel; elsewhere the chunk path.
"""

from __future__ import annotations

import argparse

import numpy as np

from gdn2.testing import median_ms


def main(argv=None) -> None:
    import torch

    from gdn2.torch import chunk_gdn2

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--mean-length", type=int, default=256)
    for name, default in (("H", 4), ("K", 64), ("V", 64)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--path", default=None, choices=["reference", "chunk", "kernel"])
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(max(1, args.mean_length // 4), 7 * args.mean_length // 4 + 1, args.sequences)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total, longest = int(offsets[-1]), int(lengths.max())
    H, K, V = args.H, args.K, args.V
    generator = torch.Generator(device="cpu").manual_seed(args.seed)

    def inputs(B, T):
        def unit(*shape):
            x = torch.randn(*shape, generator=generator)
            return x / x.norm(dim=-1, keepdim=True)

        tensors = [
            unit(B, T, H, K), unit(B, T, H, K), torch.randn(B, T, H, V, generator=generator),
            -torch.rand(B, T, H, K, generator=generator) * 3, torch.rand(B, T, H, K, generator=generator),
            torch.rand(B, T, H, V, generator=generator),
        ]
        return [t.to(device=device, dtype=dtype).requires_grad_(True) for t in tensors]

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    cases = {
        "packed": (inputs(1, total), dict(cu_seqlens=torch.tensor(offsets, device=device))),
        "padded": (inputs(len(lengths), longest), {}),
    }
    print(f"{len(lengths)} sequences, {total} real tokens (lengths {lengths.min()}..{longest}), H={H} K={K} V={V} "
          f"{args.dtype} on {device}, path {args.path or 'automatic'}")
    print(f"{'layout':<8} {'shape':<18} {'fwd ms':>9} {'fwd+bwd ms':>11} {'real tok/s fwd+bwd':>19}")
    for name, (tensors, extra) in cases.items():
        def forward():
            with torch.no_grad():
                chunk_gdn2(*tensors, chunk_size=args.chunk_size, path=args.path, **extra)

        def forward_backward():
            o, _ = chunk_gdn2(*tensors, chunk_size=args.chunk_size, path=args.path, **extra)
            o.float().sum().backward()

        fwd, both = (median_ms(run, args.repeats, 1, sync) for run in (forward, forward_backward))
        shape = f"[{tensors[0].shape[0]}, {tensors[0].shape[1]}]"
        print(f"{name:<8} {shape:<18} {fwd:>9.2f} {both:>11.2f} {total / both * 1e3:>19.0f}")


if __name__ == "__main__":
    main()
