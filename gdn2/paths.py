"""Path selection and dispatch, written once for both frameworks: reference, chunk or kernel.

Order of precedence: the ``path`` argument, then the ``GDN2_PATH`` environment variable, then
automatic (the kernel where it can run, else the chunk path). A requested kernel that cannot run
gives way to the chunk path with one warning; every choice is logged once at INFO on the
``gdn2`` logger.

A framework (``gdn2.torch.ops``, ``gdn2.mlx.ops``) describes itself as a ``Framework``: its array
shim, its chunk path, and a loader for its ``KernelBackend``. ``run`` is then the whole of a call:
validate -> choose the path -> log the choice once -> run the kernel -> fall back.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Callable

from . import algorithm
from .packing import SequenceOffsets, join_sequences, split_sequences
from .spec import PATHS, default_scale, validate
from .xp import Ops

logger = logging.getLogger("gdn2")
_announced: set[tuple] = set()


@dataclass(frozen=True)
class PathChoice:
    """Which path a call takes (``reference``, ``chunk`` or ``kernel``), and why."""

    path: str
    reason: str
    gave_way: bool = False  # a requested or failing kernel gave way to this path (warned once)

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


@dataclass(frozen=True)
class KernelBackend:
    """What a kernel package gives the dispatch.

    ``unsupported_reason(q, k, v, g, b, w, initial_state, chunk_size)``: None when the kernels can
    run these validated arguments, else a short reason (a path choice, not an error).

    ``call(q=, k=, v=, g=, b=, w=, *, scale, initial_state, output_final_state)``: the kernel
    path, ``(o, final_state or None)``, differentiable like the other paths.

    ``failures``: the exception types ``call`` raises when a kernel fails to compile, to launch or
    to get its resources. Those give way to the next path with one warning; any other exception
    (a bug in a wrapper) propagates.

    ``automatic_reason(q)``: a reason to leave the kernel out of automatic selection only, while
    it still runs when asked for (None: no such reason).

    ``describe(q, k, v, g, b, w, initial_state, chunk_size)``: which of its kernels the package
    would run and why, added to the reason of a kernel choice (None: nothing to add).

    ``packed``: ``call`` takes packed sequences itself (``sequences=``, a ``SequenceOffsets``);
    otherwise the dispatch runs them as a zero-padded batch.
    """

    name: str
    unsupported_reason: Callable[..., str | None]
    call: Callable[..., tuple]
    failures: tuple[type[BaseException], ...]
    automatic_reason: Callable[..., str | None] = lambda q: None
    describe: Callable[..., str | None] = lambda *arguments: None
    packed: bool = False


@dataclass(frozen=True)
class Framework:
    """What one framework gives the dispatch.

    ``load_kernel()`` returns its ``KernelBackend``, or raises ``ImportError`` where the kernel
    package cannot be imported; it is called on every use, so that the backend reads its module's
    current attributes. ``chunk(q, k, v, g, b, w, *, scale, initial_state, chunk_size, sequences)``
    runs the chunk path and returns ``(o, final_state)``. ``kernel_runs_recurrent``: the kernel is
    a token-by-token scan, so ``recurrent_gdn2`` runs it where it can.
    """

    name: str  # "torch" or "mlx": the prefix of log lines
    ops: Ops
    kernel_name: str  # "Triton kernel", "Metal kernel"
    load_kernel: Callable[[], KernelBackend]
    chunk: Callable[..., tuple]
    kernel_runs_recurrent: bool = False
    # True while a graph compiler traces the call (torch.compile): the choice is then not logged,
    # since logging takes a lock that the tracer cannot follow (a graph break); eager calls log it.
    tracing: Callable[[], bool] = lambda: False


def requested_path(path: str | None) -> tuple[str | None, str]:
    """The path asked for by argument or environment (None: automatic), and who asked."""
    if path is not None:
        if path not in PATHS:
            raise ValueError(f"path: expected one of {', '.join(PATHS)} or None, received {path!r}")
        return path, "requested by the path argument"
    env = os.environ.get("GDN2_PATH", "").strip()
    if env:
        if env not in PATHS:
            raise ValueError(f"GDN2_PATH: expected one of {', '.join(PATHS)}, received {env!r}")
        return env, "requested by GDN2_PATH"
    return None, "automatic"


def choose(path: str | None, kernel_problem: str | None, kernel_name: str, auto_problem: str | None = None) -> PathChoice:
    """Decide the path.

    ``kernel_problem`` is None when the kernel can run, else why it cannot; ``auto_problem`` is a
    reason to leave the kernel out of automatic selection only (for example the Triton
    interpreter on CPU tensors, which runs only when asked for).
    """
    wanted, source = requested_path(path)
    if wanted in ("reference", "chunk"):
        return PathChoice(wanted, source)
    if wanted is None and kernel_problem is None and auto_problem is not None:
        kernel_problem = auto_problem
    if kernel_problem is None:
        return PathChoice("kernel", f"{kernel_name}, {source}")
    if wanted == "kernel":
        return PathChoice("chunk", f"{kernel_name} requested but unavailable: {kernel_problem}", gave_way=True)
    return PathChoice("chunk", f"automatic; {kernel_name} not used: {kernel_problem}")


def announce(framework: str, choice: PathChoice, stacklevel: int = 4) -> None:
    """Log a choice once; warn once when a requested or failing kernel gave way (``stacklevel``:
    the warning points at the caller of the public function)."""
    key = (framework, choice.path, choice.reason)
    if key in _announced:
        return
    _announced.add(key)
    message = f"gdn2.{framework}: {choice}"
    if choice.gave_way:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
    logger.info(message)


def forget_announcements() -> None:
    """Empty the once-only log, so that the next choices are logged (and fallbacks warned) again."""
    _announced.clear()


def load_kernel(framework: Framework) -> tuple[KernelBackend | None, str | None]:
    """The framework's kernel backend, or None and why it cannot be imported."""
    try:
        return framework.load_kernel(), None
    except ImportError as error:
        return None, f"{framework.kernel_name}s unavailable ({type(error).__name__}: {error})"


def which_path(framework: Framework, q, k, v, g, b, w, initial_state=None, chunk_size: int = 64, path: str | None = None) -> PathChoice:
    """The path ``run`` takes for these arguments, and why."""
    backend, problem = load_kernel(framework)
    automatic, name = None, framework.kernel_name
    if backend is not None:
        problem = backend.unsupported_reason(q, k, v, g, b, w, initial_state, chunk_size)
        automatic = backend.automatic_reason(q)
        if problem is None:
            detail = backend.describe(q, k, v, g, b, w, initial_state, chunk_size)
            name = name if detail is None else f"{name}: {detail}"
    return choose(path, problem, name, automatic)


def run(framework: Framework, q, k, v, g, b, w, *, scale, initial_state, output_final_state: bool, chunk_size: int,
        path: str | None, cu_seqlens):
    """One ``chunk_gdn2`` call: validate, choose the path, log it once, run it (a failing kernel
    gives way to the chunk path). Returns ``(o, final_state or None)``."""
    dims = validate(q, k, v, g, b, w, scale, initial_state, chunk_size, cu_seqlens, framework=framework.name,
                    output_final_state=output_final_state)
    scale = default_scale(dims.K, scale)
    choice = which_path(framework, q, k, v, g, b, w, initial_state, chunk_size, path)
    if not framework.tracing():
        announce(framework.name, choice)
    inputs = dict(q=q, k=k, v=v, g=g, b=b, w=w)
    if choice.path == "kernel":
        backend, _ = load_kernel(framework)
        result = run_kernel(framework, backend, inputs, dims.sequences, "chunk", scale=scale,
                            initial_state=initial_state, output_final_state=output_final_state)
        if result is not None:
            return result
    if choice.path == "reference":
        o, final_state = reference(framework.ops, inputs, scale, initial_state, dims.sequences)
    else:
        o, final_state = framework.chunk(**inputs, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                                         sequences=dims.sequences)
    return o, (final_state if output_final_state else None)


def run_recurrent(framework: Framework, q, k, v, g, b, w, *, scale, initial_state, output_final_state: bool,
                  chunk_size: int, cu_seqlens):
    """One ``recurrent_gdn2`` call: the kernel where the framework's kernel is a scan and can run
    these arguments (a failure gives way to the reference path), else the reference path."""
    dims = validate(q, k, v, g, b, w, scale, initial_state, chunk_size, cu_seqlens, framework=framework.name,
                    output_final_state=output_final_state)
    scale = default_scale(dims.K, scale)
    inputs = dict(q=q, k=k, v=v, g=g, b=b, w=w)
    if framework.kernel_runs_recurrent:
        backend, _ = load_kernel(framework)
        if backend is not None and backend.unsupported_reason(q, k, v, g, b, w, initial_state, chunk_size) is None:
            result = run_kernel(framework, backend, inputs, dims.sequences, "reference", scale=scale,
                                initial_state=initial_state, output_final_state=output_final_state)
            if result is not None:
                return result
    o, final_state = reference(framework.ops, inputs, scale, initial_state, dims.sequences)
    return o, (final_state if output_final_state else None)


def run_kernel(framework: Framework, backend: KernelBackend, inputs: dict, sequences: SequenceOffsets | None,
               fallback: str, **options):
    """``backend.call(**inputs, **options)``, or None after one warning if it raised one of the
    backend's ``failures`` (the caller then runs ``fallback``).

    Packed input goes to a backend that takes it natively (``backend.packed``), else runs as a
    zero-padded batch of N rows, which is exact (``gdn2.packing``).
    """
    padded = sequences is not None and not backend.packed
    if padded:
        inputs = {name: split_sequences(framework.ops, x, sequences) for name, x in inputs.items()}
    elif sequences is not None:
        options = dict(options, sequences=sequences)
    try:
        o, final_state = backend.call(**inputs, **options)
    except backend.failures as error:
        reason = f"{backend.name} failed: {type(error).__name__}: {error}"
        announce(framework.name, PathChoice(fallback, reason, gave_way=True), stacklevel=5)
        return None
    if padded:
        o = join_sequences(framework.ops, o, sequences)
    return o, final_state


def reference(ops: Ops, inputs: dict, scale: float, initial_state, sequences: SequenceOffsets | None):
    """The reference path: the recurrence in framework ops (float64 stays float64, everything
    else runs in float32), differentiated by the framework's autodiff. Returns ``(o in q's
    dtype, final_state)``."""
    q = inputs["q"]
    dtype = ops.compute_dtype(q)
    arrays = [ops.astype(inputs[name], dtype) for name in ("q", "k", "v", "g", "b", "w")]
    state = None if initial_state is None else ops.astype(initial_state, dtype)
    o, final_state = algorithm.recurrent(ops, *arrays, scale, state, sequences)
    return ops.astype(o, q.dtype), final_state
