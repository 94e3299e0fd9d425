"""Whether gdn2's launches repeat their bits under another assembler or with proxy fences added.

Runs ``bench/triton_h200.py``'s ``launch_repeats`` at its ``LAUNCH_REPEAT_CASES`` (the default
launch settings, or those of ``--variant``), in a fresh Triton cache, after changing how Triton
builds the kernels:

- ``--ptxas PATH``: assemble the PTX with this ``ptxas`` (Triton 3.6 uses the CUDA 12.8 one it
  ships for sm_90; ``TRITON_PTXAS_PATH``);
- ``--fence-before-wgmma``: put ``fence.proxy.async.shared::cta`` before every ``wgmma.fence``
  of the PTX that has none before it. Asynchronous copies (``cp.async``) write shared memory in
  the generic proxy and ``wgmma`` reads it in the asynchronous proxy, so the PTX ISA asks for
  that fence between them; Triton 3.9's pipelined loops have it, 3.6's do not (bench/RESULTS.md).

Run on the GPU machine, one setting per process::

    PYTHONPATH=$PWD python3 bench/ptx_probe.py --fence-before-wgmma
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import tempfile

FENCE = "fence.proxy.async.shared::cta;"


def add_fences(ptx: str) -> tuple[str, int]:
    """``ptx`` with ``FENCE`` before each ``wgmma.fence.sync.aligned`` whose previous instruction
    is not one; returns it and the number added."""
    fence, lines, added, previous = re.sub(r"\s+", "", FENCE), [], 0, ""
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith("wgmma.fence.sync.aligned") and previous != fence:
            lines.append("\t" + FENCE)
            added += 1
        lines.append(line)
        if stripped and not stripped.startswith("//"):
            previous = re.sub(r"\s+", "", stripped)
    return "\n".join(lines) + "\n", added


def fence_every_wgmma() -> dict:
    """Patch Triton's CUDA backend so that each kernel's PTX goes through ``add_fences``;
    returns counts by kernel name."""
    from triton.backends.nvidia.compiler import CUDABackend

    make_ptx = CUDABackend.make_ptx
    counts = {}

    def patched(self, src, metadata, opt, capability):
        ptx, added = add_fences(make_ptx(self, src, metadata, opt, capability))
        counts[metadata.get("name", "?")] = added
        return ptx

    CUDABackend.make_ptx = patched
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ptxas", help="path of the ptxas to assemble with")
    parser.add_argument("--fence-before-wgmma", action="store_true")
    parser.add_argument("--variant", nargs="+", action="extend", default=[], metavar="NAME=VALUE")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # before Triton compiles anything: a fresh cache, so that no earlier build is reused
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-probe-")
    if args.ptxas:
        os.environ["TRITON_PTXAS_PATH"] = args.ptxas
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    from triton_h200 import launch_repeat_rows  # bench/, next to this script

    counts = fence_every_wgmma() if args.fence_before_wgmma else None
    print(f"triton {triton.__version__}, ptxas {get_ptxas(90).version} ({get_ptxas(90).path}), "
          f"fences added: {args.fence_before_wgmma}", flush=True)
    variant = {name: ast.literal_eval(value) for name, value in (v.split("=", 1) for v in args.variant)}
    for _ in launch_repeat_rows(variant, args.seed, args.runs):
        pass  # each row is printed
    if counts is not None:
        print("fences added by kernel:", {name: n for name, n in counts.items() if n}, flush=True)


if __name__ == "__main__":
    main()
