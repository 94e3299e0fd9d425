"""The correction gdn2 applies to Triton's CPU interpreter: ``tl.dot`` of bfloat16 tiles by value."""

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from gdn2.torch.triton.interpreter import correct_bfloat16_dot  # noqa: E402


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
    correct_bfloat16_dot()
    correct_bfloat16_dot()  # a second call changes nothing
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(32, 32, generator=generator).to(torch.bfloat16)
    b = torch.randn(32, 32, generator=generator).to(torch.bfloat16)
    if b_dtype == torch.float32:  # mixed operands: both widened to float32 by the caller
        a, b = a.float(), b.float()
    out = torch.empty(32, 32)
    _product_kernel[(1,)](a, b, out, TRANSPOSE_A=transpose)
    expected = (a.double().T if transpose else a.double()) @ b.double()
    np.testing.assert_allclose(out.double().numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
