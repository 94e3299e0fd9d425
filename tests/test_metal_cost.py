"""The counted cost model of the Metal kernels and the choice between the scan and the chunked
kernels it drives; the estimates quoted in the kernel modules' docstrings are the model's."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from gdn2.mlx.metal import chunked, cost, dispatch, scan  # noqa: E402

SHAPE = (8, 4096, 16, 128, 128)  # B, T, H, K, V of the docstrings' tables (bf16)


def ms(costs) -> str:
    return f"{cost.estimate_seconds(costs) * 1e3:.3g} ms"


def test_docstring_estimates_are_the_models():
    chunk_costs, scan_costs = cost.chunked_cost(*SHAPE), cost.scan_cost(*SHAPE)
    assert f"forward {ms(chunk_costs[:2])}, forward+backward {ms(chunk_costs)}" in chunked.__doc__
    assert f"forward {ms(scan_costs[:1])}, forward+backward {ms(scan_costs)}" in scan.__doc__
    tokens = SHAPE[0] * SHAPE[1] * SHAPE[2]
    for costs, doc in ((chunk_costs, chunked.__doc__), (scan_costs, scan.__doc__)):
        for c in costs:
            flop = (c.matrix_flop + c.scalar_flop + c.scan_flop) / tokens / 1e3
            assert f"{flop:.1f}" in doc and f"{c.bytes / tokens:.0f}" in doc, c.name
    big = (8, 4096, 16, 256, 256)
    assert f"{chunked.training_bytes(*big) / 2**30:.1f} GiB at K=V=256" in chunked.__doc__
    assert f"{scan.backward_bytes(*big, 64) / 2**30:.1f} GiB at B=8 T=4096 H=16 K=V=256" in scan.__doc__


def test_the_chunked_docstring_quotes_the_scans_estimate():
    scan_costs = cost.scan_cost(*SHAPE)
    assert f"(the scan: {ms(scan_costs[:1])[:-3]} ms and {ms(scan_costs)}" in chunked.__doc__


def test_the_chunked_kernels_win_at_training_length_and_the_scan_at_decode():
    # 39.3 against 107 ms estimated (2.7x) since the scan's backward keeps its replayed states in registers
    assert cost.estimate_seconds(cost.chunked_cost(*SHAPE)) < cost.estimate_seconds(cost.scan_cost(*SHAPE)) / 2
    training = dispatch.plan(*SHAPE, mx.bfloat16, budget=64 * 2**30)
    assert (training.forward, training.backward) == ("chunked", "chunked")
    assert "estimated" in training.reason
    decode = dispatch.plan(4, 1, 16, 128, 128, mx.bfloat16, budget=64 * 2**30)
    assert (decode.forward, decode.backward) == ("scan", "scan") and "T == 1" in decode.reason
    # a few tokens of one head: the chunked kernels pad to a whole chunk of 32 and launch four times
    short = dispatch.plan(1, 4, 1, 64, 64, mx.bfloat16, budget=64 * 2**30)
    assert short.forward == "scan"


def test_the_chunked_backward_gives_way_to_the_scans_over_the_memory_budget():
    big = (8, 4096, 16, 256, 256)
    needed = chunked.training_bytes(*big)
    assert scan.backward_bytes(*big, 64) < needed
    roomy = dispatch.plan(*big, mx.bfloat16, budget=2 * needed)
    tight = dispatch.plan(*big, mx.bfloat16, budget=needed / 2)
    assert roomy.backward == "chunked"
    assert tight.backward == "scan" and "exceed" in tight.reason and tight.forward == "chunked"


def test_the_kernel_can_be_forced(monkeypatch):
    monkeypatch.setenv("GDN2_METAL_KERNEL", "scan")
    assert dispatch.plan(*SHAPE, mx.bfloat16).backward == "scan"
    monkeypatch.setenv("GDN2_METAL_KERNEL", "chunked")
    assert dispatch.plan(1, 1, 1, 8, 8, mx.float32).forward == "chunked"
    monkeypatch.setenv("GDN2_METAL_KERNEL", "fast")
    with pytest.raises(ValueError, match="GDN2_METAL_KERNEL"):
        dispatch.plan(*SHAPE, mx.bfloat16)
