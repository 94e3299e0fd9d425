"""Shared fixtures: every test draws fresh random inputs and prints its seed (shown on failure).

``TRITON_INTERPRET=1`` is set here, before anything imports Triton, because ``triton.jit``
decides at decoration time whether a kernel is compiled or interpreted. It does not send the
automatic CPU path to the kernels: on CPU tensors the Triton path runs only when asked for.
"""

from __future__ import annotations

import os
import random

os.environ["TRITON_INTERPRET"] = "1"

import pytest


@pytest.fixture
def seed() -> int:
    value = int.from_bytes(os.urandom(4), "little") if "GDN2_SEED" not in os.environ else int(os.environ["GDN2_SEED"])
    random.seed(value)
    print(f"seed={value} (rerun with GDN2_SEED={value})")
    return value


@pytest.fixture
def fresh_path_log():
    """The once-only path log emptied: this test sees every path choice logged and every fallback warned."""
    from gdn2 import paths

    paths.forget_announcements()
