"""bench/intra_forward_whatif.py: each edit of the intra-forward's source finds its target and
leaves Python source, so that no form times the baseline under another name."""

import ast
from pathlib import Path

import pytest
from bench_scripts import load_bench


@pytest.fixture
def whatif():
    return load_bench("intra_forward_whatif")


def test_every_form_edits_the_kernel(whatif):
    source = Path(whatif.SOURCE).read_text()
    forms = whatif.forms(source)
    assert forms["baseline"] == source
    for name, text in forms.items():
        ast.parse(text)  # still Python (a blanked statement is ``pass``)
        if name != "baseline":
            assert text != source, name

    def body(text, function):
        start, end = whatif._function(text, function)
        return text[start:end]

    loop = body(forms["no_stores"], "_off_diagonal_tiles")
    assert "_store_rows(qd_out" not in loop and "tl.store(gamma_out" not in loop
    assert "tl.store(key_first_bad_out" not in loop
    loop = body(forms["no_bkd_store"], "_off_diagonal_tiles")
    assert "_store_rows(bkd_out" not in loop and "_store_rows(qd_out" in loop
    for name in ("no_scans", "no_stores_no_scans"):
        assert "tl.cumsum(decay, 0)" not in body(forms[name], "_sub_block"), name
    assert "key_bad = tl.minimum(" not in body(forms["no_bad_rows"], "_sub_block")
    screened = body(forms["no_screening"], "_sub_block")
    assert "key_bad = tl.minimum(" not in screened and "_finite(" not in screened and "_decay(" not in screened
    assert "tl.store(key_first_bad_out" in body(forms["no_bad_rows"], "_off_diagonal_tiles")
    assert "P10 += tl.dot(" not in forms["no_P_dots"] and "A10 += tl.dot(" in forms["no_P_dots"]
    assert "return tl.exp(x)" in body(forms["tl_exp"], "_exp") and "tl.math.exp2" not in body(forms["tl_exp"], "_exp")


def test_an_edit_that_misses_fails(whatif):
    with pytest.raises((AssertionError, ValueError)):
        whatif.without_scans("def _sub_block():\n    return 0\n@triton.jit\n")
    with pytest.raises(AssertionError):
        whatif.without_P_products("def _off_diagonal_tiles():\n    x = 1\n@triton.jit\n")
    with pytest.raises((AssertionError, ValueError)):
        whatif.without_bad_rows("def _sub_block():\n    return 0\n@triton.jit\n")
    with pytest.raises((AssertionError, ValueError)):
        whatif.without_screening("def _sub_block():\n    return 0\n@triton.jit\n")
    with pytest.raises((AssertionError, ValueError)):
        whatif.with_tl_exp("def _exp(x):\n    return x\n@triton.jit\n")


def test_every_form_launches_under_the_interpreter(whatif, monkeypatch):
    """Each form's launch as the tool makes it (its arguments and launch constants), once, on a
    small shape: a form that could not launch would fail here, not on the GPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    times = whatif.main(["--device", "cpu", "--shape", "1,70,1,16"])
    assert set(times) == set(whatif.forms(Path(whatif.SOURCE).read_text()))
