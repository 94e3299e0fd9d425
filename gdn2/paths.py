"""Path selection shared by both frameworks: reference, chunk or kernel.

Order of precedence: the ``path`` argument, then the ``GDN2_PATH`` environment variable, then
automatic (the kernel where it can run, else the chunk path). A requested kernel that cannot run
gives way to the chunk path with one warning; every choice is logged once at INFO on the
``gdn2`` logger.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

from .spec import PATHS

logger = logging.getLogger("gdn2")
_said: set[tuple] = set()


@dataclass(frozen=True)
class PathChoice:
    """Which path a call takes (``reference``, ``chunk`` or ``kernel``), and why."""

    path: str
    reason: str
    gave_way: bool = False  # a requested or failing kernel gave way to this path (warned once)

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


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


def announce(framework: str, choice: PathChoice) -> None:
    """Log a choice once; warn once when a requested or failing kernel gave way."""
    key = (framework, choice.path, choice.reason)
    if key in _said:
        return
    _said.add(key)
    message = f"gdn2.{framework}: {choice}"
    if choice.gave_way:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    logger.info(message)


def run_kernel(framework: str, kernel_name: str, kernel_call, ops, inputs, cu_seqlens, *args, fallback: str = "chunk"):
    """Run a kernel path's ``kernel_call(q, k, v, g, b, w, *args)``; None if it failed.

    Packed input (``cu_seqlens``) runs as a zero-padded batch of N rows, which is exact (see
    ``gdn2.algorithm.split_sequences``). A compile or launch failure is announced once, as giving way to
    ``fallback``, and the caller runs that path.
    """
    from .algorithm import join_sequences, split_sequences

    try:
        if cu_seqlens is None:
            return kernel_call(*inputs, *args)
        o, final_state = kernel_call(*(split_sequences(ops, x, cu_seqlens) for x in inputs), *args)
        return join_sequences(ops, o, cu_seqlens), final_state
    except Exception as error:  # a compile or launch failure gives way to the fallback path
        announce(framework, PathChoice(fallback, f"{kernel_name} failed: {type(error).__name__}: {error}", gave_way=True))
        return None
