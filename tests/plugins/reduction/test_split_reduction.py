"""The split-reduction strategy: reductions over rows longer than one program holds.

Small tensors reach it by lowering the row strategy's limit (``MAX_TILE``) and the
split strategy's tile (``TILE_LIMIT``), so the kernels loop over several steps in
several splits under the interpreter. Every case checks that the group ran as a
``split_reduction`` kernel (a wrong kernel would be un-fused by verification and the
numbers would still match) and compares against eager on fresh random inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autofuser
from autofuser_core.planner import plan_fusion_groups
from autofuser_core.specs import DEFAULT_TOLERANCES
from autofuser_plugins.reduction import split
from autofuser_plugins.reduction import strategy as row_strategy

from _helpers import trains_like_eager

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(params=[64, 1024], ids=["many-splits", "one-split"])
def long_rows(request, monkeypatch):
    """Rows of more than 64 elements count as too long; tiles of at most ``param`` elements
    (64: several steps in each of several splits, 1024: one split covers the row)."""
    monkeypatch.setattr(row_strategy, "MAX_TILE", 64)
    monkeypatch.setattr(split, "TILE_LIMIT", request.param)
    return request.param


def _fuse_and_check(model, *inputs):
    """The fused model's outputs against eager's; returns (report, fused)."""
    with torch.no_grad():
        expected = model(*inputs)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(*inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    for ours, theirs in zip(got, expected):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        tol = DEFAULT_TOLERANCES[str(theirs.dtype).removeprefix("torch.")]
        torch.testing.assert_close(ours.float(), theirs.float(), atol=tol.atol, rtol=tol.rtol, equal_nan=True)
    return fused.report(), fused


def _split_group(report):
    groups = [g for g in report.fused if g.strategy == "split_reduction"]
    assert len(groups) == 1, str(report)
    return groups[0]


class WeightAndBiasGradients(torch.nn.Module):
    """A norm's weight and bias gradients: sums over every point of [B, N, C]."""

    def forward(self, g, xhat):
        return (g * xhat).sum((0, 1)), g.sum((0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 37, 12), (1, 131, 7)], ids=["batch2", "batch1"])
def test_weight_and_bias_gradients_share_one_pass(long_rows, dtype, shape):
    g, xhat = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    report, fused = _fuse_and_check(WeightAndBiasGradients(), g, xhat)
    group = _split_group(report)
    assert group.ops == ["elementwise.mul", "reduction.sum", "reduction.sum"], str(report)
    assert len(report.fused) == 1, str(report)
    (kernel,) = fused.kernels()
    # the kept channels are contiguous: they run along the lanes, the points along the loop
    assert "kept dims along the lanes" in kernel.source.source
    assert "2 reduction(s) in one pass" in kernel.source.source
    if long_rows == 64:
        assert kernel.config["SPLITS"] > 1, kernel.config


class Sum(torch.nn.Module):
    def forward(self, x):
        return x.sum((0, 1))


def test_row_too_long_is_refused_by_rows_and_taken_by_split(long_rows):
    report, _ = _fuse_and_check(Sum(), torch.randn(3, 29, 5))
    _split_group(report)
    refused = [(g.strategy, g.reason_code) for g in report.groups if not g.fused]
    assert refused == [("row_reduction", "row_too_long")], str(report)


def test_short_rows_stay_with_the_row_strategy():
    report, _ = _fuse_and_check(WeightAndBiasGradients(), torch.randn(2, 9, 6), torch.randn(2, 9, 6))
    assert {g.strategy for g in report.fused} == {"row_reduction"}, str(report)
    assert not any(g.strategy == "split_reduction" for g in report.groups), str(report)  # not even proposed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 301), (1, 1, 173)], ids=["few-rows", "one-row"])
def test_sum_over_the_contiguous_last_dim_of_few_long_rows(long_rows, dtype, shape):
    class SumLast(torch.nn.Module):
        def forward(self, x):
            return torch.exp(x * 0.5).sum(-1)

    report, fused = _fuse_and_check(SumLast(), torch.randn(shape, dtype=dtype))
    _split_group(report)
    (kernel,) = fused.kernels()
    assert "reduced dims along the lanes" in kernel.source.source


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_per_channel_in_channel_first_layout(long_rows, dtype):
    class ChannelMean(torch.nn.Module):
        def forward(self, x):
            return x.mean((0, 2), keepdim=True)

    report, _ = _fuse_and_check(ChannelMean(), torch.randn(2, 3, 157, dtype=dtype))
    _split_group(report)


def test_a_permuted_input_reads_along_its_contiguous_dim(long_rows):
    """[B, C, N] memory read as [B, N, C]: the reduced points are contiguous after all."""

    class PermutedSum(torch.nn.Module):
        def forward(self, x):
            return x.permute(0, 2, 1).sum((0, 1))

    report, fused = _fuse_and_check(PermutedSum(), torch.randn(2, 6, 83))
    _split_group(report)
    assert "reduced dims along the lanes" in fused.kernels()[0].source.source


@pytest.mark.parametrize("op", ["amax", "amin"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_max_and_min_propagate_nan(long_rows, op, dtype):
    class Extreme(torch.nn.Module):
        def forward(self, x):
            return getattr(x, op)((0, 1))

    x = torch.randn(2, 61, 9, dtype=dtype)
    x[1, 40, 3] = float("nan")  # one channel, late in the row: in a later split
    report, fused = _fuse_and_check(Extreme(), x)
    _split_group(report)
    with torch.no_grad():
        got = fused(x)
    assert torch.isnan(got[3]) and not torch.isnan(got[torch.arange(9) != 3]).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_epilogue_with_a_per_channel_operand(long_rows, dtype):
    class Epilogue(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.randn(11, dtype=dtype))

        def forward(self, x):
            return torch.tanh(x.sum((0, 1), keepdim=True) / 7.0 + self.bias) * 3.0

    report, _ = _fuse_and_check(Epilogue(), torch.randn(3, 23, 11, dtype=dtype))
    group = _split_group(report)
    assert "elementwise.tanh" in group.ops, str(report)


def test_broadcast_prologue_operand_and_a_prologue_output(long_rows):
    """A per-channel scale read once per program, and a value of the prologue also an
    output: the first kernel stores it as it computes it. (A row sum of it beside the
    sum over the points would make the points' sum a cross sum of that row kernel,
    tests/core/test_cross_sums.py.)"""

    class Both(torch.nn.Module):
        def forward(self, g, x, scale):
            y = g * x * scale
            return y.sum((0, 1)), torch.sigmoid(y)

    report, _ = _fuse_and_check(Both(), torch.randn(2, 41, 10), torch.randn(2, 41, 10), torch.randn(10))
    _split_group(report)


def test_layer_norm_over_a_too_long_row_stays_eager_with_its_reason(long_rows):
    class Norm(torch.nn.Module):
        def forward(self, x):
            return F.layer_norm(x, (203,)) * 2.0

    report, _ = _fuse_and_check(Norm(), torch.randn(3, 203))
    assert not any(g.strategy == "split_reduction" for g in report.fused), str(report)
    reasons = {g.reason_code for g in report.groups if g.strategy == "split_reduction" and not g.fused}
    assert "nested_reduction" in reasons, str(report)


def test_a_centred_long_row_is_refused_as_a_second_pass(long_rows):
    class Centred(torch.nn.Module):
        def forward(self, x):
            return x - x.mean(-1, keepdim=True)

    report, _ = _fuse_and_check(Centred(), torch.randn(2, 150))
    reasons = {g.reason_code for g in report.groups if g.strategy == "split_reduction" and not g.fused}
    assert "reads_rows_again" in reasons, str(report)


def test_a_pooled_model_trains_like_eager(long_rows):
    """A mean over many points with a per-channel scale before it and a bias after it:
    the forward is one split reduction, and its backward (the scale's gradient sums over
    every point too) goes through the same strategies."""

    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.randn(12))
            self.bias = torch.nn.Parameter(torch.randn(12))

        def forward(self, x):
            return torch.tanh(x * self.scale).mean(1, keepdim=True) + self.bias

    torch.manual_seed(0)
    report = trains_like_eager(Pool(), torch.randn(2, 75, 12))
    forward = [g for g in report.fused if g.strategy == "split_reduction" and g.phase == "forward"]
    assert len(forward) == 1 and "elementwise.tanh" in forward[0].ops, str(report)
    backward = [g for g in report.fused if g.strategy == "split_reduction" and g.phase == "backward"]
    assert backward, str(report)


def test_a_layer_norm_block_over_many_points_trains_like_eager(long_rows):
    """The norm's rows are short (its width); its backward's weight and bias gradients sum
    over every point. Whatever runs them, training matches eager."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(12)

        def forward(self, x):
            return torch.nn.functional.gelu(self.norm(x)) + x

    torch.manual_seed(0)
    trains_like_eager(Block(), torch.randn(2, 45, 12))


def test_every_config_gives_the_same_sums(long_rows):
    """The default config is valid, the list holds several split counts, and the chain
    launched with each of a few valid configs gives eager's sums."""
    x = torch.randn(4, 250, 24)
    _, fused = _fuse_and_check(Sum(), x)
    (kernel,) = fused.kernels()
    gm = autofuser.capture(Sum(), x)
    (candidate,) = [c for c in plan_fusion_groups(gm, autofuser.load_plugins().registry).kept]
    program = candidate.program
    assert candidate.strategy.name == "split_reduction"
    assert split.is_valid(program, split.default_config(program)) is None
    valid = [c for c in split.configs(program) if split.is_valid(program, c) is None]
    splits = sorted({c["SPLITS"] for c in valid})
    assert len(splits) > 1 if long_rows == 64 else splits, splits
    by_splits = {c["SPLITS"]: c for c in valid}  # one config per split count
    for config in by_splits.values():
        out = torch.empty(24)
        kernel.kernel[(1,)](x, out, **kernel.source.launch_args(config))
        torch.testing.assert_close(out, x.sum((0, 1)), atol=1e-5, rtol=1e-4)


def test_a_dynamic_point_count_takes_its_size_at_run_time(long_rows, tmp_path):
    model = WeightAndBiasGradients()
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False, cache_dir=str(tmp_path))
    names = []
    for points in (37, 45, 61):  # one bucket (64): one source
        g, xhat = torch.randn(2, points, 12), torch.randn(2, points, 12)
        autofuser.mark_dynamic(g, 1)
        autofuser.mark_dynamic(xhat, 1)
        with torch.no_grad():
            got = fused(g, xhat)
        for ours, theirs in zip(got, model(g, xhat)):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
        group = _split_group(fused.report())
        assert group.run_time_sizes, str(fused.report())
        names.append(group.kernel)
    assert names[0] == names[1] == names[2]
