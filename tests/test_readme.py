"""The README agrees with the code: the operator snippet's defaults, the imports it shows, what it
says about recurrent_gdn2, and how to install for CUDA."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FRAMEWORKS = ["torch", "mlx"]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def snippet_keywords() -> dict[str, str]:
    """``name=value`` of the chunk_gdn2 call in the operator snippet."""
    call = next(block for block in python_blocks() if "chunk_gdn2(" in block and "o, final_state" in block)
    return dict(re.findall(r"^\s+(\w+)=([^,]+),", call, flags=re.M))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_operator_snippet_shows_the_defaults(framework):
    module = pytest.importorskip(f"gdn2.{framework}")
    shown = snippet_keywords()
    signature = inspect.signature(module.chunk_gdn2).parameters
    assert set(shown) == {"scale", "initial_state", "output_final_state", "chunk_size", "path", "cu_seqlens"}
    for name, text in shown.items():
        assert eval(text) == signature[name].default, f"README shows {name}={text}, the default is {signature[name].default!r}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_what_the_readme_says_recurrent_gdn2_takes(framework):
    module = pytest.importorskip(f"gdn2.{framework}")
    chunk = set(inspect.signature(module.chunk_gdn2).parameters)
    recurrent = set(inspect.signature(module.recurrent_gdn2).parameters)
    assert chunk - recurrent == {"path"} and recurrent <= chunk
    assert "`recurrent_gdn2(...)` takes the same arguments except `path`" in README


def test_every_import_the_readme_shows_works():
    pytest.importorskip("torch")
    pytest.importorskip("mlx.core")
    lines = [line.split("#")[0].strip() for block in python_blocks() for line in block.splitlines()]
    imports = [line for line in lines if line.startswith(("from gdn2", "import gdn2"))]
    assert "from gdn2.torch import GatedDeltaNet2, GDN2LanguageModel, ModelConfig" in imports
    for line in imports:
        exec(line, {})
        exec(line.replace("gdn2.torch", "gdn2.mlx"), {})  # "or: from gdn2.mlx import ..."


def test_install_for_cuda_is_described():
    assert "https://download.pytorch.org/whl/cu" in README and "python -m gdn2 train --device cuda" in README
