"""Sums over the rows of a row group (``GroupProgram.cross_reduces``): a layer norm's
weight and bias gradients computed in the kernel that computes its input gradient, each
program summing its rows into a partial row that the launcher adds up; and a lone sum
that leaves the graph joining the group that reads the same tensor (the planner's
``_join_siblings``)."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn

import autofuser
from autofuser_core.verify import DEFAULT_TOLERANCES

from _helpers import trains_like_eager


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


class NormGradients(nn.Module):
    """A layer norm's backward written out: the input gradient (row sums) beside the
    weight and bias gradients (sums over every row)."""

    def forward(self, x, g, w):
        mean = x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
        xhat = (x - mean) * rstd
        gw = g * w
        dx = (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True)) * rstd
        dw = (g * xhat).sum((0, 1))
        db = g.sum((0, 1))
        return dx, dw, db


def _fused(model, *inputs):
    with torch.no_grad():
        expected = model(*inputs)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(*inputs)
    return expected, got, fused.report()


def _close(got, expected):
    for ours, theirs in zip(got, expected):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        tol = DEFAULT_TOLERANCES[str(theirs.dtype).removeprefix("torch.")]
        # a sum over every row carries one rounding per row in eager's half-precision
        # intermediates: its atol scales with the rows summed
        scale = max(1.0, float(theirs.float().abs().max()))
        torch.testing.assert_close(ours.float(), theirs.float(), atol=tol.atol * scale, rtol=tol.rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 37, 24), (1, 5, 33), (2, 70, 7)], ids=lambda s: "x".join(map(str, s)))
def test_norm_gradients_in_one_kernel(shape, dtype):
    x, g = torch.randn(*shape, dtype=dtype), torch.randn(*shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    expected, got, report = _fused(NormGradients(), x, g, w)
    _close(got, expected)
    groups = [grp for grp in report.fused if grp.strategy == "row_reduction"]
    assert len(groups) == 1, str(report)
    sums = [n for n in report.fused[0].nodes if n.startswith("sum")]
    assert len(sums) == 2, f"the weight and bias gradients are not in the row kernel:\n{report}"
    assert not [n for n in report.unfused_nodes if not n.free], str(report)


class RowsOverTwoDims(nn.Module):
    """Rows over the last two dims, the cross sum over the first: its output [6, 10] is
    written from the kernel's flattened columns, which must land in the output's order."""

    def forward(self, x):
        centred = x - x.mean((1, 2), keepdim=True)
        return centred, (x * centred).sum(0)


def test_cross_sum_over_several_row_dims_keeps_the_output_order():
    x = torch.randn(4, 6, 10) + torch.arange(60.0).reshape(1, 6, 10)  # every column distinct
    expected, got, report = _fused(RowsOverTwoDims(), x)
    _close(got, expected)
    assert len(report.fused) == 1, str(report)


class CrossMax(nn.Module):
    def forward(self, x):
        return x - x.mean(-1, keepdim=True), x.amax(0)


class CrossSumReadAgain(nn.Module):
    def forward(self, x):
        s = x.sum(0, keepdim=True)
        return x - x.mean(-1, keepdim=True) + s


@pytest.mark.parametrize("model", [CrossMax(), CrossSumReadAgain()], ids=["max", "read_in_group"])
def test_other_mixes_of_reductions_stay_apart_and_right(model):
    """Only sums that are outputs and nothing else join the rows' kernel: a max over the
    rows (partial maxima are not summed), or a sum the group reads again, keep their own
    kernels (or eager), and the results are eager's."""
    x = torch.randn(13, 19)
    expected, got, report = _fused(model, x)
    _close(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,))
    for group in report.fused:
        has_row_reduction = any(op in group.ops for op in ("reduction.mean",))
        has_cross = any(op in group.ops for op in ("reduction.amax", "reduction.sum"))
        assert not (has_row_reduction and has_cross), str(report)


class NormBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return torch.nn.functional.gelu(self.norm(x))


def test_training_a_norm_sums_its_weight_gradients_in_the_backward_row_kernel():
    """The backward graph of a layer norm: its weight and bias gradients (sums over every
    row of the incoming gradient) are computed in the row kernel of the input gradient, not
    left to torch; parameters after a few steps equal eager's."""
    block = NormBlock(24)
    with torch.no_grad():  # not the identity LayerNorm starts as, whose gradients are special
        block.norm.weight.normal_()
        block.norm.bias.normal_()
    report = trains_like_eager(block, torch.randn(3, 41, 24))
    backward = [g for g in report.groups if g.phase == "backward" and g.fused]
    assert backward, str(report)
    lone_sums = [
        g for g in report.groups if g.phase == "backward" and not g.fused and all(n.startswith("sum") for n in g.nodes)
    ]
    assert not lone_sums, f"sums left to torch in backward:\n{report}"
    assert any(sum(n.startswith("sum") for n in g.nodes) >= 3 for g in backward), str(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_sum_kernel_compiles_for_sm90(dtype, tmp_path):
    """The interpreter accepts programs the GPU compiler refuses: the partial-row kernel
    is compiled for an H100/H200 (sm_90) with the config it launches with."""
    from _sm90 import _compile_for_sm90, _jobs_of

    x, g = torch.randn(2, 37, 24, dtype=dtype), torch.randn(2, 37, 24, dtype=dtype)
    fused = autofuser.fuse(NormGradients(), progress=False, tune=False, verify_speed=False)
    with torch.no_grad():
        fused(x, g, torch.randn(24, dtype=dtype))
    kernels = [k for k in fused.kernels() if k.source.partial_outputs]
    assert kernels, str(fused.report())
    _compile_for_sm90([job for k in kernels for job in _jobs_of(tmp_path, k)], tmp_path)


class CrossSumRoundedAndReadAgain(nn.Module):
    """In half precision the sum is rounded before it is an output: the rounding is read
    again in the group too, so the sum can't be one program's partial row there."""

    def forward(self, x):
        s = x.sum(0, keepdim=True)
        return x - x.mean(-1, keepdim=True) + s, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_sum_read_again_is_no_cross_sum_in_any_dtype(dtype):
    x = torch.randn(600, 24, dtype=dtype)  # many programs: a partial row is not the sum
    expected, got, report = _fused(CrossSumRoundedAndReadAgain(), x)
    _close(got, expected)
    assert not [g for g in report.groups if g.reason_code == "mismatch"], str(report)


class SiblingThroughAnotherGroup(nn.Module):
    """``last`` reads ``x`` as the norm group does, and ``b``, which a group reading the
    norm's mean computes: joining ``last`` to the norm group would close a cycle through
    that other group."""

    def forward(self, x, z):
        m = x.mean(-1, keepdim=True)
        r = x - m
        a = z * m
        b = z.amax(-1, keepdim=True)
        c = a + b
        last = x * b
        return r, c, last


def test_a_lone_op_joins_no_group_through_a_cycle():
    # rows of another width in z: ``last`` can't join the group computing ``b``
    x, z = torch.randn(2, 29, 24), torch.randn(2, 29, 13)
    expected, got, report = _fused(SiblingThroughAnotherGroup(), x, z)
    _close(got, expected)
    assert not [g for g in report.groups if g.reason_code == "cycle"], str(report)


def test_many_programs_add_their_partial_rows():
    """Far more rows than a program holds: the launcher adds many partial rows."""
    x, g = torch.randn(4, 300, 24), torch.randn(4, 300, 24)
    expected, got, report = _fused(NormGradients(), x, g, torch.randn(24))
    _close(got, expected)
    assert sum(n.startswith("sum") for n in report.fused[0].nodes) == 2, str(report)


def test_cross_sums_with_a_dynamic_row_count():
    """The rows' count at run time (docs/dynamic.md): every count's sums are eager's."""
    model = NormGradients()
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False, dynamic=True)
    w = torch.randn(24)
    with torch.no_grad():
        for n in (37, 53, 70):
            x, g = torch.randn(3, n, 24), torch.randn(3, n, 24)
            _close(fused(x, g, w), model(x, g, w))
            group = fused.report().fused[0]
            assert sum(node.startswith("sum") for node in group.nodes) == 2, str(fused.report())
            assert group.run_time_sizes, str(fused.report())  # one kernel source for every count


def test_a_nan_or_inf_in_one_row_reaches_its_column_of_the_sum():
    x, g = torch.randn(2, 90, 24), torch.randn(2, 90, 24)
    g[1, 77, 5] = float("nan")
    g[0, 3, 9] = float("inf")
    expected, got, report = _fused(NormGradients(), x, g, torch.randn(24))
    for ours, theirs in zip(got, expected):
        assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.isinf(), theirs.isinf())
        finite = theirs.isfinite()
        torch.testing.assert_close(ours[finite], theirs[finite], atol=1e-4, rtol=1e-4)
    assert sum(n.startswith("sum") for n in report.fused[0].nodes) == 2, str(report)
