"""``torch.cat``, ``torch.stack`` and ``F.max_pool2d`` as shifted reads: each model must be
one fused group with its neighbours, match eager on fresh random inputs at awkward shapes
in fp32, fp16 and bf16, and train like eager."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser

from _helpers import fuse_and_compare, one_group_with, trains_like_eager

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


class CatThenGelu(nn.Module):
    """Two computed feature maps concatenated along ``dim`` and activated (a skip
    connection's merge, a multi-branch block)."""

    def __init__(self, dim: int, channels: int):
        super().__init__()
        self.dim = dim
        self.scale = nn.Parameter(torch.randn(channels, 1, 1))

    def forward(self, a, b):
        return F.gelu(torch.cat([a * self.scale, torch.tanh(b) - 1.0], dim=self.dim))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "dim, shape_a, shape_b",
    [(1, (1, 3, 7, 5), (1, 5, 7, 5)), (-1, (2, 3, 6, 5), (2, 3, 6, 2)), (0, (1, 3, 5, 9), (2, 3, 5, 9))],
)
def test_cat_of_two_computed_tensors_then_gelu_is_one_kernel(dtype, dim, shape_a, shape_b):
    model = CatThenGelu(dim, 3).to(dtype)
    a, b = torch.randn(shape_a, dtype=dtype), torch.randn(shape_b, dtype=dtype)
    report = fuse_and_compare(model, a, b)
    one_group_with(report, "conv.cat", "elementwise.gelu", "elementwise.tanh", "elementwise.mul")


class StackThenMix(nn.Module):
    """Components stacked into a vector field along a new dim, then mixed pointwise."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, u, v):
        return torch.sigmoid(torch.stack([u * 2.0, torch.sin(v), u - v], dim=self.dim)) * 3.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim, shape", [(0, (1, 9, 7)), (1, (3, 5, 11)), (-1, (2, 13))])
def test_stack_of_computed_tensors_is_one_kernel(dtype, dim, shape):
    u, v = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    report = fuse_and_compare(StackThenMix(dim), u, v)
    one_group_with(report, "conv.stack", "elementwise.sigmoid", "elementwise.sin")


def test_cat_and_stack_train_like_eager():
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.cat = CatThenGelu(1, 3)
            self.stack = StackThenMix(1)

        def forward(self, a, b):
            x = self.cat(a, b)
            return self.stack(x, x * 0.5)

    report = trains_like_eager(Both(), torch.randn(2, 3, 5, 7), torch.randn(2, 2, 5, 7))
    assert any("conv.cat" in g.ops for g in report.fused) and any("conv.stack" in g.ops for g in report.fused)


class PoolThenRelu(nn.Module):
    """A CNN encoder's downsampling: a pointwise op, a max-pool, ReLU."""

    def __init__(self, channels: int, **pool):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(channels, 1, 1))
        self.pool = nn.MaxPool2d(**pool)

    def forward(self, x):
        return F.relu(self.pool(x * 1.5 + self.shift))


POOLS = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 1), dilation=(2, 1)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pool", POOLS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
@pytest.mark.parametrize("shape", [(1, 3, 9, 7), (2, 3, 6, 11)])
def test_max_pool_then_relu_is_one_kernel(dtype, pool, shape):
    model = PoolThenRelu(shape[1], **pool).to(dtype)
    report = fuse_and_compare(model, torch.randn(shape, dtype=dtype))
    one_group_with(report, "conv.max_pool2d", "elementwise.relu", "elementwise.mul", "elementwise.add")


def test_max_pool_keeps_a_nan_it_meets():
    x = torch.randn(2, 3, 8, 8)
    x[0, 1, 3, 4] = float("nan")
    model = PoolThenRelu(3, kernel_size=3, stride=2, padding=1)
    with torch.no_grad():
        expected = model(x)
        got = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)(x)
    assert torch.equal(torch.isnan(got), torch.isnan(expected)) and torch.isnan(expected).any()
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_max_pool_trains_like_eager():
    report = trains_like_eager(PoolThenRelu(3, kernel_size=3, stride=2, padding=1), torch.randn(2, 3, 9, 7))
    assert any("conv.max_pool2d" in g.ops for g in report.fused), str(report)


def test_max_pool_with_indices_stays_eager():
    class WithIndices(nn.Module):
        def forward(self, x):
            values, indices = F.max_pool2d(x, 2, return_indices=True)
            return values.relu(), indices

    x = torch.randn(1, 2, 6, 6)
    fused = autofuser.fuse(WithIndices(), progress=False, tune=False, verify_speed=False)
    with torch.no_grad():
        got, expected = fused(x), WithIndices()(x)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])
    assert not any("conv.max_pool2d" in g.ops for g in fused.report().fused)
