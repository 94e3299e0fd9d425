"""Registers, spills and shared memory of every Triton kernel for the H100/H200 (sm_90a), without a GPU.

Each kernel is compiled ahead of time with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` at
the launch settings its launcher would use for the given shape (and the specialisation a launch at
the benchmark shapes gets: pointers 16-byte aligned, T, H, N multiples of 16), and its PTX goes through the
``ptxas`` that Triton ships (``-arch=sm_90a -v``). Run on any machine with Triton installed::

    python bench/kernel_resources.py --K 128 --V 128 --dtype bfloat16

``--arch 80`` (A100), ``86`` (RTX 3090, A6000), ``89`` (RTX 4090, L40), ``100`` (B200) or ``120``
(RTX 5090) compiles for that GPU instead, with the launch settings chosen for its shared memory
per block (``ARCHS``), and says of each kernel whether it fits there.

A kernel whose loop copies into a shared-memory slot that an asynchronous tensor-core product
still reads gets ``RACE: <buffers>`` on its line (``overwritten_while_read``, on Triton's GPU IR).

Compiling needs no CUDA device; ``TRITON_INTERPRET`` must be unset.

``--instructions`` also disassembles each cubin (the ``nvdisasm`` Triton ships next to ``ptxas``)
and prints its static SASS instruction count by class, and per loop, with an estimate of the
dynamic warp-instructions per program (see ``--help``). ``--variant NAME=VALUE`` sets a launch
constant of the kernel modules first (as ``bench/triton_h200.py`` VARIANTS do), the operator's
``SAVED_IN_BFLOAT16`` included: ``--variant 'SAVED_IN_BFLOAT16=("states","qd","kd","Wk")'``.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import re
import subprocess
import tempfile
from collections import Counter
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import gdn2.torch.triton as operator
from gdn2.torch.triton import backward, forward

# Compute capability: (ptxas architecture, shared memory a block may take: CUDA's opt-in limit,
# which Triton reads as the device's ``max_shared_mem``).
ARCHS = {80: ("sm_80", 166912), 86: ("sm_86", 101376), 89: ("sm_89", 101376), 90: ("sm_90a", 232448),
         100: ("sm_100a", 232448), 120: ("sm_120a", 101376)}
ARCH = 90  # what build() compiles for (main's --arch)


def _ptxas() -> str:
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the PTX version Triton writes
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"no ptxas in {folder}")


class Compiled(NamedTuple):
    shared: int  # bytes of shared memory
    report: str  # ptxas -v
    sass: str  # nvdisasm of the cubin ("" unless asked for)
    ptx: str
    ttgir: str  # Triton's GPU IR, after software pipelining


def stores_after_wait(ptx: str) -> int:
    """Places in ``ptx`` where a thread stores into shared memory (``st.shared``, ``stmatrix``)
    after waiting for its warpgroup's asynchronous products (``wgmma.wait_group``) with no barrier
    between. With two or more warpgroups each such store may overwrite what another warpgroup's
    products still read (triton-lang/triton#11047: Triton before 3.9 leaves these out)."""
    count, waited = 0, False
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith("wgmma.wait_group"):
            waited = True
        elif line.startswith(("bar.sync", "barrier.sync")):
            waited = False
        elif waited and line.startswith(("st.shared", "stmatrix")):
            count, waited = count + 1, False
    return count


_RESULT = re.compile(r"^\s*(%[\w\-]+)(?::\d+)? = ([\w.]+)")
_VALUE = re.compile(r"%[\w\-]+(?:#\d+)?")
_SCALAR_OPS = {
    "arith.addi": lambda a, b: a + b, "arith.subi": lambda a, b: a - b, "arith.muli": lambda a, b: a * b,
    "arith.andi": lambda a, b: a & b, "arith.remsi": lambda a, b: a % b, "arith.remui": lambda a, b: a % b,
}
_COMPARISONS = {"eq": int.__eq__, "ne": int.__ne__, "slt": int.__lt__, "sle": int.__le__, "sgt": int.__gt__,
                "sge": int.__ge__, "ult": int.__lt__, "ule": int.__le__, "ugt": int.__gt__, "uge": int.__ge__}


def _loop_body(lines: list[str], start: int) -> list[str]:
    """The operations directly in the region of the ``scf.for`` at ``lines[start]`` (not those of
    regions nested in it)."""
    body, depth = [], 0
    for line in lines[start + 1:]:
        if depth == 0 and line.strip().startswith("}"):
            break
        if depth == 0:
            body.append(line)
        depth += line.count("{") - line.count("}")
    return body


def overwritten_while_read(ttgir: str, iterations: int = 3) -> list[str]:
    """Shared-memory buffers that a loop of ``ttgir`` (Triton's GPU IR after software pipelining)
    writes, by an asynchronous copy or a store, in a slot that an asynchronous product
    (``warp_group_dot``) issued before and not yet waited for still reads: each loop's own slot
    arithmetic run for ``iterations`` iterations, a slot it cannot work out counted as any slot.
    Named as Triton names buffers, after the loaded variable. Triton 3.6 to 3.9 give a load that
    registers read as well as such a product one buffer too few, so the copy of the step
    ``STAGES - 1`` ahead lands in the slot this step's products read (bench/RESULTS.md)."""
    lines = ttgir.splitlines()
    constants = {}
    for line in lines:
        match = re.match(r"^\s*(%[\w\-]+) = arith\.constant (-?\d+) : i\d+ ", line)
        if match:
            constants[match.group(1)] = int(match.group(2))
    found = []
    for start, line in enumerate(lines):
        header = re.search(r"scf\.for (%[\w\-]+) = (%[\w\-]+) to %[\w\-]+ step (%[\w\-]+)", line)
        if not header:
            continue
        body = _loop_body(lines, start)
        carried = re.findall(r"(%[\w\-]+) = (%[\w\-]+(?:#\d+)?)",
                             line.split("iter_args(", 1)[1].split(") ->", 1)[0]) if "iter_args(" in line else []
        values = {name: constants.get(initial) for name, initial in carried}
        first, step = constants.get(header.group(2)), constants.get(header.group(3))
        views: dict[str, tuple[str, int | None]] = {}  # a view of one slot: (buffer, slot)
        in_flight: list[set] = []  # each asynchronous product not waited for: the slots it reads
        for iteration in range(iterations):
            env = dict(constants, **values)
            env[header.group(1)] = None if None in (first, step) else first + iteration * step
            yielded = None
            for op in body:
                code = op.strip()
                if code.startswith("scf.yield"):
                    yielded = _VALUE.findall(code.split(" : ", 1)[0])
                    continue
                match = _RESULT.match(op)
                result, kind = (match.group(1), match.group(2)) if match else (None, code.split(" ", 1)[0])
                operands = _VALUE.findall(op.split(" = ", 1)[1] if match else code)
                if kind in _SCALAR_OPS or kind in ("arith.cmpi", "arith.select"):
                    if not re.search(r": i\d+ loc", op):  # tensors: not slot arithmetic
                        continue
                    args = [env.get(o) for o in operands[:3]]
                    if kind == "arith.select":
                        env[result] = None if args[0] is None else (args[1] if args[0] else args[2])
                    elif None in args[:2] or (kind.startswith("arith.rem") and args[1] == 0):
                        env[result] = None
                    elif kind == "arith.cmpi":
                        env[result] = _COMPARISONS[code.split("arith.cmpi ", 1)[1].split(",")[0]](*args[:2])
                    else:
                        env[result] = _SCALAR_OPS[kind](*args[:2])
                elif kind in ("ttg.memdesc_index", "ttg.memdesc_subview"):
                    views[result] = (operands[0], env.get(operands[1]))
                elif kind.startswith("ttg.memdesc_") and operands and operands[0] in views:
                    views[result] = views[operands[0]]  # a transposed or sliced view of the same slot
                elif kind == "ttng.warp_group_dot" and "isAsync = true" in op:
                    in_flight.append({views[o] for o in operands[:2] if o in views})
                elif kind == "ttng.warp_group_dot_wait":
                    pendings = int(re.search(r"pendings = (\d+)", op).group(1))
                    in_flight = in_flight[len(in_flight) - pendings:] if pendings else []
                elif kind.endswith("copy_global_to_local") or kind == "ttg.local_store":
                    target = next((views[o] for o in operands if o in views), None)
                    for read in in_flight if target else ():
                        for buffer, slot in read:
                            same = slot is None or target[1] is None or slot == target[1]
                            name = buffer.lstrip("%").rsplit("_", 1)[0]
                            if buffer == target[0] and same and name not in found:
                                found.append(name)
            if yielded is None:
                break
            values = {name: env.get(value) for (name, _), value in zip(carried, yielded)}
    return found


def build(kernel, pointers: dict[str, str], scalars: dict[str, str], constants: dict, num_warps: int,
          disassemble: bool = False, maxnreg: int | None = None, num_stages: int = 1,
          sizes: tuple[str, ...] = ("T", "H", "N")) -> Compiled:
    """Compile ``kernel`` (a ``triton.jit`` function) for ``ARCH`` through Triton's ptxas, its
    registers capped at ``maxnreg`` if given, the integer arguments ``sizes`` taken as multiples of
    16; with ``disassemble``, the cubin's SASS too."""
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
    divisible = [n for n in names if n in pointers or (n in sizes and signature[n] == "i32")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constants.items()}, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    compiled = triton.compile(source, target=GPUTarget("cuda", ARCH, 32), options=options)
    sass = ""
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        cubin = os.path.join(folder, "kernel.o")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([_ptxas(), f"-arch={ARCHS[ARCH][0]}", "-v", ptx, "-o", cubin],
                                capture_output=True, text=True, check=True).stderr
        if disassemble:
            nvdisasm = os.path.join(os.path.dirname(_ptxas()), "nvdisasm")
            sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    return Compiled(compiled.metadata.shared, report, sass, compiled.asm["ptx"], compiled.asm["ttgir"])


def compile_kernel(kernel, pointers: dict[str, str], scalars: dict[str, str], constants: dict, num_warps: int):
    """Compile ``kernel`` (a ``triton.jit`` function) for ``ARCH``; returns (shared bytes, ptxas report)."""
    compiled = build(kernel, pointers, scalars, constants, num_warps)
    return compiled.shared, compiled.report


# Instruction classes (SASS opcode without its modifiers, e.g. ``FFMA`` of ``FFMA.FTZ``), in print order.
CLASSES = {
    "MMA": ("HMMA", "HGMMA", "IMMA", "DMMA", "BMMA"),  # tensor cores
    "FP32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSWZADD"),  # float32 arithmetic
    "FSEL": ("FSEL", "FSETP", "FSET", "FCHK"),  # float compares and selects (masks, tl.where)
    "MUFU": ("MUFU",),  # exp2, reciprocal, ...
    "CVT": ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "FRND"),  # conversions
    "LDG": ("LDG", "LD", "LDGSTS", "LDGDEPBAR"),  # global loads
    "STG": ("STG", "ST", "RED", "ATOM", "ATOMG"),  # global stores
    "LDS": ("LDS", "LDSM"),  # shared-memory loads
    "STS": ("STS", "STSM"),  # shared-memory stores
    "SHFL": ("SHFL",),
    "BAR": ("BAR", "MEMBAR", "WARPSYNC", "DEPBAR"),
    "INT": ("IMAD", "IADD3", "IADD", "LEA", "LOP3", "SHF", "ISETP", "IMNMX", "IABS", "SGXT", "BMSK", "POPC", "FLO",
            "BREV", "IMUL", "ISCADD", "LOP", "SHL", "SHR", "VIADD", "VIMNMX"),  # integer: addresses, indices, masks
    "MOVE": ("MOV", "SEL", "PRMT", "S2R", "S2UR", "CS2R", "UMOV", "R2UR", "P2R", "R2P", "PLOP3", "ULDC", "UIADD3",
             "UIMAD", "ULEA", "ULOP3", "USHF", "USEL", "UISETP", "UPLOP3", "USGXT", "UPRMT", "VOTE", "VOTEU"),
    "CONTROL": ("BRA", "EXIT", "BSSY", "BSYNC", "NOP", "CALL", "RET", "BRX", "JMP", "YIELD", "WARPGROUP"),
}
_CLASS_OF = {op: name for name, ops in CLASSES.items() for op in ops}
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def instruction_class(opcode: str) -> str:
    if opcode.startswith("U") and opcode not in _CLASS_OF:  # uniform-datapath twins (UIMAD, ULDC, ...)
        return "MOVE"
    return _CLASS_OF.get(opcode, "OTHER")


class Sass(NamedTuple):
    opcodes: list[str]  # one per instruction, in address order, modifiers dropped
    loops: list[tuple[int, int]]  # (first, last) instruction index of each loop, in order of their ends


def parse_sass(sass: str) -> Sass:
    """Instructions and loops of one kernel's nvdisasm output. A loop is a backward branch: from
    its target (a label) to the branch itself."""
    opcodes, labels, branches = [], {}, []
    pending = []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        text = m.group(2).strip()
        if text.startswith("@"):  # predicate guard
            text = text.split(None, 1)[1]
        opcode = text.split()[0].split(".")[0]
        for name in pending:
            labels[name] = len(opcodes)
        pending = []
        target = re.search(r"\(?(\.L_x_\d+)\)?", text) if opcode in ("BRA", "JMP") else None
        if target:
            branches.append((len(opcodes), target.group(1)))
        opcodes.append(opcode)
    # (A branch to itself after the last EXIT is the kernel's end, not a loop.)
    loops = sorted({(labels[t], at) for at, t in branches if t in labels and labels[t] < at}, key=lambda x: x[1])
    return Sass(opcodes, loops)


def count_classes(opcodes) -> Counter:
    return Counter(instruction_class(op) for op in opcodes)


def _weights(parsed: Sass, trips: list[float]) -> list[float]:
    """How many times each instruction issues per warp: once per trip of every loop around it
    (``trips[i]`` for ``parsed.loops[i]``; a loop without one counts once)."""
    weights = []
    for index in range(len(parsed.opcodes)):
        weight = 1.0
        for number, (first, last) in enumerate(parsed.loops):
            if first <= index <= last:
                weight *= trips[number] if number < len(trips) else 1.0
        weights.append(weight)
    return weights


def dynamic_estimate(parsed: Sass, trips: list[float]) -> float:
    """Warp-instructions issued per warp (``_weights`` summed)."""
    return sum(_weights(parsed, trips))


def dynamic_classes(parsed: Sass, trips: list[float]) -> Counter:
    """As ``dynamic_estimate``, by class."""
    out = Counter()
    for opcode, weight in zip(parsed.opcodes, _weights(parsed, trips)):
        out[instruction_class(opcode)] += weight
    return out


def _format_classes(counts) -> str:
    names = [n for n in list(CLASSES) + ["OTHER"] if counts.get(n)]
    return " ".join(f"{n} {counts[n]:.0f}" if isinstance(counts[n], float) else f"{n} {counts[n]}" for n in names)


def instruction_report(sass: str, trips: list[float], num_warps: int, programs: int | None = None) -> str:
    """Lines: the static counts by class, each loop's, and the dynamic estimate per program (and
    per launch of ``programs`` programs)."""
    parsed = parse_sass(sass)
    lines = [f"  SASS {len(parsed.opcodes)} instructions: {_format_classes(count_classes(parsed.opcodes))}"]
    for number, (first, last) in enumerate(parsed.loops):
        trip = trips[number] if number < len(trips) else None
        lines.append(f"  loop {number} (instructions {first}-{last}, {last - first + 1} long, "
                     f"{'trips ' + format(trip, 'g') if trip is not None else 'trips unknown: counted once'}): "
                     f"{_format_classes(count_classes(parsed.opcodes[first:last + 1]))}")
    if len(trips) > len(parsed.loops):
        lines.append(f"  ({len(trips)} trip counts given, {len(parsed.loops)} loops found: the extra counts are unused)")
    per_warp = dynamic_estimate(parsed, trips)
    lines.append(f"  dynamic per program: {per_warp:,.0f} per warp x {num_warps} warps = {per_warp * num_warps:,.0f} "
                 f"warp-instructions; {_format_classes(dynamic_classes(parsed, trips))} (per warp)")
    if programs:
        lines.append(f"  dynamic per launch: {programs:,} programs x {per_warp * num_warps:,.0f} = "
                     f"{programs * per_warp * num_warps / 1e9:.3f} G warp-instructions")
    return "\n".join(lines)


def occupancy(registers: int, num_warps: int, shared: int) -> float:
    """Fraction of the 64 warps per SM an sm_90 SM can hold: registers (65,536 per SM, allocated
    per warp in units of 256), shared memory (228 KiB per SM, 1 KiB reserved per block) and the
    32 blocks per SM."""
    per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    by_registers = 65536 // (per_warp * num_warps)
    by_shared = (228 * 1024) // (shared + 1024)
    blocks = min(by_registers, by_shared, 32, 64 // num_warps)
    return blocks * num_warps / 64


def summary(report: str) -> str:
    registers = re.search(r"Used (\d+) registers", report)
    stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    text = f"{registers.group(1) if registers else '?'} registers"
    if stack:
        text += f", stack {stack.group(1)} B, spill stores {stack.group(2)} B, loads {stack.group(3)} B"
    return text


def fla_state_backward(K: int, V: int, H: int, disassemble: bool = False):
    """flash-linear-attention's reverse state pass (fla 0.6.0's
    ``chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64`` as its GDN-2 backward launches it: a
    per-key gate, bfloat16 q, k, w, dO and dv) at every configuration its autotuner chooses from;
    yields (label, num_warps, Compiled)."""
    try:
        from fla.ops.common import chunk_delta_h
    except ImportError as error:
        raise SystemExit(f"--fla needs flash-linear-attention 0.6.0 importable: {error}")
    kernel = chunk_delta_h.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64
    while not isinstance(kernel, triton.runtime.jit.JITFunction):  # under fla's autotuner and heuristics
        kernel = kernel.fn
    pointers = dict(q="bf16", k="bf16", w="bf16", g="fp32", gk="fp32", dht="fp32", dh0="fp32", do="bf16", dh="bf16",
                    dv="bf16", dv2="bf16", cu_seqlens="i32", chunk_offsets="i32")
    for BV in (32, 64):
        for num_warps in (2, 4):
            for num_stages in (1, 2, 3, 4):
                constants = dict(H=H, HV=H, K=K, V=V, BT=64, BV=BV, USE_G=False, USE_GK=True, USE_INITIAL_STATE=True,
                                 USE_FINAL_STATE_GRADIENT=True, STATE_V_FIRST=False, IS_VARLEN=False)
                compiled = build(kernel, pointers, dict(scale="fp32"), constants, num_warps, disassemble,
                                 num_stages=num_stages, sizes=())  # T is not specialised (do_not_specialize)
                yield f"fla BV={BV} stages={num_stages}", num_warps, compiled


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--arch", type=int, default=90, choices=sorted(ARCHS),
                        help="compute capability to compile for (90: H100/H200)")
    parser.add_argument("--dot", default="tf32", choices=["tf32", "tf32x3", "ieee"])
    parser.add_argument("--packed", action="store_true", help="the kernels as they run packed sequences")
    parser.add_argument("--B", type=int, default=8, help="batch rows, for --instructions' programs per launch")
    parser.add_argument("--T", type=int, default=4096, help="tokens, for --instructions' loop trips and programs")
    parser.add_argument("--H", type=int, default=16, help="heads, for --instructions' programs per launch")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="compile only these kernels (names as printed)")
    parser.add_argument("--variant", nargs="+", action="extend", default=[], metavar="NAME=VALUE",
                        help="set launch constants of the kernel modules first (VALUE a Python literal), e.g. "
                             "INTRA_FORWARD_WARPS=4; repeated, every one counts")
    parser.add_argument(
        "--instructions", action="store_true",
        help="disassemble each cubin (Triton's nvdisasm) and print: the static SASS instruction count by class "
             "(MMA tensor cores, FP32 = FFMA/FMUL/FADD/FMNMX, FSEL = float compares/selects, MUFU, CVT = "
             "F2F/F2FP/I2F..., LDG, STG, LDS, STS, SHFL, BAR, INT = integer address/index/mask arithmetic, MOVE, "
             "CONTROL, OTHER); the same per loop (a loop = a backward branch, from its target to itself); and an "
             "estimate of the dynamic warp-instructions per program: every instruction issued once per warp, times "
             "the trip counts of the loops around it. It assumes: each loop runs the trip count the kernel table "
             "gives for it at the given shape (a mean over programs where it varies, e.g. 1.5 for the key launch's "
             "loops over earlier and later sub-blocks), in order of the loops' ends in the SASS; a loop without one "
             "counts once (printed as 'trips unknown'); both sides of every forward branch run (if/else and "
             "predicated-off instructions are counted as issued). Static counts do not include stalls: compare "
             "variants of one kernel, not kernels.")
    parser.add_argument("--fla", action="store_true",
                        help="flash-linear-attention 0.6.0's reverse state pass instead, at each configuration of its "
                             "autotuner (fla importable), for comparison with ours (--only state_backward)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("TRITON_INTERPRET is set: unset it to compile")
    global ARCH
    ARCH = args.arch
    if args.fla:
        for label, warps, compiled in fla_state_backward(args.K, args.V, args.H, args.instructions):
            print(_line(label, warps, compiled), flush=True)
            if args.instructions:
                print(instruction_report(compiled.sass, [-(-args.T // 64)], warps), flush=True)
        return
    previous = set_launch({name: ast.literal_eval(value) for name, value in (v.split("=", 1) for v in args.variant)})
    try:
        inp = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[args.dtype]
        table = kernels(args.K, args.V, inp, args.dot, args.packed, args.B, args.T, args.H)
        for name, (kernel, pointers, scalars, constants, warps) in table.items():
            if args.only and name not in args.only:
                continue
            try:
                compiled = build(kernel, pointers, scalars, constants, warps, disassemble=args.instructions,
                                 maxnreg=forward.MAX_REGISTERS.get(name))
                print(_line(name, warps, compiled), flush=True)
                if args.instructions:
                    print(instruction_report(compiled.sass, LOOP_TRIPS.get(name, []), warps, PROGRAMS.get(name)),
                          flush=True)
            except Exception as error:  # report every kernel, keep going
                print(f"{name:16s} failed: {type(error).__name__}: {str(error)[:400]}", flush=True)
    finally:
        set_launch(previous)


def _line(name: str, warps: int, compiled: Compiled) -> str:
    line = f"{name:16s} {warps} warps, shared {compiled.shared / 1024:.1f} KiB, {summary(compiled.report)}"
    overwritten = overwritten_while_read(compiled.ttgir)
    if overwritten:
        line += f", RACE: {', '.join(overwritten)} overwritten while asynchronous products read them"
    if ARCH != 90:
        limit = ARCHS[ARCH][1]
        line += f", {'fits' if compiled.shared <= limit else 'DOES NOT FIT'} {ARCHS[ARCH][0]}'s {limit / 1024:.1f} KiB a block"
        return line
    registers = re.search(r"Used (\d+) registers", compiled.report)
    if registers:
        line += f", occupancy {occupancy(int(registers.group(1)), warps, compiled.shared):.1%}"
    if warps > 4:  # two or more warpgroups
        line += f", shared stores after a warpgroup's wait without a barrier: {stores_after_wait(compiled.ptx)}"
    return line


def set_launch(settings: dict) -> dict:
    """Set launch constants of the kernel modules (forward, backward, the operator) by name;
    returns the previous values (``bench/triton_h200.py``'s variants use it too)."""
    done = {}
    for name, value in settings.items():
        module = next((m for m in (forward, backward, operator) if hasattr(m, name)), None)
        if module is None:
            raise ValueError(f"no launch constant {name!r} in the forward, backward or operator module")
        done[name] = getattr(module, name)
        setattr(module, name, value)
    return done


# Trip counts of each kernel's loops (in the order of their ends in the SASS) and programs per
# launch at the shapes of ``kernels``, filled in by ``kernels``; means over programs where a
# count varies.
LOOP_TRIPS: dict[str, list[float]] = {}
PROGRAMS: dict[str, int] = {}


def kernels(K: int, V: int, inp: str, dot: str, packed: bool = False, B: int = 8, T: int = 4096, H: int = 16) -> dict:
    """Each kernel with the pointer dtypes and constants its launcher uses for (K, V), for packed
    sequences (``packed``) or a batch; sets ``LOOP_TRIPS`` and ``PROGRAMS`` for B sequences of T
    tokens and H heads."""
    f32 = "fp32"
    chunks = -(-T // 64)
    LOOP_TRIPS.clear()
    PROGRAMS.clear()
    heads = B * H
    key_blocks_of = lambda block: -(-K // block)  # noqa: E731
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: f32}
    input_dtype = next(dtype for dtype, name in names.items() if name == inp)

    def saved(name):  # the dtype of a saved buffer, as the operator allocates it
        return names[operator._saved_dtypes(input_dtype)[operator.SAVED.index(name)]]

    def gradient(name):  # the dtype of the reverse pass's d_leaving or d_U, as the operator allocates it
        return names[operator._gradient_dtype(name, input_dtype)]

    saved_states = saved("states")
    bk = max(16, triton.next_power_of_2(K))
    out = {}
    fk = forward
    bkd = saved("Wk") if fk.DECAYED_ERASE_KEYS_IN_WK else f32  # the buffer intra_forward gives b k exp(G)
    out["intra_forward"] = (
        fk._intra_forward_kernel,
        dict(q=inp, k=inp, g=inp, b=inp, P_out=saved("P"), A_out=f32, qd_out=saved("qd"),
             kd_out=saved("kd"), bkd_out=bkd, gamma_out=f32, key_first_bad_out="i32", chunk_table="i32"), {},
        dict(K=K, BK=min(fk.INTRA_FORWARD_KEY_BLOCK, bk), DOT=dot, PACKED=packed, STAGES=fk.INTRA_FORWARD_STAGES,
             SPAN_SUMS=fk.INTRA_FORWARD_SPAN_SUMS),
        fk.INTRA_FORWARD_WARPS,
    )
    LOOP_TRIPS["intra_forward"] = [key_blocks_of(min(fk.INTRA_FORWARD_KEY_BLOCK, bk))]
    PROGRAMS["intra_forward"] = chunks * heads
    out["inverse"] = (fk._inverse_kernel, dict(A=f32, X_out=saved("inverse")), {},
                      dict(PRECISION=dot), fk.INVERSE_WARPS)
    LOOP_TRIPS["inverse"] = []
    PROGRAMS["inverse"] = chunks * heads
    wy_blocks = dict(K=K, V=V, BK=min(fk.WY_BLOCK, bk), BV=min(fk.WY_BLOCK, max(16, triton.next_power_of_2(V))), DOT=dot,
                     PACKED=packed, BFLOAT16_PRODUCTS=fk.WY_BFLOAT16_PRODUCTS and saved("inverse") == bkd == "bf16")
    out["wy"] = (
        fk._wy_kernel,
        dict(v=inp, w=inp, X=saved("inverse"), bkd=bkd, key_first_bad="i32", Wk_out=saved("Wk"), Uw_out=saved("Uw"),
             Uw_scale_out=f32, first_bad_out="i32", chunk_table="i32"),
        {}, dict(wy_blocks, SCALED=saved("Uw") == "fp16"), fk.WY_WARPS,
    )
    LOOP_TRIPS["wy"] = [key_blocks_of(wy_blocks["BK"]), -(-V // wy_blocks["BV"])]
    PROGRAMS["wy"] = chunks * heads
    diagonal_pointers = dict(q=inp, k=inp, g=inp, b=inp, P_out=saved("P"), A_out=f32, chunk_table="i32")
    out["diagonal"] = (
        fk._diagonal_kernel, diagonal_pointers, {},
        dict(K=K, BK=fk.diagonal_key_block(K), DOT=dot, PACKED=packed, STAGES=fk.DIAGONAL_STAGES),
        fk.DIAGONAL_WARPS,
    )
    LOOP_TRIPS["diagonal"] = [key_blocks_of(fk.diagonal_key_block(K))]
    PROGRAMS["diagonal"] = 4 * chunks * heads
    state_bfloat16 = saved("Wk") == saved("kd") == "bf16"
    state_stages = fk.state_stages(bk, chunks, state_bfloat16)
    state_products = fk.state_products(state_bfloat16, state_stages)
    state_block = fk.state_value_block(V, heads, bk, state_products["SPLIT"], state_stages, ARCHS[ARCH][1])
    out["state_forward"] = (
        fk._state_forward_kernel,
        dict(Wk=saved("Wk"), kd=saved("kd"), Uw=saved("Uw"), Uw_scale=f32, gamma=f32, first_bad="i32", initial_state=f32,
             states=saved_states, U_out=saved("U"), final_state=f32, sequence_chunks="i32"),
        {}, dict(K=K, V=V, BK=bk, BV=state_block, HAS_INITIAL=True, STORE_FINAL=True, DOT=dot,
                 PACKED=packed, STAGES=state_stages, **state_products),
        fk.STATE_WARPS,
    )
    LOOP_TRIPS["state_forward"] = [chunks]
    PROGRAMS["state_forward"] = -(-V // state_block) * heads
    out["output"] = (
        fk._output_kernel,
        dict(qd=saved("qd"), P=saved("P"), states=saved_states, U=saved("U"), first_bad="i32", o=inp, chunk_table="i32"),
        dict(scale="fp32"),
        dict(K=K, V=V, BK=min(fk.OUTPUT_KEY_BLOCK, bk), BV=fk.chunk_value_block(V), DOT=dot, PACKED=packed,
             BFLOAT16_PRODUCT=fk.OUTPUT_BFLOAT16_PRODUCT),
        fk.OUTPUT_WARPS,
    )
    LOOP_TRIPS["output"] = [key_blocks_of(min(fk.OUTPUT_KEY_BLOCK, bk))]
    PROGRAMS["output"] = -(-V // fk.chunk_value_block(V)) * chunks * heads
    bw = backward
    rounded = bw.state_backward_rounded(saved("qd") == "bf16", input_dtype, K, chunks)
    out["state_backward"] = (
        bw._state_backward_kernel,
        dict(qd=saved("qd"), kd=saved("kd"), Wk=saved("Wk"), gamma=f32, P=saved("P"), d_o=inp, d_final=f32,
             d_leaving=gradient("d_leaving"), d_U=gradient("d_U"), d_initial=f32, chunk_table="i32",
             sequence_chunks="i32"),
        dict(scale="fp32"),
        dict(K=K, V=V, KB=bw.state_backward_key_block(K, rounded),
             BV=fk.value_block(V, heads, bw.STATE_BACKWARD_MIN_PROGRAMS), HAS_FINAL=True, STORE_INITIAL=True, DOT=dot,
             PACKED=packed,
             STAGES=bw.state_backward_stages(K, chunks, saved("qd") == "bf16", rounded, ARCHS[ARCH][1]),
             LOCAL_DU=bw.STATE_BACKWARD_LOCAL_DU, ROUNDED=rounded, SPLIT_DS=bw.STATE_BACKWARD_SPLIT_DS),
        bw.STATE_BACKWARD_WARPS,
    )
    if bw.STATE_BACKWARD_LOCAL_DU:
        out["local_values_gradient"] = (
            bw._local_values_gradient_kernel,
            dict(P=saved("P"), d_o=inp, d_U=gradient("d_U"), chunk_table="i32"),
            dict(scale="fp32"),
            dict(V=V, BV=fk.chunk_value_block(V), DOT=dot, PACKED=packed),
            4,
        )
        PROGRAMS["local_values_gradient"] = -(-V // fk.chunk_value_block(V)) * chunks * heads
    LOOP_TRIPS["state_backward"] = [chunks]
    PROGRAMS["state_backward"] = -(-V // fk.value_block(V, heads, bw.STATE_BACKWARD_MIN_PROGRAMS)) * heads
    blocks = dict(K=K, V=V, BKB=min(bw.INTRA_BACKWARD_KEY_BLOCK, max(32, bk)),
                  BV=min(bw.INTRA_BACKWARD_VALUE_BLOCK, max(32, triton.next_power_of_2(V))), C=64, DOT=dot,
                  PACKED=packed)
    out["intra_backward_contract"] = (
        bw._intra_backward_contract_kernel,
        dict(states=saved_states, U=saved("U"), d_o=inp, d_leaving=gradient("d_leaving"), d_U=gradient("d_U"),
             inverse=saved("inverse"), d_qd=f32, d_kd=f32, d_bkd=f32, d_gamma=f32, chunk_table="i32"),
        dict(scale="fp32"),
        dict(blocks, STAGES=bw.contract_stages(saved_states == "bf16"), STORED=bw.INTRA_BACKWARD_BFLOAT16_PRODUCTS),
        bw.INTRA_BACKWARD_WARPS,
    )
    out["intra_backward_values"] = (
        bw._intra_backward_values_kernel,
        dict(v=inp, w=inp, Wk=saved("Wk"), Uw=saved("Uw"), Uw_scale=f32, inverse=saved("inverse"), U=saved("U"), d_o=inp,
             d_U=gradient("d_U"),
             d_bkd=f32, d_A_scratch=f32, d_P_scratch=f32, dv=inp, dw=inp, chunk_table="i32"),
        dict(scale="fp32"), dict(blocks, STAGES=bw.VALUES_STAGES, STORED=bw.INTRA_BACKWARD_BFLOAT16_PRODUCTS,
                                 WARPGROUP_BARRIER=bw.values_warpgroup_barrier()),
        bw.INTRA_BACKWARD_WARPS,
    )
    LOOP_TRIPS["intra_backward_contract"] = [-(-V // blocks["BV"])]
    LOOP_TRIPS["intra_backward_values"] = [-(-V // blocks["BV"]), key_blocks_of(blocks["BKB"])]
    PROGRAMS["intra_backward_contract"] = chunks * heads * key_blocks_of(blocks["BKB"])
    PROGRAMS["intra_backward_values"] = chunks * heads
    out["intra_backward_keys"] = (
        bw._intra_backward_keys_kernel,
        dict(q=inp, k=inp, g=inp, b=inp, d_qd=f32, d_kd=f32, d_bkd=f32, sub_block_sums=f32,
             d_A_scratch=f32, d_P_scratch=f32, dq=inp, dk=inp, db=inp, chunk_table="i32"),
        {}, dict(K=K, BKB=min(bw.INTRA_BACKWARD_KEYS_BLOCK, bk), DOT=dot, PACKED=packed, STAGES=bw.KEYS_STAGES),
        bw.INTRA_BACKWARD_KEYS_WARPS,
    )
    keys_block = min(bw.INTRA_BACKWARD_KEYS_BLOCK, bk)
    PROGRAMS["intra_backward_keys"] = 4 * chunks * heads * key_blocks_of(keys_block)
    # The loops over earlier and later sub-blocks run 0 to 3 times (1.5 on average), the pairs
    # inside a sub-block 16 steps.
    LOOP_TRIPS["intra_backward_keys"] = [1.5, 1.5, 16]
    PROGRAMS["gate_gradient"] = chunks * heads * key_blocks_of(keys_block)
    out["gate_gradient"] = (
        bw._gate_gradient_kernel, dict(partial=f32, sub_block_sums=f32, gamma=f32, d_gamma=f32, dg=inp, chunk_table="i32"),
        {}, dict(K=K, BKB=min(bw.INTRA_BACKWARD_KEYS_BLOCK, bk), PACKED=packed), 4,
    )
    return out


if __name__ == "__main__":
    main()
