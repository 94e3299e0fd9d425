"""Where the intra-forward launch's time goes: the launch timed with parts of its work cut out.

Timing only, on a CUDA GPU: each form is ``gdn2/torch/triton/forward.py`` with one edit of its
source (its results are wrong by design), loaded as a module of its own, and its
``_intra_forward_kernel`` launched alone on the same bf16 inputs as the operator would (B=8
T=4096 H=16 K=128 by default, ``bench/triton_h200.py``'s first timing shape)::

    python3 bench/intra_forward_whatif.py
    TRITON_INTERPRET=1 python3 bench/intra_forward_whatif.py --device cpu --shape 1,70,1,16   # each form launches (untimed)

Forms: ``baseline`` (the key loop on one sub-block at a time), ``no_stores`` (no qd, kd, b k
exp(G), gamma or first-bad store: what only feeds them goes too, the bad-row tracking among it),
``no_scans`` (the span sums down each sub-block replaced by elementwise stand-ins), both, and
``no_P_dots`` (P's off-diagonal products left out); ``paired`` (the key loop on pairs of
sub-blocks, ``INTRA_FORWARD_PAIRED``) and it without its stores or its scans; ``halves`` (key
blocks in halves, ``INTRA_FORWARD_HALVES``) and it without its stores or its scans. Each edit
asserts that it found its target, so that a changed kernel fails here instead of timing the
baseline under another name.
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


def _function(source: str, name: str) -> tuple[int, int]:
    """Where the source of the ``triton.jit`` function ``name`` starts and ends."""
    start = source.index(f"def {name}(")
    return start, source.index("@triton.jit", start)


def _edit(source: str, name: str, edit) -> str:
    start, end = _function(source, name)
    return source[:start] + edit(source[start:end]) + source[end:]


def _drop_stores(body: str, stores: str, count: int) -> str:
    """``body`` without its stores to the buffers of the regular expression ``stores`` (``count``
    lines), gamma's store and the first bad row's."""
    lines = body.split("\n")
    kept = [line for line in lines if not re.search(stores, line)]
    assert len(lines) - len(kept) == count, f"the key loop's {count} stores of qd, b k exp(G) and kd"
    body = "\n".join(kept)
    gamma = re.search(r"\n[ \t]+tl\.store\(gamma_out[^\n]*(?:\n[ \t]+mask=[^\n]*)?", body)  # one line or two
    first_bad = re.search(r"\n\s+tl\.store\(key_first_bad_out[^\n]*", body)
    assert gamma and first_bad, "gamma's and the first bad row's stores"
    return body.replace(gamma.group(0), "").replace(first_bad.group(0), "")


def without_stores(source: str) -> str:
    return _edit(source, "_off_diagonal_tiles", lambda body: _drop_stores(body, r"_store_rows\((qd_out|bkd_out|kd_out)", 12))


def without_pair_stores(source: str) -> str:
    return _edit(source, "_off_diagonal_tiles_paired",
                 lambda body: _drop_stores(body, r"_store_rows\((qd_out|bkd_out|kd_out)", 6))


def _drop_scans(body: str) -> str:
    scans = "    L = tl.cumsum(decay, 0)\n    R = _exclusive_suffix(decay)"
    assert body.count(scans) == 1, "the two scans"
    return body.replace(scans, "    L = decay * 0.5\n    R = decay * 0.25")


def without_scans(source: str) -> str:
    """Without the scans of ``_sub_block``, which every key-loop form calls."""
    return _edit(source, "_sub_block", _drop_scans)


def without_P_products(source: str) -> str:
    lines = source.split("\n")
    kept = [line for line in lines if not re.match(r"\s+P\d\d \+= tl\.dot\(", line)]
    assert len(lines) - len(kept) == 6, "P's six off-diagonal products"
    return "\n".join(kept)


def forms(source: str) -> dict[str, tuple[str, dict]]:
    """Each form's source and the key-loop form it runs (the launch's ``PAIRED`` and ``HALVES``)."""
    plain, paired, halves = dict(PAIRED=False, HALVES=False), dict(PAIRED=True, HALVES=False), dict(PAIRED=False, HALVES=True)
    return {"baseline": (source, plain), "no_stores": (without_stores(source), plain),
            "no_scans": (without_scans(source), plain),
            "no_stores_no_scans": (without_scans(without_stores(source)), plain),
            "no_P_dots": (without_P_products(source), plain),
            "paired": (source, paired), "paired_no_stores": (without_pair_stores(source), paired),
            "paired_no_scans": (without_scans(source), paired),
            "halves": (source, halves), "halves_no_stores": (without_stores(source), halves),
            "halves_no_scans": (without_scans(source), halves)}


def _load(name: str, text: str, folder: str):
    path = os.path.join(folder, f"intra_forward_{name}.py")  # Triton reads a kernel's source from its file
    with open(path, "w") as handle:
        handle.write(text)
    spec = importlib.util.spec_from_file_location(f"intra_forward_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> dict[str, float | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8,4096,16,128", help="B,T,H,K")
    parser.add_argument("--device", default="cuda",
                        help="cuda, or cpu to run each form once under the Triton interpreter (TRITON_INTERPRET=1), untimed")
    args = parser.parse_args(argv)
    import torch
    import triton

    B, T, H, K = (int(x) for x in args.shape.split(","))
    N = -(-T // 64)
    device = args.device
    gen = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1).bfloat16()
            for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=device, generator=gen)).bfloat16()
    b = torch.rand(B, T, H, K, device=device, generator=gen).bfloat16()
    P = torch.empty(B, H, N, 10, 16, 16, device=device)
    A = torch.empty_like(P)
    qd, kd = (torch.empty(B, H, N * 64, K, device=device, dtype=torch.bfloat16) for _ in range(2))
    bkd = torch.empty(B, H, N * 64, K, device=device)
    gamma = torch.empty(B, H, N, K, device=device)
    first_bad = torch.empty(B, H, N, dtype=torch.int32, device=device)
    times = {}
    with open(SOURCE) as handle:
        source = handle.read()
    with tempfile.TemporaryDirectory() as folder:
        for name, (text, key_loop) in forms(source).items():
            start = time.time()
            module = _load(name, text, folder)

            def launch():
                module._intra_forward_kernel[(N, B * H)](
                    q, k, g, b, P, A, qd, kd, bkd, gamma, first_bad, P, T, H, K, N,
                    BK=min(module.INTRA_FORWARD_KEY_BLOCK, max(16, triton.next_power_of_2(K))), DOT="tf32",
                    PACKED=False, STAGES=module.INTRA_FORWARD_STAGES, **key_loop, num_warps=module.INTRA_FORWARD_WARPS,
                    num_stages=1)

            launch()
            if device == "cpu":
                times[name] = None
                print(f"intra_forward {name}: ran under the interpreter ({time.time() - start:.0f} s)", flush=True)
                continue
            torch.cuda.synchronize()
            times[name] = triton.testing.do_bench(launch, warmup=50, rep=300, return_mode="median")
            print(f"intra_forward {name}: {times[name]:.4f} ms ({time.time() - start:.0f} s)", flush=True)
    return times


if __name__ == "__main__":
    main()
