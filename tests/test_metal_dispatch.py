"""The Metal entry (``gdn2.mlx.metal.dispatch.run``) through the harness: the forward and the
backward of a call may run different kernels, and every combination equals the float64 spec."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from gdn2.mlx import metal  # noqa: E402
from gdn2.mlx.metal import dispatch  # noqa: E402
from tests.metal_harness import harness  # noqa: E402
from tests.metal_harness.cases import NAMES, TOLERANCE, check_all, make_case  # noqa: E402


def run_entry(case, launcher):
    a = case["arrays"]
    d_o = mx.array(case["d_o"].astype(np.float32))
    d_final = mx.array(case["d_final"].astype(np.float32))

    def loss(*inputs):
        o, final = dispatch.run(*inputs[:6], scale=case["K"] ** -0.5, initial_state=inputs[6], output_final_state=True)
        return (o.astype(mx.float32) * d_o).sum() + (final * d_final).sum(), (o, final)

    with metal.use_launcher(launcher):
        (_, (o, final)), grads = mx.value_and_grad(loss, argnums=tuple(range(7)))(*(a[n] for n in NAMES))
        mx.eval(o, final, grads)
    return (o, final), dict(zip(NAMES, grads))


@pytest.mark.parametrize("forward,backward", [("scan", "chunked"), ("chunked", "scan")])
def test_forward_and_backward_on_different_kernels(forward, backward, monkeypatch, seed):
    monkeypatch.setattr(dispatch, "plan", lambda *args, **kwargs: dispatch.KernelPlan(forward, backward, "test"))
    case = make_case(1, 37, 2, 24, 40, seed)
    used = []

    def launcher(launch):
        used.append(launch.name)
        return harness.harness_launcher(launch)

    check_all(case, run_entry(case, launcher), TOLERANCE["float32"], seed)
    prefix = {"scan": "gdn2_scan_", "chunked": "gdn2_chunk_"}
    # the probe runs both families once; the call itself: the forward's kernels, then the backward's
    call = used[-(1 if forward == "scan" else 2) - (2 if backward == "scan" else 4):]
    assert call[0].startswith(prefix[forward]) and call[-1].startswith(prefix[backward]), call


@pytest.mark.parametrize("kind", ["scan", "chunked"])
def test_the_kernel_path_traces_under_mx_compile(kind, monkeypatch, seed):
    """``mx.compile`` around forward and backward: the wrappers read no array values, so the
    kernels are captured in the compiled graph (a second call launches nothing from Python).
    The launcher stands in for Metal with zeros of the right shapes (the harness needs concrete
    inputs, which a traced call does not have)."""
    monkeypatch.setenv("GDN2_METAL_KERNEL", kind)
    case = make_case(2, 37, 2, 24, 40, seed)
    a = case["arrays"]
    launches = []

    def zeros_launcher(launch):
        launches.append(launch.name)
        return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(launch.output_shapes, launch.output_dtypes)]

    def loss(*inputs):
        o, final = dispatch.run(*inputs[:6], scale=0.2, initial_state=inputs[6], output_final_state=True)
        return (o.astype(mx.float32) ** 2).sum() + final.sum()

    step = mx.compile(mx.value_and_grad(loss, argnums=tuple(range(7))))
    arrays = [a[n] for n in NAMES]
    with metal.use_launcher(zeros_launcher):
        dispatch.probe(dispatch.KernelPlan(kind, kind, "test"), mx.float32, 24, 40, 64)
        launches.clear()
        value, grads = step(*arrays)
        mx.eval(value, grads)
        traced = len(launches)
        value, grads = step(*arrays)
        mx.eval(value, grads)
    assert traced == (3 if kind == "scan" else 6) and len(launches) == traced
    assert [g.shape for g in grads] == [x.shape for x in arrays]
