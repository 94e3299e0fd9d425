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
    assert forms["baseline"][0] == forms["paired"][0] == forms["halves"][0] == source
    for name, (text, key_loop) in forms.items():
        ast.parse(text)  # still Python
        assert key_loop == dict(PAIRED=name.startswith("paired"), HALVES=name.startswith("halves")), name
        if name not in ("baseline", "paired", "halves"):
            assert text != source, name

    def body(text, function):
        start, end = whatif._function(text, function)
        return text[start:end]

    loop = body(forms["no_stores"][0], "_off_diagonal_tiles")
    assert "_store_rows(qd_out" not in loop and "tl.store(gamma_out" not in loop
    loop = body(forms["paired_no_stores"][0], "_off_diagonal_tiles_paired")
    assert "_store_rows(qd_out" not in loop and "tl.store(gamma_out" not in loop and "tl.store(key_first_bad_out" not in loop
    for name in ("no_scans", "paired_no_scans", "halves_no_scans"):  # every key-loop form scans in _sub_block
        assert "tl.cumsum(decay, 0)" not in body(forms[name][0], "_sub_block"), name
    assert "P10 += tl.dot(" not in forms["no_P_dots"][0] and "A10 += tl.dot(" in forms["no_P_dots"][0]


def test_an_edit_that_misses_fails(whatif):
    with pytest.raises((AssertionError, ValueError)):
        whatif.without_scans("def _sub_block():\n    return 0\n@triton.jit\n")
    with pytest.raises(AssertionError):
        whatif.without_P_products("x = 1\n")


def test_every_form_launches_under_the_interpreter(whatif, monkeypatch):
    """Each form's launch as the tool makes it (its arguments and launch constants), once, on a
    small shape: a form that could not launch would fail here, not on the GPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    times = whatif.main(["--device", "cpu", "--shape", "1,70,1,16"])
    assert set(times) == set(whatif.forms(Path(whatif.SOURCE).read_text()))
