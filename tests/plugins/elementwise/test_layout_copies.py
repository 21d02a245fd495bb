"""Layout copies inside fused groups: ``contiguous()``, ``clone(memory_format=...)`` and
``reshape`` of a tensor that is not viewable. Each must join the pointwise ops around
it, give eager's values, and, where it is a group's output, eager's strides (a later
``.view()`` depends on them)."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

import autofuser
from autofuser_core.specs import DEFAULT_TOLERANCES

from _helpers import fuse_and_compare, one_group_with, trains_like_eager

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def fused_outputs(model, *inputs):
    """(eager outputs, fused outputs, report) under no_grad, outputs as tuples."""
    with torch.no_grad():
        expected = model(*inputs)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(*inputs)
    wrap = lambda v: v if isinstance(v, tuple) else (v,)  # noqa: E731
    return wrap(expected), wrap(got), fused.report()


def assert_same(expected, got):
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape and g.stride() == e.stride()
        tol = DEFAULT_TOLERANCES[str(e.dtype).removeprefix("torch.")]
        torch.testing.assert_close(g.float(), e.float(), atol=tol.atol, rtol=tol.rtol)


class HeadsToPoints(nn.Module):
    """Transolver's structured-mesh layout: per-head values put back as points
    (``permute -> contiguous``), returned (a group's output) and read by the ops after it."""

    def forward(self, x):  # x: [B, H, N, D]
        y = x.permute(0, 2, 1, 3).contiguous()
        return y, torch.tanh(y * 1.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 7, 5), (2, 5, 13, 3)])
def test_contiguous_as_a_group_output_has_eagers_strides(dtype, shape):
    expected, got, report = fused_outputs(HeadsToPoints(), torch.randn(shape, dtype=dtype))
    one_group_with(report, "elementwise.contiguous", "elementwise.mul", "elementwise.tanh")
    assert_same(expected, got)
    b, _, n, _ = shape
    # the copy is row-major, as eager's: it can be viewed as points x channels
    torch.testing.assert_close(got[0].view(b, n, -1), expected[0].view(b, n, -1), rtol=0, atol=0)


class CopyInsideChain(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(channels))

    def forward(self, x):  # x: [B, C, H, W] -> [B, H, W, C]
        y = x.permute(0, 2, 3, 1).contiguous()
        return torch.sigmoid(y * self.scale) + y.clone(memory_format=torch.contiguous_format)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_contiguous_and_clone_inside_a_chain_are_one_kernel(dtype):
    model = CopyInsideChain(6).to(dtype)
    expected, got, report = fused_outputs(model, torch.randn(1, 6, 9, 7, dtype=dtype))
    one_group_with(report, "elementwise.contiguous", "elementwise.clone", "elementwise.sigmoid")
    assert_same(expected, got)


class ContiguousNoOp(nn.Module):
    def forward(self, x):
        y = (x * 2).contiguous()  # contiguous already: eager returns the product itself
        y.add_(1)  # so this writes into it, seen through both names
        return y, x * 2


def test_contiguous_of_a_contiguous_value_stays_the_same_tensor():
    x = torch.randn(3, 37)
    with torch.no_grad():
        expected = ContiguousNoOp()(x)
        fused = autofuser.fuse(ContiguousNoOp(), progress=False, tune=False, verify_speed=False)
        got = fused(x)
    assert_same(expected, got)


@pytest.mark.parametrize(
    "memory_format", [torch.preserve_format, torch.channels_last], ids=["preserve_format", "channels_last"]
)
def test_clone_in_other_formats_is_written_in_eagers_strides(memory_format):
    class Clone(nn.Module):
        def forward(self, x):  # the copy is one of the group's outputs: stored in eager's strides
            copy = x.permute(0, 3, 1, 2).clone(memory_format=memory_format)
            return copy, torch.tanh(copy + 1.0)

    expected, got, report = fused_outputs(Clone(), torch.randn(2, 5, 7, 3))
    assert_same(expected, got)
    assert any("elementwise.clone" in g.ops for g in report.fused), str(report)


class MergeHeads(nn.Module):
    """The einops head merge of attention outputs (``b h n d -> b n (h d)``): a permute,
    then a reshape eager copies; the merged tokens are returned and read by a chain."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(width))

    def forward(self, x):  # x: [B, H, N, D]
        merged = rearrange(x, "b h n d -> b n (h d)")
        return merged, F.gelu(merged * self.scale) + 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 13, 5), (2, 4, 7, 3)])
def test_head_merge_after_a_permute_is_read_in_the_chain(dtype, shape):
    model = MergeHeads(shape[1] * shape[3]).to(dtype)
    expected, got, report = fused_outputs(model, torch.randn(shape, dtype=dtype))
    one_group_with(report, "elementwise.reshape", "elementwise.gelu", "elementwise.mul")
    assert_same(expected, got)
    b, _, n, _ = shape
    torch.testing.assert_close(got[0].view(b * n, -1), expected[0].view(b * n, -1), rtol=0, atol=0)


class MergeThenNorm(nn.Module):
    """A merged reshape under a layer norm over the merged dim (rows layout: the merged
    coordinate walks the reduced axis) and a merge of a row dim with a reduced one."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)

    def forward(self, x):  # x: [B, C, N] -> channels last, points and channels merged in pairs
        tokens = x.transpose(1, 2).reshape(x.shape[0], -1, 2 * x.shape[1])
        return self.norm(torch.tanh(tokens)), tokens.sum(-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merged_reshape_under_a_reduction(dtype):
    model = MergeThenNorm(2 * 5).to(dtype)
    expected, got, report = fused_outputs(model, torch.randn(3, 5, 14, dtype=dtype))
    assert any("elementwise.reshape" in g.ops for g in report.fused), str(report)
    assert_same(expected, got)


def test_reshape_that_is_a_view_stays_a_free_view():
    class Split(nn.Module):
        def forward(self, x):
            return torch.relu(x.transpose(1, 2).reshape(2, 7, 3, 2) + 1.0)  # splits a dim: a view

    x = torch.randn(2, 6, 7)
    report = fuse_and_compare(Split(), x)
    one_group_with(report, "elementwise.relu")
    assert all("elementwise.reshape" not in g.ops for g in report.fused), str(report)


def test_reshape_of_a_computed_value_is_computed_at_the_reshaped_coordinates():
    class Reordered(nn.Module):
        def forward(self, x, y):  # eager's mul keeps x's permuted strides, so the reshape copies
            return (x.permute(0, 2, 1) * 2.0 + 1.0).reshape(x.shape[0], -1) * y

    x, y = torch.randn(3, 5, 11), torch.randn(3, 55)
    expected, got, report = fused_outputs(Reordered(), x, y)
    one_group_with(report, "elementwise.reshape", "elementwise.mul", "elementwise.add")
    assert_same(expected, got)


def test_layout_copies_train_like_eager():
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.merge, self.copy = MergeHeads(12), CopyInsideChain(3)

        def forward(self, x):  # x: [B, H, N, D], H = 3, D = 4
            merged, mixed = self.merge(x)
            copied = self.copy(x)  # [B, N, D, H]
            return merged * mixed + copied.reshape(merged.shape)

    trains_like_eager(Both(), torch.randn(2, 3, 7, 4))
