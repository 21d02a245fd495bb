"""``torch.cat``, ``torch.stack`` and ``F.max_pool2d`` as shifted reads: each model must be
one fused group with its neighbours, match eager on fresh random inputs at awkward shapes
in fp32, fp16 and bf16, and train like eager."""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser_core.specs import DEFAULT_TOLERANCES

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def fuse_and_compare(model, *inputs):
    """The fused model's output against eager's; returns the report."""
    with torch.no_grad():
        expected = model(*inputs)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(*inputs)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    tol = DEFAULT_TOLERANCES[str(expected.dtype).removeprefix("torch.")]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol.atol, rtol=tol.rtol)
    return fused.report()


def one_group_with(report, *ops):
    """The report's only fused group, which must hold ``ops``."""
    assert len(report.fused) == 1, f"expected one fused group:\n{report}"
    group = report.fused[0]
    assert all(op in group.ops for op in ops), f"{ops} not all in {group.ops}:\n{report}"
    return group


def trains_like_eager(model, *inputs, steps: int = 3):
    """A few SGD steps of the fused model and of a copy of ``model`` in eager give the same
    losses, input gradients and parameters."""
    eager = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    weights = None
    for _ in range(steps):
        results = []
        for net in (fused, eager):
            leaves = [x.detach().requires_grad_() for x in inputs]
            out = net(*leaves)
            if weights is None:
                weights = torch.randn(out.shape)
            loss = (out * weights).sum()
            loss.backward()
            results.append((loss.detach(), [x.grad for x in leaves]))
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        (loss_f, grads_f), (loss_e, grads_e) = results
        torch.testing.assert_close(loss_f, loss_e, atol=1e-4, rtol=1e-4)
        for ours, theirs in zip(grads_f, grads_e):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    for ours, theirs in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    report = fused.report()
    assert report.fused, str(report)
    return report


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
