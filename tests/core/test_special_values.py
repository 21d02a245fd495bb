"""Special values through fused kernels: signed zeros and rows near fp32's range.

Eager (on CPU, where the tests run) keeps the sign of an exact zero through
tanh and clamp (maximum/minimum ties are not defined: eager's vector and
scalar loops on CPU pick different operands), gives +0.0 for a layer norm's zero
outputs, and accumulates variances in double, so rows of +-1e38 have a finite
standard deviation. Each test checks the fused group really ran (verification
would otherwise hide a wrong kernel behind the eager fallback) and compares
values and sign bits with eager.
"""

from __future__ import annotations

import pytest
import torch

import autofuser

# The values expected are eager's on CPU, where the kernels run under Triton's
# interpreter; CUDA's eager differs in places (its std accumulates in fp32).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="compares with eager's CPU results")


class Apply(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _fused_and_eager(fn, *xs):
    model = fn if isinstance(fn, torch.nn.Module) else Apply(fn)
    fused = autofuser.fuse(model, progress=False)
    with torch.no_grad():
        got, expected = fused(*xs), model(*xs)
    assert fused.report().fused, str(fused.report())
    return got, expected


def _assert_same_bits(got, expected):
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=1.5e-6, atol=0)
    zeros = expected == 0
    assert torch.equal(torch.signbit(got[zeros]), torch.signbit(expected[zeros])), (got, expected)


def _with_signed_zeros(shape, dtype=torch.float32):
    x = torch.randn(shape).to(dtype)
    flat = x.view(-1)
    flat[::3] = -0.0
    flat[1::7] = 0.0
    return x


SIGN_KEEPING = {
    "tanh": lambda x: torch.tanh(x) * 2.0,
    "clamp_min_zero": lambda x: x.clamp(min=0.0) * 2.0,
    "clamp_max_zero": lambda x: x.clamp(max=0.0) * 2.0,
    "clamp_both": lambda x: torch.clamp(x, -0.5, 0.0) * 2.0,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(SIGN_KEEPING))
def test_exact_zeros_keep_their_sign(name, dtype):
    torch.manual_seed(0)
    x = _with_signed_zeros((3, 37), dtype)
    got, expected = _fused_and_eager(SIGN_KEEPING[name], x)
    assert got.dtype == dtype
    zeros = expected == 0
    assert zeros.any()
    assert torch.equal(torch.signbit(got[zeros]), torch.signbit(expected[zeros])), name
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("affine", ["none", "weight_only", "weight_and_bias"])
def test_layer_norm_zeros_are_positive_as_in_eager(affine):
    torch.manual_seed(1)
    width = 7
    norm = torch.nn.LayerNorm(width, elementwise_affine=affine != "none", bias=affine == "weight_and_bias")
    if affine != "none":
        with torch.no_grad():
            norm.weight.copy_(torch.randn(width))
    rows = torch.randn(5, width)
    rows[0] = -0.0  # a row of negative zeros
    rows[1] = 2.5  # equal values: every deviation is exactly 0
    rows[2] = torch.tensor([1.0, 2, 3, 4, 5, 6, 7])  # the middle value is the mean
    rows[3, ::2] = -0.0

    class NormThenScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = norm

        def forward(self, x):
            return self.norm(x) * 2.0

    got, expected = _fused_and_eager(NormThenScale(), rows)
    _assert_same_bits(got, expected)


@pytest.mark.parametrize("op", ["std", "var"])
def test_variance_of_rows_near_the_fp32_range_does_not_overflow(op):
    torch.manual_seed(2)
    rows = torch.randn(4, 19)
    rows[0] = torch.tensor([1e38, -1e38] * 9 + [0.0])
    rows[1] = 3e37 * torch.randn(19)
    rows[2] = torch.randn(19) * 1e-30  # tiny: no underflow to 0 either
    fn = (lambda x: x.std(-1) * 2.0) if op == "std" else (lambda x: x.var(-1, keepdim=True) * 0.5)
    got, expected = _fused_and_eager(fn, rows)
    reference = (rows.double().std(-1) * 2.0) if op == "std" else (rows.double().var(-1, keepdim=True) * 0.5)
    # Where the result itself fits fp32, it is finite and accurate; where it does not, both give inf.
    torch.testing.assert_close(got.double(), reference.float().double(), rtol=2e-6, atol=0)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)


def test_variance_of_a_row_of_equal_values_and_of_a_row_with_nan():
    rows = torch.randn(3, 10)
    rows[0] = 4.0
    rows[1, 3] = float("nan")
    rows[2, 5] = float("inf")
    got, expected = _fused_and_eager(lambda x: x.std(-1, keepdim=True) + x.var(-1, keepdim=True), rows)
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert got[0].item() == 0.0
