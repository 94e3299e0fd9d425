"""Where the intra-forward launch's time goes: the launch timed with parts of its work cut out.

Timing only, on a CUDA GPU: each form is ``gdn2/torch/triton/forward.py`` with one edit of its
source (its results are wrong by design), loaded as a module of its own, and its
``_intra_forward_kernel`` (the form on one sub-block at a time) launched alone on the same bf16 inputs as the operator would (B=8
T=4096 H=16 K=128 by default, ``bench/triton_h200.py``'s first timing shape)::

    python3 bench/intra_forward_whatif.py

Forms: ``baseline`` (the launch as it is), ``no_stores`` (no qd, kd, b k exp(G), gamma or
first-bad store: what only feeds them goes too, the bad-row tracking among it), ``no_scans``
(the span sums down each sub-block replaced by elementwise stand-ins), both, and ``no_P_dots``
(P's off-diagonal products left out). Each edit asserts that it found its target, so that a
changed kernel fails here instead of timing the baseline under another name.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile
import time

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gdn2", "torch", "triton", "forward.py")


def _key_loop(source: str) -> tuple[int, int]:
    start = source.index("def _off_diagonal_tiles(")
    return start, source.index("@triton.jit", start)


def without_stores(source: str) -> str:
    start, end = _key_loop(source)
    loop = source[start:end]
    lines = loop.split("\n")
    kept = [line for line in lines if not re.search(r"_store_rows\((qd_out|bkd_out|kd_out)", line)]
    assert len(lines) - len(kept) == 12, "the key loop's twelve stores of qd, b k exp(G) and kd"
    loop = "\n".join(kept)
    gamma = re.search(r"\n\s+tl\.store\(gamma_out[^\n]*\n[^\n]*mask=[^\n]*\)", loop)
    first_bad = re.search(r"\n\s+tl\.store\(key_first_bad_out[^\n]*", loop)
    assert gamma and first_bad, "gamma's and the first bad row's stores"
    loop = loop.replace(gamma.group(0), "").replace(first_bad.group(0), "")
    return source[:start] + loop + source[end:]


def without_scans(source: str) -> str:
    start = source.index("def _sub_block(")
    end = source.index("@triton.jit", start)
    scans = "    L = tl.cumsum(decay, 0)\n    R = _exclusive_suffix(decay)"
    assert source[start:end].count(scans) == 1, "the sub-block's two scans"
    return source[:start] + source[start:end].replace(scans, "    L = decay * 0.5\n    R = decay * 0.25") + source[end:]


def without_P_products(source: str) -> str:
    lines = source.split("\n")
    kept = [line for line in lines if not re.match(r"\s+P\d\d \+= tl\.dot\(", line)]
    assert len(lines) - len(kept) == 6, "P's six off-diagonal products"
    return "\n".join(kept)


def forms(source: str) -> dict[str, str]:
    return {"baseline": source, "no_stores": without_stores(source), "no_scans": without_scans(source),
            "no_stores_no_scans": without_scans(without_stores(source)), "no_P_dots": without_P_products(source)}


def _load(name: str, text: str, folder: str):
    path = os.path.join(folder, f"intra_forward_{name}.py")  # Triton reads a kernel's source from its file
    with open(path, "w") as handle:
        handle.write(text)
    spec = importlib.util.spec_from_file_location(f"intra_forward_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8,4096,16,128", help="B,T,H,K")
    args = parser.parse_args()
    import torch
    import triton

    B, T, H, K = (int(x) for x in args.shape.split(","))
    N = -(-T // 64)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1).bfloat16()
            for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda", generator=gen)).bfloat16()
    b = torch.rand(B, T, H, K, device="cuda", generator=gen).bfloat16()
    P = torch.empty(B, H, N, 10, 16, 16, device="cuda")
    A = torch.empty_like(P)
    qd, kd = (torch.empty(B, H, N * 64, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bkd = torch.empty(B, H, N * 64, K, device="cuda")
    gamma = torch.empty(B, H, N, K, device="cuda")
    first_bad = torch.empty(B, H, N, dtype=torch.int32, device="cuda")
    with open(SOURCE) as handle:
        source = handle.read()
    with tempfile.TemporaryDirectory() as folder:
        for name, text in forms(source).items():
            start = time.time()
            module = _load(name, text, folder)

            def launch():
                module._intra_forward_kernel[(N, B * H)](
                    q, k, g, b, P, A, qd, kd, bkd, gamma, first_bad, P, T, H, K, N,
                    BK=min(module.INTRA_FORWARD_KEY_BLOCK, max(16, triton.next_power_of_2(K))), DOT="tf32",
                    PACKED=False, STAGES=module.INTRA_FORWARD_STAGES, PAIRED=False, num_warps=module.INTRA_FORWARD_WARPS,
                    num_stages=1)

            launch()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(launch, warmup=50, rep=300, return_mode="median")
            print(f"intra_forward {name}: {ms:.4f} ms ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
