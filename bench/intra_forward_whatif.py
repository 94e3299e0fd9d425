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
``no_P_dots`` (P's off-diagonal products left out), ``no_bad_rows`` (no tracking of the first
bad key-side row; its store kept), ``no_screening`` (no screening of k, b and g for non-finite
values at all: neither that tracking nor the selects that read a bad value as 0),
``no_bkd_store`` (b k exp(G) not stored) and ``tl_exp`` (every exponential by ``tl.exp``, as
before ``_exp``: results right, the flushing of values below 2^-126 to 0 aside). Each edit
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


def _blank(text: str, pattern: str, count: int, what: str) -> str:
    """``text`` with each statement matching ``pattern`` (from its indentation to its line's end, or
    to the end of a continuation line starting ``mask=``) made ``pass``, so that a block it
    leaves empty stays Python; asserts that ``count`` matched."""
    statement = re.compile(r"^([ \t]+)" + pattern + r"[^\n]*(?:\n[ \t]+mask=[^\n]*)?", re.M)
    blanked, found = statement.subn(lambda match: match.group(1) + "pass", text)
    assert found == count, f"{what}: {found} found, {count} expected"
    return blanked


def without_stores(source: str) -> str:
    def drop(body):
        body = _blank(body, r"_store_rows\((qd_out|bkd_out|kd_out)", 12, "the key loop's stores of qd, b k exp(G) and kd")
        body = _blank(body, r"tl\.store\(gamma_out", 1, "gamma's store")
        return _blank(body, r"tl\.store\(key_first_bad_out", 1, "the first bad row's store")

    return _edit(source, "_off_diagonal_tiles", drop)


def without_bkd_store(source: str) -> str:
    return _edit(source, "_off_diagonal_tiles",
                 lambda body: _blank(body, r"_store_rows\(bkd_out", 4, "the key loop's stores of b k exp(G)"))


def without_bad_rows(source: str) -> str:
    """Without ``_sub_block``'s tracking of the first bad row (its checks then unused)."""
    return _edit(source, "_sub_block",
                 lambda body: _blank(body, r"key_bad = tl\.minimum\(key_bad, ", 1, "the bad-row tracking"))


def without_screening(source: str) -> str:
    """Without ``_sub_block``'s screening of k, b and g for non-finite values: the bad-row
    tracking and the selects that read a bad value as 0 (or a NaN decay as none)."""
    screening = ("    bad = (g_tile != _decay(g_tile)) | (k_raw != _finite(k_raw)) | (b_raw != _finite(b_raw))\n"
                 "    key_bad = tl.minimum(key_bad, tl.where(bad, I * 16 + r[:, None], 64))\n"
                 "    k_tile = _finite(k_raw)\n"
                 "    bk = _finite(b_raw) * k_tile\n"
                 "    decay = _decay(g_tile)\n")

    def drop(body):
        assert body.count(screening) == 1, "the screening"
        return body.replace(screening, "    k_tile = k_raw\n    bk = b_raw * k_tile\n    decay = g_tile\n")

    return _edit(source, "_sub_block", drop)


def _drop_scans(body: str) -> str:
    scans = "        L = tl.cumsum(decay, 0)\n        R = _exclusive_suffix(decay)"
    assert body.count(scans) == 1, "the two scans"
    return body.replace(scans, "        L = decay * 0.5\n        R = decay * 0.25")


def without_scans(source: str) -> str:
    """Without the scans of ``_sub_block``."""
    return _edit(source, "_sub_block", _drop_scans)


def without_P_products(source: str) -> str:
    return _edit(source, "_off_diagonal_tiles",
                 lambda body: _blank(body, r"P\d\d \+= tl\.dot\(", 6, "P's six off-diagonal products"))


def with_tl_exp(source: str) -> str:
    """Every exponential as ``tl.exp`` (``_exp``'s form before: the same values but for those
    below 2^-126, three more instructions each on sm_90a)."""
    def edit(body):
        line = "    return tl.math.exp2(x * 1.4426950408889634)\n"
        assert body.count(line) == 1, "_exp's body"
        return body.replace(line, "    return tl.exp(x)\n")

    return _edit(source, "_exp", edit)


def forms(source: str) -> dict[str, str]:
    """Each form's source."""
    return {"baseline": source, "no_stores": without_stores(source), "no_scans": without_scans(source),
            "no_stores_no_scans": without_scans(without_stores(source)), "no_P_dots": without_P_products(source),
            "no_bad_rows": without_bad_rows(source), "no_screening": without_screening(source),
            "no_bkd_store": without_bkd_store(source), "tl_exp": with_tl_exp(source)}


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
        for name, text in forms(source).items():
            start = time.time()
            module = _load(name, text, folder)

            def launch():
                module._intra_forward_kernel[(N, B * H)](
                    q, k, g, b, P, A, qd, kd, bkd, gamma, first_bad, P, T, H, K, N,
                    BK=min(module.INTRA_FORWARD_KEY_BLOCK, max(16, triton.next_power_of_2(K))), DOT="tf32",
                    PACKED=False, STAGES=module.INTRA_FORWARD_STAGES,
                    SPAN_SUMS=module.INTRA_FORWARD_SPAN_SUMS, num_warps=module.INTRA_FORWARD_WARPS,
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
