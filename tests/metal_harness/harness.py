"""Run the exact Metal source that MLX generates for a kernel on the CPU.

1. ``generated_source(launch)``: trace the launch inside ``mx.export_function`` with
   ``verbose=True``; MLX 0.32 prints the complete generated kernel (header, signature with the
   buffer and thread-position parameters, body, template instantiation) while tracing, even
   where it cannot run Metal. The print goes to the C++ stdout, captured at file descriptor 1.
2. ``compile_launch``: append a trampoline that calls the instantiated kernel with buffers and
   thread ids, compile with g++ against ``metal_shim.h`` into a shared library (cached by hash).
3. ``run_launch``: run every threadgroup of the launch (fibers, see metal_shim.h) under several
   schedules, poisoning the outputs with NaN first; outputs that differ bit for bit between
   schedules raise ``ScheduleDependentResult`` (a missing barrier or another race).

``harness_launcher`` plugs this into ``gdn2.mlx.metal.use_launcher``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

HARNESS_DIR = Path(__file__).resolve().parent
SHIM = HARNESS_DIR / "metal_shim.h"
BUILD_DIR = Path(os.environ.get("GDN2_HARNESS_BUILD", Path(tempfile.gettempdir()) / "gdn2_metal_harness"))
SCHEDULES = (0, 1, 2)  # lowest thread first, highest first, seeded random
FIBER_STACK_BYTES = 1 << 16

_ATTRIBUTE_ARGUMENTS = {
    "thread_position_in_grid": "uint3{ids.tpig[0], ids.tpig[1], ids.tpig[2]}",
    "thread_position_in_threadgroup": "uint3{ids.tpitg[0], ids.tpitg[1], ids.tpitg[2]}",
    "threadgroup_position_in_grid": "uint3{ids.tgpig[0], ids.tgpig[1], ids.tgpig[2]}",
    "threads_per_threadgroup": "uint3{ids.tptg[0], ids.tptg[1], ids.tptg[2]}",
    "thread_index_in_simdgroup": "ids.lane",
    "simdgroup_index_in_threadgroup": "ids.simdgroup",
    "simdgroups_per_threadgroup": "ids.simdgroups",
}


class HarnessError(RuntimeError):
    """The harness could not run a kernel (compile error, deadlock, divergent barrier)."""


class ScheduleDependentResult(HarnessError):
    """Outputs differ between thread schedules: a missing barrier or another data race."""


_MX_TO_NP_RAW = {
    mx.float32: np.uint32,
    mx.int32: np.int32,
    mx.float16: np.uint16,
    mx.bfloat16: np.uint16,
    mx.uint32: np.uint32,
}
_RAW_VIEW = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16, mx.int32: mx.int32, mx.uint32: mx.uint32}


def to_raw(x: mx.array) -> np.ndarray:
    """The bytes of an MLX array as a C-contiguous numpy array (bfloat16 as uint16)."""
    return np.ascontiguousarray(np.array(x.view(_RAW_VIEW[x.dtype])))


def from_raw(raw: np.ndarray, dtype) -> mx.array:
    return mx.array(raw).view(dtype)


def _capture_fd1(run) -> str:
    sys.stdout.flush()
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)
        try:
            run()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return sink.read().decode()


_SOURCE_CACHE: dict[tuple, str] = {}


def generated_source(launch) -> str:
    """The complete kernel source MLX generates for this launch (what Metal would compile)."""
    key = (launch.name, launch.source, tuple(map(str, launch.template)),
           tuple((tuple(x.shape), str(x.dtype)) for x in launch.inputs))
    if key in _SOURCE_CACHE:
        return _SOURCE_CACHE[key]
    placeholders = [mx.zeros(x.shape, dtype=x.dtype) for x in launch.inputs]

    def traced(*inputs):
        saved = launch.inputs
        launch.inputs = list(inputs)
        try:
            return launch.call(verbose=True)
        finally:
            launch.inputs = saved

    printed = _capture_fd1(lambda: mx.export_function(lambda *args, **kwargs: None, traced, *placeholders))
    match = re.search(r"Generated source code for `[^`]*`:\n```\n(.*?)\n```", printed, re.S)
    if match is None:
        raise HarnessError(f"MLX printed no kernel source while tracing {launch.name}; output was:\n{printed[:2000]}")
    _SOURCE_CACHE[key] = match.group(1)
    return match.group(1)


@dataclass
class Parameter:
    type: str
    name: str
    attribute: str  # "buffer" or a thread-position attribute


def parse_signature(source: str) -> tuple[str, str, list[Parameter]]:
    """(kernel name, template arguments, parameters) of the generated kernel."""
    head = re.search(r"\[\[kernel\]\]\s+void\s+(\w+)\((.*?)\)\s*\{", source, re.S)
    instance = re.search(r"decltype\((\w+)<(.*?)>\)", source)
    if head is None:
        raise HarnessError("unexpected generated source: no [[kernel]] signature")
    parameters = []
    for text in re.split(r",\s*\n", head.group(2).strip()):
        found = re.match(r"(.*?)\s*\b(\w+)\s*\[\[(\w+)(?:\(\d+\))?\]\]\s*$", text.strip(), re.S)
        if found is None:
            raise HarnessError(f"cannot parse kernel parameter {text!r}")
        parameters.append(Parameter(found.group(1), found.group(2), found.group(3)))
    return head.group(1), None if instance is None else instance.group(2), parameters  # None: not a template


# `threadgroup T name[N]...;` (kernel scope): shared by the fibers of the running group.
_THREADGROUP_ARRAY = re.compile(
    r"\bthreadgroup\s+((?:const\s+)?[A-Za-z_][\w:]*(?:<[^;{}>]*>)?)\s+([A-Za-z_]\w*)\s*((?:\[[^\]\n]+\]\s*)+);")


def share_threadgroup_arrays(source: str) -> str:
    """Turn each threadgroup array declaration into storage shared by the fibers of the group,
    poisoned (0xFF bytes, NaN) when each threadgroup starts; the rest of the text is unchanged
    (the declaration and its poisoning stay on the declaration's line)."""
    return _THREADGROUP_ARRAY.sub(
        lambda m: f"static thread_local {m.group(1)} {m.group(2)}{m.group(3).rstrip()}; "
                  f"mtl_harness::threadgroup_array({m.group(2)}, sizeof({m.group(2)}));",
        source)


def translation_unit(source: str) -> str:
    """The C++ file: shim, the generated source (threadgroup arrays shared), and a trampoline."""
    name, template_args, parameters = parse_signature(source)
    arguments, buffer_index = [], 0
    for p in parameters:
        if p.attribute == "buffer":
            arguments.append(f"({p.type})buffers[{buffer_index}]")
            buffer_index += 1
        elif p.attribute in _ATTRIBUTE_ARGUMENTS:
            arguments.append(_ATTRIBUTE_ARGUMENTS[p.attribute])
        else:
            raise HarnessError(f"thread attribute {p.attribute} is outside the harness subset")
    instance = name if template_args is None else f"{name}<{template_args}>"
    call = f"{instance}(\n        " + ",\n        ".join(arguments) + ")"
    return (
        '#include "metal_shim.h"\n'
        "// ---- generated by MLX (verbatim but for threadgroup array declarations) ----\n"
        f"{share_threadgroup_arrays(source)}\n"
        "// ---- harness trampoline ----\n"
        'extern "C" int harness_launch(void** buffers, const unsigned* grid, const unsigned* group_size,\n'
        "                              int schedule, unsigned seed, char* error, int error_len) {\n"
        "  std::function<void(const mtl_harness::Ids&)> body = [&](const mtl_harness::Ids& ids) {\n"
        f"    {call};\n"
        "  };\n"
        f"  return mtl_harness::run_grid(grid, group_size, schedule, seed, {FIBER_STACK_BYTES}, body, error, error_len);\n"
        "}\n"
        'extern "C" unsigned long harness_threadgroup_bytes() { return mtl_harness::last_threadgroup_bytes; }\n'
    )


_LIBRARIES: dict[str, ctypes.CDLL] = {}


_FLAGS = ["-std=c++17", "-O1", "-g0", "-fPIC", "-w"]


def _precompiled_shim() -> Path:
    """A folder holding metal_shim.h and its precompiled header (halves each kernel's compile)."""
    text = SHIM.read_text()
    folder = BUILD_DIR / f"shim_{hashlib.sha256((text + ' '.join(_FLAGS)).encode()).hexdigest()[:20]}"
    if not (folder / "metal_shim.h.gch").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "metal_shim.h").write_text(text)
        partial = folder / f"metal_shim.h.{os.getpid()}.gch"
        result = subprocess.run(["g++", *_FLAGS, "-x", "c++-header", str(folder / "metal_shim.h"), "-o", str(partial)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise HarnessError(f"g++ rejected metal_shim.h:\n{result.stderr[-4000:]}")
        os.replace(partial, folder / "metal_shim.h.gch")
    return folder


def compile_source(source: str) -> ctypes.CDLL:
    """Compile a generated kernel into a shared library (cached on disk by content hash)."""
    unit = translation_unit(source)
    digest = hashlib.sha256((unit + SHIM.read_text() + " ".join(_FLAGS)).encode()).hexdigest()[:20]
    if digest in _LIBRARIES:
        return _LIBRARIES[digest]
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    library = BUILD_DIR / f"kernel_{digest}.so"
    if not library.exists():
        cpp = BUILD_DIR / f"kernel_{digest}.cpp"
        cpp.write_text(unit)
        partial = BUILD_DIR / f"kernel_{digest}.{os.getpid()}.so"
        flags = [*_FLAGS, "-shared", f"-I{_precompiled_shim()}"]
        result = subprocess.run(["g++", *flags, str(cpp), "-o", str(partial)], capture_output=True, text=True)
        if result.returncode != 0:
            raise HarnessError(f"g++ rejected the generated source ({cpp}):\n{result.stderr[-4000:]}")
        os.replace(partial, library)
    handle = ctypes.CDLL(str(library))
    handle.harness_launch.restype = ctypes.c_int
    handle.harness_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint),
                                      ctypes.POINTER(ctypes.c_uint), ctypes.c_int, ctypes.c_uint,
                                      ctypes.c_char_p, ctypes.c_int]
    handle.harness_threadgroup_bytes.restype = ctypes.c_ulong
    _LIBRARIES[digest] = handle
    return handle


last_threadgroup_bytes = 0  # threadgroup memory the last launch declared (measured by the shim)


def prepare(launches) -> None:
    """Generate and compile the sources of several launches at once (g++ runs in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    sources = [generated_source(launch) for launch in launches]
    units = {}
    for source in sources:
        units.setdefault(source, None)
    _precompiled_shim()
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        list(pool.map(compile_source, units))


class OutOfBounds(HarnessError):
    """A kernel wrote outside an output buffer (the guard bytes around it changed)."""


GUARD_BYTES = 4096


def guarded(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A copy of ``raw`` inside a larger block whose guard bytes (before and after) are 0xFF.

    0xFF bytes read as NaN in every float format, so a stray read pollutes the result; a stray
    write changes a guard byte, which ``run_launch`` reports. Returns (block, view of the data).
    """
    block = np.full(raw.nbytes + 2 * GUARD_BYTES, 0xFF, dtype=np.uint8)
    view = block[GUARD_BYTES : GUARD_BYTES + raw.nbytes].view(raw.dtype).reshape(raw.shape)
    view[...] = raw
    return block, view


def run_launch(launch, schedules=SCHEDULES, seed: int = 0, source: str | None = None) -> list[np.ndarray]:
    """Run a launch on the CPU under each schedule; return the raw outputs (numpy, by bytes)."""
    source = generated_source(launch) if source is None else source
    library = compile_source(source)
    inputs = [guarded(to_raw(x)) for x in launch.inputs]
    results = []
    for schedule in schedules:
        outputs = []
        for shape, dtype in zip(launch.output_shapes, launch.output_dtypes):
            raw = np.empty(shape, dtype=_MX_TO_NP_RAW[dtype])
            raw.view(np.uint8)[...] = 0xFF  # NaN in every float format: unwritten outputs show
            outputs.append(guarded(raw))
        pointers = (ctypes.c_void_p * (len(inputs) + len(outputs)))(
            *[view.ctypes.data for _, view in inputs], *[view.ctypes.data for _, view in outputs])
        grid = (ctypes.c_uint * 3)(*launch.grid)
        threadgroup = (ctypes.c_uint * 3)(*launch.threadgroup)
        error = ctypes.create_string_buffer(1024)
        status = library.harness_launch(pointers, grid, threadgroup, schedule, seed, error, len(error))
        if status != 0:
            raise HarnessError(f"{launch.name}: {error.value.decode()}")
        global last_threadgroup_bytes
        last_threadgroup_bytes = int(library.harness_threadgroup_bytes())
        for name, (block, _) in zip(launch.input_names + launch.output_names, inputs + outputs):
            if np.any(block[:GUARD_BYTES] != 0xFF) or np.any(block[-GUARD_BYTES:] != 0xFF):
                raise OutOfBounds(f"{launch.name}: a write landed just outside buffer {name}")
        results.append([view.copy() for _, view in outputs])
    for schedule, outputs in zip(schedules[1:], results[1:]):
        for name, first, other in zip(launch.output_names, results[0], outputs):
            if not np.array_equal(first, other):
                differing = int(np.count_nonzero(first != other))
                raise ScheduleDependentResult(
                    f"{launch.name}: output {name} differs between schedule {schedules[0]} and schedule {schedule} "
                    f"in {differing} of {first.size} elements (missing threadgroup_barrier or a data race)")
    return results[0]


def harness_launcher(launch) -> list[mx.array]:
    """A ``gdn2.mlx.metal`` launcher that runs the exact generated source on the CPU."""
    outputs = run_launch(launch)
    return [from_raw(raw, dtype) for raw, dtype in zip(outputs, launch.output_dtypes)]
