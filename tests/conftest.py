"""Shared fixtures: every test draws fresh random inputs and prints its seed (shown on failure)."""

from __future__ import annotations

import os
import random

import pytest


@pytest.fixture
def seed() -> int:
    value = int.from_bytes(os.urandom(4), "little") if "GDN2_SEED" not in os.environ else int(os.environ["GDN2_SEED"])
    random.seed(value)
    print(f"seed={value} (rerun with GDN2_SEED={value})")
    return value
