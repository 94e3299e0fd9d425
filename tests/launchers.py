"""Running a command on several processes of this machine, as users launch them: ``torchrun
--standalone`` (PyTorch, Gloo on the CPU) and ``mlx.launch --backend ring`` (MLX), for the
multi-process tests."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def fresh_seed() -> int:
    """A new seed per run (fresh random inputs); tests print it in their failure messages."""
    return random.SystemRandom().randrange(2**31)


def subprocess_environment() -> dict:
    """This environment for launched processes: the checkout on PYTHONPATH, one OpenMP thread (as
    torchrun sets), and without the test suite's TRITON_INTERPRET=1 (users' processes do not have
    it; with it, a process that ran the Triton interpreter's probe next to a Gloo process group
    was seen to abort at exit, 'terminate called without an active exception', about 1 run in 6)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("TRITON_INTERPRET", None)
    return env


def _run(command: list[str], timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    env = subprocess_environment()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-6000:]
        raise AssertionError(f"{' '.join(command)} failed with exit status {result.returncode}:\n{tail}")
    return result


def torchrun(nproc: int, arguments: list[str], timeout: float = 180, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc ARGUMENTS`` (``-m module ...`` or a script)."""
    pytest.importorskip("torch.distributed")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *arguments]
    return _run(command, timeout, cwd)


def mlx_launch(nproc: int, arguments: list[str], timeout: float = 180, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``mlx.launch -n nproc --backend ring -- python ARGUMENTS``."""
    if importlib.util.find_spec("mlx") is None:
        pytest.skip("mlx is not installed")
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        pytest.skip("mlx.launch is not on PATH")
    command = [launcher, "-n", str(nproc), "--backend", "ring", "--starting-port", str(free_ports(nproc)), "--",
               sys.executable, *arguments]
    return _run(command, timeout, cwd)


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports that are free now (mlx.launch's ring backend
    listens on its starting port plus the rank; its default, 32323, is taken by a launch already
    running, as in a test run on several workers)."""
    for _ in range(100):
        first = random.SystemRandom().randrange(20000, 60000 - count)
        try:
            for port in range(first, first + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports found")
