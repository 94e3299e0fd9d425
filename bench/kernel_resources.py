"""Registers, spills and shared memory of every Triton kernel for the H100/H200 (sm_90a), without a GPU.

Each kernel is compiled ahead of time with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` at
the launch settings its launcher would use for the given shape (and the specialisation a launch at
the benchmark shapes gets: pointers 16-byte aligned, T, H, N multiples of 16), and its PTX goes through the
``ptxas`` that Triton ships (``-arch=sm_90a -v``). Run on any machine with Triton installed::

    python bench/kernel_resources.py --K 128 --V 128 --dtype bfloat16

Compiling needs no CUDA device; ``TRITON_INTERPRET`` must be unset.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import gdn2.torch.triton as operator
from gdn2.torch.triton import backward, forward

TARGET = GPUTarget("cuda", 90, 32)
# Launches compiled with a cap on registers per thread (their launchers' settings), by kernel.
MAX_REGISTERS = {forward._intra_forward_kernel: lambda: forward.INTRA_FORWARD_MAX_REGISTERS}


def _ptxas() -> str:
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the PTX version Triton writes
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"no ptxas in {folder}")


def compile_kernel(kernel, pointers: dict[str, str], scalars: dict[str, str], constants: dict, num_warps: int):
    """Compile ``kernel`` (a ``triton.jit`` function) for sm_90a; returns (shared bytes, ptxas report).
    A launch with a register cap (``MAX_REGISTERS``, by kernel) is compiled with it."""
    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = f"*{pointers[name]}"
        else:
            signature[name] = scalars.get(name, "i32")
    # As the launch specialises them at the benchmark shapes: pointers 16-byte aligned, the integer
    # sizes T, H, N multiples of 16 (without this, loads are not vectorised and the registers come
    # out higher than on the GPU).
    divisible = [n for n in names if n in pointers or (n in ("T", "H", "N") and signature[n] == "i32")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constants.items()}, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=1)
    cap = MAX_REGISTERS[kernel]() if kernel in MAX_REGISTERS else None
    if cap is not None:
        options["maxnreg"] = cap
    compiled = triton.compile(source, target=TARGET, options=options)
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(folder, "kernel.o")],
                                capture_output=True, text=True, check=True).stderr
    return compiled.metadata.shared, report


def summary(report: str) -> str:
    registers = re.search(r"Used (\d+) registers", report)
    stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    text = f"{registers.group(1) if registers else '?'} registers"
    if stack:
        text += f", stack {stack.group(1)} B, spill stores {stack.group(2)} B, loads {stack.group(3)} B"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--dot", default="tf32", choices=["tf32", "tf32x3", "ieee"])
    parser.add_argument("--packed", action="store_true", help="the kernels as they run packed sequences")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="compile only these kernels (names as printed)")
    parser.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE",
                        help="launch constants of the kernel modules, as a bench variant sets them "
                             "(e.g. INTRA_FORWARD_SPLIT=True INTRA_FORWARD_MAX_REGISTERS=168)")
    args = parser.parse_args()
    for setting in args.set:
        name, value = setting.split("=", 1)
        module = next(m for m in (forward, backward, operator) if hasattr(m, name))
        setattr(module, name, ast.literal_eval(value))
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("TRITON_INTERPRET is set: unset it to compile")
    inp = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[args.dtype]
    for name, (kernel, pointers, scalars, constants, warps) in kernels(args.K, args.V, inp, args.dot, args.packed).items():
        if args.only and name not in args.only:
            continue
        try:
            shared, report = compile_kernel(kernel, pointers, scalars, constants, warps)
            print(f"{name:16s} {warps} warps, shared {shared / 1024:.1f} KiB, {summary(report)}", flush=True)
        except Exception as error:  # report every kernel, keep going
            print(f"{name:16s} failed: {type(error).__name__}: {str(error)[:400]}", flush=True)


def kernels(K: int, V: int, inp: str, dot: str, packed: bool = False) -> dict:
    """Each kernel with the pointer dtypes and constants its launcher uses for (K, V), for packed
    sequences (``packed``) or a batch."""
    f32 = "fp32"
    def saved(name):  # the dtype of a saved buffer, as the operator allocates it
        return "bf16" if inp == "bf16" and name in operator.SAVED_IN_BFLOAT16 else f32

    saved_states = saved("states")
    bk = max(16, triton.next_power_of_2(K))
    out = {}
    fk = forward
    out["intra_forward"] = (
        fk._intra_forward_kernel,
        dict(q=inp, k=inp, g=inp, b=inp, P_out=f32, X_out=f32, qd_out=saved("qd"), kd_out=saved("kd"), bkd_out=f32,
             gamma_out=f32, key_first_bad_out="i32", chunk_table="i32"), {},
        dict(K=K, BK=min(fk.INTRA_FORWARD_KEY_BLOCK, bk), DOT=dot, PACKED=packed, INVERSE=fk.INVERSE_DOT, SPLIT=fk.INTRA_FORWARD_SPLIT,
             STORE_EARLY=fk.INTRA_FORWARD_STORE_EARLY, READ_ROWS=fk.INVERSE_READ_ROWS),
        fk.INTRA_FORWARD_WARPS,
    )
    wy_blocks = dict(K=K, V=V, BK=min(fk.WY_BLOCK, bk), BV=min(fk.WY_BLOCK, max(16, triton.next_power_of_2(V))), DOT=dot,
                     PACKED=packed)
    out["wy"] = (
        fk._wy_kernel,
        dict(v=inp, w=inp, X=f32, bkd=f32, key_first_bad="i32", Wk_out=f32, Uw_out=f32, first_bad_out="i32",
             chunk_table="i32"),
        {}, wy_blocks, fk.WY_WARPS,
    )
    diagonal_pointers = dict(q=inp, k=inp, g=inp, b=inp, P_out=f32, A_out=f32, chunk_table="i32")
    out["diagonal"] = (
        fk._diagonal_kernel, diagonal_pointers, {}, dict(K=K, BK=min(fk.DIAGONAL_KEY_BLOCK, bk), DOT=dot, PACKED=packed),
        fk.DIAGONAL_WARPS,
    )
    out["state_forward"] = (
        fk._state_forward_kernel,
        dict(Wk=f32, kd=saved("kd"), Uw=f32, gamma=f32, first_bad="i32", initial_state=f32, states=saved_states, U_out=f32,
             final_state=f32, sequence_chunks="i32"),
        {}, dict(K=K, V=V, BK=bk, BV=fk.value_block(V, 128), HAS_INITIAL=True, STORE_FINAL=True, DOT=dot,
                 PACKED=packed, STAGES=fk.STATE_STAGES),
        fk.STATE_WARPS,
    )
    out["output"] = (
        fk._output_kernel,
        dict(qd=saved("qd"), P=f32, states=saved_states, U=f32, first_bad="i32", o=inp, chunk_table="i32"), dict(scale="fp32"),
        dict(K=K, V=V, BK=min(64, bk), BV=min(64, max(16, triton.next_power_of_2(V))), DOT=dot, PACKED=packed),
        fk.OUTPUT_WARPS,
    )
    bw = backward
    out["state_backward"] = (
        bw._state_backward_kernel,
        dict(qd=saved("qd"), kd=saved("kd"), Wk=f32, gamma=f32, P=f32, d_o=inp, d_final=f32, d_leaving=f32, d_U=f32, d_initial=f32,
             chunk_table="i32", sequence_chunks="i32"),
        dict(scale="fp32"),
        dict(K=K, V=V, BK=bk, BV=fk.value_block(V, 128), HAS_FINAL=True, STORE_INITIAL=True, DOT=dot, PACKED=packed),
        fk.STATE_WARPS,
    )
    blocks = dict(K=K, V=V, BKB=min(bw.INTRA_BACKWARD_KEY_BLOCK, max(32, bk)),
                  BV=min(bw.INTRA_BACKWARD_VALUE_BLOCK, max(32, triton.next_power_of_2(V))), C=64, DOT=dot,
                  PACKED=packed)
    out["intra_backward_contract"] = (
        bw._intra_backward_contract_kernel,
        dict(states=saved_states, U=f32, d_o=inp, d_leaving=f32, d_U=f32, inverse=f32, d_qd=f32, d_kd=f32, d_bkd=f32,
             d_gamma=f32, chunk_table="i32"),
        dict(scale="fp32"), blocks, bw.INTRA_BACKWARD_WARPS,
    )
    out["intra_backward_values"] = (
        bw._intra_backward_values_kernel,
        dict(v=inp, w=inp, Wk=f32, Uw=f32, inverse=f32, U=f32, d_o=inp, d_U=f32, d_bkd=f32,
             d_A_scratch=f32, d_P_scratch=f32, dv=inp, dw=inp, chunk_table="i32"),
        dict(scale="fp32"), blocks, bw.INTRA_BACKWARD_WARPS,
    )
    out["intra_backward_keys"] = (
        bw._intra_backward_keys_kernel,
        dict(q=inp, k=inp, g=inp, b=inp, d_qd=f32, d_kd=f32, d_bkd=f32, sub_block_sums=f32,
             d_A_scratch=f32, d_P_scratch=f32, dq=inp, dk=inp, db=inp, chunk_table="i32"),
        {}, dict(K=K, BKB=min(bw.INTRA_BACKWARD_KEYS_BLOCK, bk), DOT=dot, PACKED=packed),
        bw.INTRA_BACKWARD_KEYS_WARPS,
    )
    out["gate_gradient"] = (
        bw._gate_gradient_kernel, dict(partial=f32, sub_block_sums=f32, gamma=f32, d_gamma=f32, dg=inp, chunk_table="i32"),
        {}, dict(K=K, BKB=min(bw.INTRA_BACKWARD_KEYS_BLOCK, bk), PACKED=packed), 4,
    )
    return out


if __name__ == "__main__":
    main()
