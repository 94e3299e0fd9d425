"""``bench/accuracy_vs_fla.py``: gdn2's kernels and flash-linear-attention's on the same draws under
the interpreter. What runs without fla: its loop-index shim on a kernel of its own, the forms'
parsing, the table and the message when fla is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_scripts import load_bench

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

ROOT = Path(__file__).resolve().parents[1]
tool = load_bench("accuracy_vs_fla", "accuracy_vs_fla_under_test")


@triton.jit
def _cast_index_kernel(out):
    for i in range(4):  # the index cast as fla's kernels cast theirs
        tl.store(out + i, i.to(tl.int64) * 3)


def test_loop_index_casts_under_the_interpreter(monkeypatch):
    """The interpreter runs ``range`` indices as Python ints, which have no ``.to``; with the
    tool's ``range`` (as it sets in fla's modules) the kernel runs and stores what the GPU would."""
    out = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(Exception, match="has no attribute 'to'"):
        _cast_index_kernel[(1,)](out)
    monkeypatch.setitem(globals(), "range", tool._range)
    _cast_index_kernel[(1,)](out)
    assert out.tolist() == [0, 3, 6, 9]
    assert list(tool._range(2, 5)) == [2, 3, 4] and all(isinstance(i, int) for i in tool._range(3))


def test_forms_parse_and_refuse_by_name():
    assert tool.parse_form("GRADIENTS_IN_BFLOAT16=('d_leaving', 'd_U'); STATE_BACKWARD_STAGES=1") == dict(
        GRADIENTS_IN_BFLOAT16=("d_leaving", "d_U"), STATE_BACKWARD_STAGES=1)
    assert tool.parse_form("") == {}
    with pytest.raises(ValueError, match="--variant: expected NAME=VALUE, received 'STATE_BACKWARD_STAGES'"):
        tool.parse_form("STATE_BACKWARD_STAGES")


def test_table_counts_the_draws_at_or_below_fla():
    def errors(worst, name="db"):
        return {**dict(o=1e-3, final_state=1e-3), **{n: 1e-3 for n in tool.GRADIENTS}, name: worst}

    rows = [dict(shape=0, seed=1, form="", errors=errors(4e-3)), dict(shape=0, seed=1, form="fla", errors=errors(5e-3)),
            dict(shape=1, seed=1, form="", errors=errors(6e-3, "dk")), dict(shape=1, seed=1, form="fla", errors=errors(5e-3))]
    text = tool.table(rows, ["", "fla"])
    assert "| 0, 1 | 4.00e-03 (db) | 5.00e-03 (db) |" in text
    assert "| 1, 1 | 6.00e-03 (dk) | 5.00e-03 (db) |" in text
    assert "- gdn2: worst error median 5.00e-03, largest 6.00e-03; o median 1.00e-03; at or below fla's worst at 1 of 2 draws" in text


def test_without_fla_says_what_it_needs():
    try:
        import fla  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("flash-linear-attention is installed here")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "accuracy_vs_fla.py"), "--seeds", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "fla is not importable" in run.stderr and "--no-fla" in run.stderr, run.stderr


def test_draw_is_the_check_case_with_its_reset():
    """``draw`` gives ``bench/triton_h200.py``'s check inputs, with g set at the reset step only;
    the spec stays finite through a reset of -inf."""
    import numpy as np

    from gdn2.testing import make_case

    shape = (1, 20, 2, 8, 6, (-3.0, 0.0))
    plain = make_case(*shape[:5], 4, log_decay_range=shape[5], reference=False)["inputs"]
    case = tool.draw(shape, 4, (-np.inf, 7))
    g = case["inputs"]["g"]
    assert np.all(g[:, 7] == -np.inf)
    np.testing.assert_array_equal(np.delete(g, 7, axis=1), np.delete(plain["g"], 7, axis=1))
    np.testing.assert_array_equal(case["inputs"]["q"], plain["q"])
    assert all(np.all(np.isfinite(x)) for x in case["expected"].values())


@pytest.mark.parametrize("arguments, message", [
    (["--reset-step", "3"], "--reset-step: expected with --reset, received 3 without it"),
    (["--reset=-inf", "--reset-step", "200", "--shapes", "1"], r"--reset-step: expected 0 <= step < T = 200 at shape 1, received 200"),
    (["--shapes", "9"], "--shapes: expected indices 0 to 7, received 9"),
    (["--variant", "STATE_BACKWARD_STAGES"], "--variant: expected NAME=VALUE"),
])
def test_arguments_refused_by_name(arguments, message, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # where the script finds bench/triton_h200.py
    with pytest.raises(ValueError, match=message):
        tool.main(["--no-fla", *arguments])
