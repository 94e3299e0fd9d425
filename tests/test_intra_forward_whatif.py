"""bench/intra_forward_whatif.py: each edit of the intra-forward's source finds its target and
leaves Python source, so that no form times the baseline under another name."""

import ast
import importlib.util
from pathlib import Path

import pytest


@pytest.fixture
def whatif():
    path = Path(__file__).resolve().parents[1] / "bench" / "intra_forward_whatif.py"
    spec = importlib.util.spec_from_file_location("intra_forward_whatif", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_form_edits_the_kernel(whatif):
    source = Path(whatif.SOURCE).read_text()
    forms = whatif.forms(source)
    assert forms["baseline"] == source
    for name, text in forms.items():
        ast.parse(text)  # still Python
        if name != "baseline":
            assert text != source, name
    start, end = whatif._key_loop(forms["no_stores"])
    loop = forms["no_stores"][start:end]
    assert "_store_rows(qd_out" not in loop and "tl.store(gamma_out" not in loop
    start = forms["no_scans"].index("def _sub_block(")
    assert "tl.cumsum(decay, 0)" not in forms["no_scans"][start:forms["no_scans"].index("@triton.jit", start)]
    assert "P10 += tl.dot(" not in forms["no_P_dots"] and "A10 += tl.dot(" in forms["no_P_dots"]


def test_an_edit_that_misses_fails(whatif):
    with pytest.raises((AssertionError, ValueError)):
        whatif.without_scans("def _sub_block():\n    return 0\n@triton.jit\n")
    with pytest.raises(AssertionError):
        whatif.without_P_products("x = 1\n")
