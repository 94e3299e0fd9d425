"""The corrections gdn2 applies to Triton's CPU interpreter: ``tl.dot`` of bfloat16 tiles by value,
float32 to bfloat16 rounded to nearest even, elementwise operations, sums and scans of bfloat16
values by value (all as on the GPU), and scans with a combination of their own run by slices (the
element-by-element results, faster)."""

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from gdn2.torch.triton.interpreter import correct_bfloat16, scan_by_slices  # noqa: E402


@triton.jit
def _product_kernel(a, b, out, TRANSPOSE_A: tl.constexpr):
    r = tl.arange(0, 32)
    a_tile = tl.load(a + r[:, None] * 32 + r[None, :])
    b_tile = tl.load(b + r[:, None] * 32 + r[None, :])
    if TRANSPOSE_A:
        a_tile = tl.trans(a_tile)
    tl.store(out + r[:, None] * 32 + r[None, :], tl.dot(a_tile, b_tile, input_precision="ieee"))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("b_dtype", [torch.bfloat16, torch.float32])
def test_bfloat16_products_by_value(transpose, b_dtype):
    correct_bfloat16()
    correct_bfloat16()  # a second call changes nothing
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(32, 32, generator=generator).to(torch.bfloat16)
    b = torch.randn(32, 32, generator=generator).to(torch.bfloat16)
    if b_dtype == torch.float32:  # mixed operands: both widened to float32 by the caller
        a, b = a.float(), b.float()
    out = torch.empty(32, 32)
    _product_kernel[(1,)](a, b, out, TRANSPOSE_A=transpose)
    expected = (a.double().T if transpose else a.double()) @ b.double()
    np.testing.assert_allclose(out.double().numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


@triton.jit
def _round_kernel(x, stored, cast, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    values = tl.load(x + i, mask=i < n)
    tl.store(stored + i, values, mask=i < n)  # converted by the store (bfloat16 buffer)
    tl.store(cast + i, values.to(tl.bfloat16), mask=i < n)


def test_float32_to_bfloat16_rounds_to_nearest_even():
    """A store of float32 values into a bfloat16 buffer and ``.to(tl.bfloat16)`` round as torch
    (and the GPU) does: nearest, ties to even, carries into the exponent, overflow to inf, signed
    zeros, subnormals, infinities and NaN; uncorrected, the interpreter truncates."""
    correct_bfloat16()
    generator = torch.Generator().manual_seed(5)
    special = torch.tensor([
        1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8),  # ties: to even (down, up)
        1.0 + 2.0 ** -8 + 2.0 ** -20,  # just above a tie: up
        1.9999999, 3.4e38, -3.4e38,  # carries into the exponent; overflow to +-inf
        0.0, -0.0, 1e-40, -3e-39, float("inf"), -float("inf"), float("nan")], dtype=torch.float32)
    x = torch.cat([special, torch.randn(1000, generator=generator) * 10.0 ** torch.randint(-30, 30, (1000,), generator=generator)])
    n = x.numel()
    stored, cast = (torch.empty(n, dtype=torch.bfloat16) for _ in range(2))
    _round_kernel[(1,)](x, stored, cast, n, BLOCK=triton.next_power_of_2(n))
    expected = x.to(torch.bfloat16)
    for got in (stored, cast):
        assert torch.equal(got.view(torch.int16)[~x.isnan()], expected.view(torch.int16)[~x.isnan()])
        assert got[x.isnan()].isnan().all()


@triton.jit
def _pair_scan(a_sum, a_max, b_sum, b_max):  # not commutative in its use of the order: a sum and a max
    return a_sum * 0.5 + b_sum, tl.maximum(a_max, b_max - a_sum)


@triton.jit
def _scan_kernel(x, sums, maxima, AXIS: tl.constexpr, REVERSE: tl.constexpr):
    offsets = tl.arange(0, 16)[:, None] * 8 + tl.arange(0, 8)[None, :]
    tile = tl.load(x + offsets)
    s, m = tl.associative_scan((tile, tile * 2.0), AXIS, _pair_scan, reverse=REVERSE)
    tl.store(sums + offsets, s)
    tl.store(maxima + offsets, m)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_by_slices_matches_element_by_element(axis, reverse, monkeypatch):
    """``scan_by_slices`` gives bit for bit what the interpreter's own element loop gives, on an
    order-dependent combination of a pair, along either axis, forward and reverse."""
    from triton.runtime.interpreter import ScanOps

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(11))
    x[3, 2] = -float("inf")
    own = getattr(ScanOps.generic_scan, "element_by_element", ScanOps.generic_scan)
    results = []
    for by_slices in (False, True):
        monkeypatch.setattr(ScanOps, "generic_scan", own)  # the state before the test comes back after it
        if by_slices:
            scan_by_slices()
            scan_by_slices()  # a second call changes nothing
            assert ScanOps.generic_scan.by_slices
        sums, maxima = torch.empty(16, 8), torch.empty(16, 8)
        _scan_kernel[(1,)](x, sums, maxima, AXIS=axis, REVERSE=reverse)
        results.append((sums.numpy().copy(), maxima.numpy().copy()))
    for before, after in zip(results[0], results[1]):
        np.testing.assert_array_equal(before, after)
    assert np.isfinite(results[1][0]).sum() > 0


@triton.jit
def _elementwise_kernel(x, y, z, out, compared, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    a = tl.load(x + i)
    b = tl.load(y + i)
    c = tl.load(z + i)
    tl.store(out + i, a * b)
    tl.store(out + BLOCK + i, a + b)
    tl.store(out + 2 * BLOCK + i, a - b)
    tl.store(out + 3 * BLOCK + i, a / b)
    tl.store(out + 4 * BLOCK + i, -a)
    tl.store(out + 5 * BLOCK + i, tl.maximum(a, b))
    tl.store(out + 6 * BLOCK + i, tl.fma(a, b, c))
    tl.store(out + 7 * BLOCK + i, tl.cumsum(a, 0))
    tl.store(out + 8 * BLOCK + i, tl.sum(a, 0) + tl.zeros_like(a))
    tl.store(compared + i, (a < b).to(tl.int32))
    tl.store(compared + BLOCK + i, (a == b).to(tl.int32))


def test_bfloat16_elementwise_sums_and_scans_by_value():
    """Arithmetic, comparisons, sums and cumulative sums on bfloat16 values give what torch gives
    on the values, rounded to bfloat16 (each operation once; a sum and a scan once in all: the
    inputs are small integers and halves here, whose sums are exact); uncorrected, the interpreter
    works on the bit patterns (1.5 * 2 = 0, -1 < -2)."""
    correct_bfloat16()
    generator = torch.Generator().manual_seed(7)
    x, y, z = ((torch.randint(-8, 9, (16,), generator=generator) / 2).to(torch.bfloat16) for _ in range(3))
    y[y == 0] = 0.5  # a divisor
    y[3] = x[3]  # one equal pair
    out = torch.empty(9 * 16, dtype=torch.bfloat16)
    compared = torch.empty(2 * 16, dtype=torch.int32)
    _elementwise_kernel[(1,)](x, y, z, out, compared, BLOCK=16)
    a, b, c = (t.double() for t in (x, y, z))
    expected = [a * b, a + b, a - b, a / b, -a, torch.maximum(a, b), a * b + c, a.cumsum(0), a.sum().expand(16)]
    for index, want in enumerate(expected):
        assert torch.equal(out[16 * index:16 * (index + 1)], want.to(torch.bfloat16)), index
    assert torch.equal(compared[:16], (a < b).int()) and torch.equal(compared[16:], (a == b).int())
