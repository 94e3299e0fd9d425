"""The scripts of ``bench/`` (not a package) loaded as modules, for their tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str, module_name: str | None = None):
    """``bench/<script>.py`` as a fresh module (named ``module_name``, by default the script's)."""
    spec = importlib.util.spec_from_file_location(module_name or script, BENCH / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
