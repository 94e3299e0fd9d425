"""``bench/layer.py --device cpu --small`` runs end to end without flash-linear-attention: the layer
rows, the glue rows (operator replaced by a no-op), the language-model rows and the JSON file;
with the Triton interpreter, the fused-kernel rows too."""

from __future__ import annotations

import argparse
import inspect
import json
import sys

import pytest
from bench_scripts import load_bench

torch = pytest.importorskip("torch")

from gdn2.torch import layer as layer_module  # noqa: E402



@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # flash-linear-attention absent, even where installed
    return load_bench("layer", "bench_layer")


def run(bench, tmp_path, *extra):
    out = tmp_path / "layer.json"
    rows = bench.main(["--device", "cpu", "--small", "--repeats", "1", "--warmup", "0", "--T", "20", "--lm-T", "20",
                       "--json", str(out), *extra])
    return rows, json.loads(out.read_text())


def test_small_cpu_run_without_fla(bench, tmp_path, monkeypatch, capsys, fresh_path_log):
    # The fused glue cannot run (as on a CPU without the interpreter): its rows say why. (Not by
    # unsetting TRITON_INTERPRET: Triton's own library, imported then, would stay compiled-mode.)
    monkeypatch.setattr(layer_module, "_glue_kernel_problem", lambda x: "tensors on cpu (a test)")
    with pytest.warns(RuntimeWarning, match="fused kernels requested but unavailable: tensors on cpu"):
        rows, written = run(bench, tmp_path)
    printed = capsys.readouterr().out
    assert "flash-linear-attention is not installed" in printed and "timing gdn2 only" in printed
    assert written["rows"] == rows and written["meta"]["fla"] is None
    by_name = {(row["what"], row["name"]): row for row in rows}
    assert set(by_name) == {("layer", "gdn2"), ("layer", "gdn2-plain-glue"),
                            ("language model step", "gdn2"), ("language model step", "gdn2-plain-glue")}
    assert "tensors on cpu (a test)" in by_name["layer", "gdn2"]["skipped"]
    plain = by_name["layer", "gdn2-plain-glue"]
    for key in ("forward_ms", "forward_backward_ms", "glue_forward_ms", "glue_forward_backward_ms"):
        assert plain[key] > 0
    step = by_name["language model step", "gdn2-plain-glue"]
    assert step["tokens_per_second"] == pytest.approx(2 * 20 / (step["step_ms"] / 1e3))


def test_small_cpu_run_with_the_fused_glue_under_the_interpreter(bench, tmp_path, capsys):
    rows, _ = run(bench, tmp_path)
    by_name = {(row["what"], row["name"]): row for row in rows}
    fused = by_name["layer", "gdn2"]
    assert "skipped" not in fused and fused["glue"].startswith("kernels")
    # The first row is the reference of the others: the fused glue against the plain glue, bf16 layers.
    assert by_name["layer", "gdn2-plain-glue"]["output_difference_to_gdn2"] < 3e-2
    assert by_name["language model step", "gdn2"]["step_ms"] > 0


def test_glue_variants_run_and_compare_with_the_default(bench, tmp_path, monkeypatch):
    """``--variants``: each variant's row is timed and compared with the default settings (the
    input gradient is formed the same way in both, the parameter gradients differ at most by the
    order of their sums, rounded to bf16), and the constants come back afterwards."""
    from gdn2.torch.triton import conv

    monkeypatch.setattr(bench, "GLUE_VARIANTS", [{"conv.BACKWARD_TILE_ELEMENTS": 2048}])
    rows, _ = run(bench, tmp_path, "--skip-lm", "--variants")
    (variant,) = [row for row in rows if row["what"] == "layer variant"]
    assert variant["forward_backward_ms"] > 0 and variant["input_grad_difference_to_default"] < 1e-6
    assert variant["worst_parameter_grad_difference_to_default"][1] < 1e-2
    assert conv.BACKWARD_TILE_ELEMENTS == 1024
    with pytest.raises(ValueError, match="conv has no launch constant 'NOT_A_SETTING'"):
        bench.set_glue_constants({"conv.NOT_A_SETTING": 1})


def test_the_noop_operator_leaves_only_the_glue(bench):
    """Same output shape and dtype as the operator, zero gradients for all six inputs."""
    q, k, g, b = (torch.randn(1, 3, 2, 4, requires_grad=True) for _ in range(4))
    v, w = (torch.randn(1, 3, 2, 5, requires_grad=True) for _ in range(2))
    o, state = bench.noop_operator(q, k, v, g=g, b=b, w=w)
    assert state is None and o.shape == v.shape and not o.any()
    o.sum().backward()
    assert all(x.grad is not None and not x.grad.any() for x in (q, k, v, g, b, w))


def test_cuda_requested_without_cuda_is_a_clear_error(bench, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--small"])
    assert "--device: cuda requested but this torch has no usable CUDA device" in capsys.readouterr().err


def test_check_compares_fused_and_plain_glue_under_the_interpreter(bench, capsys):
    """``--check`` at a tiny shape: float32 within its tolerance in every case; bf16 rows present
    with outputs at bf16 rounding (a few tokens make the summed bf16 gradients' verdict noisy)."""
    args = argparse.Namespace(hidden=64, heads=2, head_dim=16, T=12, seed=0)
    rows = bench.check_glue(args, bench.Device("cpu"))
    assert len(rows) == 16 and {r["case"] for r in rows} == {"dense", "padding", "packed", "decode"}
    assert all(r["margin"] <= 1 for r in rows if r["dtype"] == "float32"), rows
    assert all(r["output_error"] < 3e-2 for r in rows if r["dtype"] == "bfloat16"), rows


def test_resource_table_names_every_kernel_argument(bench):
    """``--resources`` compiles each glue kernel from this table (no GPU, no interpreter): every
    pointer, float scalar and constant it names is an argument, and every constexpr is given."""
    table = bench.glue_kernels(hidden=256, head_dim=128, inp="bf16")
    assert len(table) == 18
    for name, (kernel, pointers, scalars, constants, warps) in table.items():
        arguments = set(kernel.arg_names)
        assert set(pointers) | set(scalars) | set(constants) <= arguments, name
        parameters = inspect.signature(getattr(kernel, "fn", kernel)).parameters.values()
        constexprs = {p.name for p in parameters if "constexpr" in str(p.annotation)}
        assert constexprs == set(constants), (name, constexprs ^ set(constants))
        assert warps in (1, 2, 4, 8)
