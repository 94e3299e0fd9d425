"""Where a Triton kernel waits, instruction by instruction, from Nsight Compute's stall sampling.

Triton kernels have no CUDA source for Nsight Compute's source view, but its SASS view carries
the warp-stall samples of every instruction. On the GPU machine (a script that runs the op, e.g.
two forward+backward passes of ``chunk_gdn2(path="kernel")``; the second one profiled)::

    ncu --clock-control none --kernel-name-base function -k regex:_intra_forward_kernel \\
        --launch-skip 1 --launch-count 1 --section SourceCounters -o rep -f python3 script.py
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 bench/ncu_source.py sass.csv

prints the samples' share by stall reason, by window of consecutive instructions (with the
window's commonest opcodes: a loop shows up as a run of windows executed alike) and the
instructions with the most samples, each with its reasons.
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read(path: str) -> tuple[list[str], list[dict]]:
    """The stall-reason columns and one row per SASS instruction (numbers as floats)."""
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    start = next((i for i, row in enumerate(rows) if row and row[0] == "Address"), None)
    if start is None:
        raise ValueError(f"{path}: expected ncu's source page (a header row starting with 'Address'), found none")
    header = rows[start]
    if SAMPLES not in header or "Source" not in header:
        raise ValueError(f"{path}: expected the columns 'Source' and {SAMPLES!r} (--section SourceCounters), "
                         f"received {header}")
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    numeric = set(reasons) | {SAMPLES, EXECUTED}

    def value(text: str) -> float:
        try:
            return float(text.replace(",", ""))
        except ValueError:  # "-" or empty: no samples
            return 0.0

    instructions = []
    for row in rows[start + 1:]:
        if len(row) != len(header):
            continue
        entry = dict(zip(header, row))
        for name in numeric & entry.keys():
            entry[name] = value(entry[name])
        instructions.append(entry)
    return reasons, instructions


def opcode(source: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers (``@P0 LDG.E.64 ...`` -> LDG)."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def report(reasons: list[str], instructions: list[dict], window: int, top: int) -> str:
    total = sum(entry[SAMPLES] for entry in instructions)
    if total == 0:
        return f"{len(instructions)} instructions, no stall samples (was --section SourceCounters collected?)"
    lines = [f"{len(instructions)} instructions, {total:.0f} samples, "
             f"{sum(entry.get(EXECUTED, 0.0) for entry in instructions):.0f} warp instructions executed"]
    by_reason = {name: sum(entry[name] for entry in instructions) for name in reasons}
    lines += [f"  {name:32s} {share / total:6.1%}" for name, share in sorted(by_reason.items(), key=lambda x: -x[1])
              if share > 0]
    lines.append(f"by window of {window} instructions (share of samples, executed, commonest opcodes):")
    for first in range(0, len(instructions), window):
        part = instructions[first:first + window]
        samples = sum(entry[SAMPLES] for entry in part)
        opcodes = collections.Counter(opcode(entry["Source"]) for entry in part).most_common(4)
        lines.append(f"  [{first:5d}] {samples / total:6.1%} {sum(e.get(EXECUTED, 0.0) for e in part):12.0f}  "
                     + " ".join(f"{name}:{count}" for name, count in opcodes))
    lines.append(f"the {top} instructions with the most samples:")
    ranked = sorted(range(len(instructions)), key=lambda i: -instructions[i][SAMPLES])[:top]
    for index in ranked:
        entry = instructions[index]
        causes = sorted(((entry[name], name) for name in reasons if entry[name] > 0), reverse=True)[:3]
        lines.append(f"  [{index:5d}] {entry[SAMPLES] / total:6.1%}  {entry['Source'].strip()[:60]:60s}  "
                     + ", ".join(f"{name} {count / entry[SAMPLES]:.0%}" for count, name in causes))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass")
    parser.add_argument("--window", type=int, default=100, help="instructions per window")
    parser.add_argument("--top", type=int, default=15, help="instructions listed by samples")
    args = parser.parse_args()
    if args.window < 1 or args.top < 0:
        raise ValueError(f"--window: expected >= 1, received {args.window}; --top: expected >= 0, received {args.top}")
    print(report(*read(args.csv), args.window, args.top))


if __name__ == "__main__":
    main()
