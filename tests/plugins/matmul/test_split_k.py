"""Lone products of a few output tiles over a long K split K among their programs: each
program sums its share for its tile into an fp32 partial row of the output's size, and
the launcher adds the rows. A weight's gradient (``x^T dy`` over every point) and a
head's ``K^T V`` are such products; unsplit, their few tiles would leave most of the chip
idle."""

import pytest
import torch

import autofuser
from autofuser_plugins.matmul import strategy as matmul_strategy
from autofuser_plugins.matmul.strategy import SPLIT_MIN_K

from _helpers import DEFAULT_TOLERANCES, one_group_with, trains_like_eager


def fuse_and_judge(model, *inputs):
    """The fused model's output against float64 (the inputs widened), held to eager's own
    error there: a sum of thousands of terms rounds differently in each order, and where
    they cancel, eager itself misses the exact value by more than the dtype's tolerance of
    the result. Returns the report."""
    with torch.no_grad():
        eager = model(*inputs)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(*inputs)
        exact = model(*[x.double() for x in inputs])
    assert got.dtype == eager.dtype and got.shape == eager.shape
    tol = DEFAULT_TOLERANCES[str(eager.dtype).removeprefix("torch.")]
    bound = 4 * (eager.double() - exact).abs().max() + tol.atol + tol.rtol * exact.abs()
    assert bool(((got.double() - exact).abs() <= bound).all()), float((got.double() - exact).abs().max())
    return fused.report()


class HeadGram(torch.nn.Module):
    """``K^T V`` per batch entry and head, over the points (as the backward graph of a
    Galerkin attention computes its context's gradient)."""

    def forward(self, k, v):
        return k.transpose(-2, -1) @ v


class WeightGrad(torch.nn.Module):
    """``x^T dy`` over every row, as a linear layer's weight gradient is."""

    def forward(self, x, dy):
        return x.transpose(0, 1) @ dy


@pytest.mark.parametrize(
    ("batch", "heads", "points", "d", "e"),
    [(1, 1, SPLIT_MIN_K + 77, 16, 16), (3, 2, SPLIT_MIN_K + 519, 16, 20), (2, 1, 1500, 5, 33)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_head_gram_splits_k_and_equals_eager(batch, heads, points, d, e, dtype):
    k = torch.randn(batch, heads, points, d, dtype=dtype)
    v = torch.randn(batch, heads, points, e, dtype=dtype)
    group = one_group_with(fuse_and_judge(HeadGram(), k, v))
    source = group.kernel_source
    assert "SPLIT_K: tl.constexpr" in source and "k_hi = tl.minimum(k_lo + k_per" in source, source
    assert group.config["SPLIT_K"] >= 2, group.config


@pytest.mark.parametrize(("rows", "n_in", "n_out"), [(4 * 1021, 40, 24), (SPLIT_MIN_K, 16, 16)])
def test_weight_gradient_splits_k_and_equals_eager(rows, n_in, n_out):
    x, dy = torch.randn(rows, n_in), torch.randn(rows, n_out)
    group = one_group_with(fuse_and_judge(WeightGrad(), x, dy), "matmul.matmul")
    assert "SPLIT_K" in group.config and "SPLIT_K: tl.constexpr" in group.kernel_source


def test_the_partial_rows_are_summed_against_float64():
    """A split sums each share in fp32 and the shares' fp32 rows in fp32: its error against
    float64 is of eager's order, whatever the order of the terms."""
    k, v = torch.randn(2, 1, 4099, 16) * 3, torch.randn(2, 1, 4099, 16)
    fused = autofuser.fuse(HeadGram(), progress=False, tune=False, verify_speed=False)
    with torch.no_grad():
        got, eager = fused(k, v), HeadGram()(k, v)
    exact = HeadGram()(k.double(), v.double())
    assert (got.double() - exact).abs().max() <= 4 * (eager.double() - exact).abs().max() + 1e-5
    assert fused.report().fused[0].config["SPLIT_K"] >= 2


@pytest.mark.parametrize(
    ("shape", "split"),
    [
        ((2, 1, SPLIT_MIN_K - 1, 16), False),  # K short of SPLIT_MIN_K
        ((5, 1, SPLIT_MIN_K + 5, 16), False),  # 5 tiles on a chip of 8 multiprocessors: enough unsplit
        ((3, 1, SPLIT_MIN_K + 5, 16), True),  # 3 tiles: most of the chip idle
    ],
)
def test_only_few_tiles_over_a_long_k_split(shape, split, monkeypatch):
    monkeypatch.setattr(matmul_strategy, "multiprocessors", lambda: 8)
    k, v = torch.randn(shape), torch.randn(shape)
    group = one_group_with(fuse_and_judge(HeadGram(), k, v))
    assert ("SPLIT_K: tl.constexpr" in group.kernel_source) is split


class ScaledGram(torch.nn.Module):
    def forward(self, k, v):
        return (k.transpose(-2, -1) @ v) * 0.5 + 1.0


def test_a_product_with_an_epilogue_does_not_split():
    """The epilogue would have to run on the sum of the rows, after the kernel."""
    k, v = torch.randn(2, 2100, 16), torch.randn(2, 2100, 16)
    group = one_group_with(fuse_and_judge(ScaledGram(), k, v))
    assert "SPLIT_K" not in group.kernel_source and "SPLIT_K" not in group.config


def test_a_split_product_trains_like_eager():
    """Gradients flow through the split product as through eager's (its backward's own
    products are tall over the points too)."""
    trains_like_eager(HeadGram(), torch.randn(1, 2, 1300, 16), torch.randn(1, 2, 1300, 16))
