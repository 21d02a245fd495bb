"""``torch.roll`` and ``F.pad`` inside pointwise chains: lowered as shifted reads
(``ctx.read_shifted``), each model must be one fused group with its neighbours, match
eager on fresh random inputs at awkward shapes in fp32, fp16 and bf16, and train like
eager (gradients of inputs and parameters over a few optimiser steps)."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _helpers import fuse_and_compare, one_group_with, trains_like_eager

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


class ShiftedWindowMix(nn.Module):
    """Swin-style: shift the window grid, mix, shift back (rolls by negative and positive
    amounts inside a pointwise chain)."""

    def __init__(self, channels: int, shift: int):
        super().__init__()
        self.shift = shift
        self.scale = nn.Parameter(torch.randn(channels))

    def forward(self, x):  # x: [B, H, W, C]
        shifted = torch.roll(x * self.scale, shifts=(-self.shift, -self.shift), dims=(1, 2))
        mixed = F.gelu(shifted + 1.0) * torch.sigmoid(shifted)
        return x + torch.roll(mixed, shifts=(self.shift, self.shift), dims=(1, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, shift", [((1, 7, 9, 5), 3), ((2, 6, 5, 3), -2)])
def test_roll_inside_an_elementwise_chain_is_one_kernel(dtype, shape, shift):
    model = ShiftedWindowMix(shape[-1], shift).to(dtype)
    report = fuse_and_compare(model, torch.randn(shape, dtype=dtype))
    one_group_with(report, "elementwise.roll", "elementwise.gelu", "elementwise.sigmoid", "elementwise.add")


class PaddedPointwise(nn.Module):
    """A boundary condition written as a pad between pointwise ops (a ghost-cell layer)."""

    def __init__(self, widths, mode: str = "constant", value: float = 0.0):
        super().__init__()
        self.widths, self.mode, self.value = widths, mode, value

    def forward(self, u):
        if self.mode == "constant":
            padded = F.pad(torch.tanh(u) * 2.0, self.widths, value=self.value)
        else:
            padded = F.pad(torch.tanh(u) * 2.0, self.widths, mode=self.mode)
        return F.silu(padded - 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "widths, mode",
    [((1, 1, 1, 1), "constant"), ((2, 1, 0, 2), "constant"), ((-1, 2, 1, -2), "constant"), ((2, 2, 1, 1), "reflect")],
)
def test_pad_feeding_a_pointwise_op_is_one_kernel(dtype, widths, mode):
    model = PaddedPointwise(widths, mode, value=-1.25)
    report = fuse_and_compare(model, torch.randn(1, 3, 9, 7, dtype=dtype))
    one_group_with(report, "elementwise.pad", "elementwise.tanh", "elementwise.silu")


@pytest.mark.parametrize("mode", ["replicate", "circular"])
def test_replicate_and_circular_pads_fuse(mode):
    report = fuse_and_compare(PaddedPointwise((2, 1, 1, 2), mode), torch.randn(2, 3, 5, 11))
    one_group_with(report, "elementwise.pad", "elementwise.silu")


def test_roll_and_pad_train_like_eager():
    model = nn.Sequential(ShiftedWindowMix(5, 2), PaddedPointwise((1, 2, 2, 1)))
    report = trains_like_eager(model, torch.randn(2, 7, 6, 5))
    assert any("elementwise.roll" in g.ops and "elementwise.pad" in g.ops for g in report.fused), str(report)


class RollOfAReduction(nn.Module):
    def forward(self, x):
        return torch.roll(torch.softmax(x, -1), 1, 1) + x


def test_a_reduction_read_at_shifted_rows_is_not_fused_with_its_roll():
    """A kernel computes each row's softmax only at that row: the roll of its result reads
    other rows, so the two stay separate kernels (and the numbers right)."""
    report = fuse_and_compare(RollOfAReduction(), torch.randn(3, 5, 11))
    assert not any("reduction.softmax" in g.ops and "elementwise.roll" in g.ops for g in report.fused), str(report)


class RollAfterLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(11, 13)

    def forward(self, x):
        return torch.roll(torch.relu(self.fc(x)), -1, 1) * 2


def test_a_product_never_joins_a_shifted_read():
    report = fuse_and_compare(RollAfterLinear(), torch.randn(2, 5, 11))
    assert not any("matmul.linear_module" in g.ops and "elementwise.roll" in g.ops for g in report.fused), str(report)
