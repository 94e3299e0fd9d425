"""The Triton interpreter (the Triton kernels on CPU tensors) is probed before it is reported as
the path a call takes, and the versions it needs are declared in pyproject.toml."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from gdn2.torch import chunk_gdn2, ops  # noqa: E402
from gdn2.torch import triton as kernel  # noqa: E402

NUMPY_24_ERROR = "only 0-dimensional arrays can be converted to Python scalars"  # Triton 3.6 with numpy 2.4


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("GDN2_PATH", raising=False)


@pytest.fixture
def broken_interpreter(monkeypatch, interpreter, fresh_path_log):
    """The kernels fail inside the interpreter as they do with Triton 3.6 and numpy 2.4; the probe
    runs afresh (and its verdict is restored afterwards)."""

    def failing_launch(*args, **kwargs):
        raise TypeError(NUMPY_24_ERROR)

    monkeypatch.setattr(kernel, "intra_forward", failing_launch)
    monkeypatch.setattr(ops, "_interpreter_probe", [], raising=False)


def small_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    x = [torch.rand(1, 5, 1, 16, generator=generator) for _ in range(6)]
    x[3] = -x[3]  # g <= 0
    return x


def test_which_path_reports_a_broken_interpreter(broken_interpreter, seed):
    """which_path says what will run: the chunk path, and why the kernels cannot."""
    choice = ops.which_path(*small_inputs(seed), path="kernel")
    assert choice.path == "chunk" and choice.gave_way, choice
    assert "the Triton interpreter fails here" in choice.reason and NUMPY_24_ERROR in choice.reason, choice.reason
    assert "triton>=3.9" in choice.reason, choice.reason


def test_a_broken_interpreter_gives_way_with_one_warning(broken_interpreter, seed):
    inputs = small_inputs(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o, _ = chunk_gdn2(*inputs, path="kernel")
        chunk_gdn2(*inputs, path="kernel")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "the Triton interpreter fails here" in messages[0], messages
    torch.testing.assert_close(o, chunk_gdn2(*inputs, path="chunk")[0])


def test_the_interpreter_runs_here_with_the_declared_versions(interpreter, seed):
    if version(triton.__version__) < (3, 9):
        pytest.skip(f"triton {triton.__version__}: the interpreter is declared for triton>=3.9")
    assert ops.interpreter_problem() is None
    assert ops.which_path(*small_inputs(seed), path="kernel").path == "kernel"


def test_versions_declared_in_pyproject():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11+")
    import tomllib

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("triton>=3.9") for r in extras["interpreter"]), extras["interpreter"]
    # GPU installs keep the Triton their torch build pins (3.6 and others): no triton>=3.9 there.
    for extra in ("torch", "all", "test"):
        assert not any(r.startswith("triton>=3.9") or "interpreter" in r for r in extras[extra]), (extra, extras[extra])
