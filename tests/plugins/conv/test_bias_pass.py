"""With gradients on, a convolution cuDNN runs adds its bias after it (``plugins/conv/
bias_pass.py``): the add joins the pointwise group around the result and the group's
backward takes the bias's gradient as a column sum. Fresh random inputs at odd sizes,
batch 1 and 3; gradients against eager's, in fp32 and under bf16 autocast; where a
condition fails (no gradients, a frozen bias, a convolution the implicit-GEMM strategy
takes, hooks, the option off) the convolution keeps its bias."""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
import torch.nn as nn

import autofuser

from _helpers import trains_like_eager

#: bf16 autocast: products rounded to bf16 on both sides, the result once more here.
BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


class _Convs(nn.Module):
    """Two 3x3 convolutions whose reductions (20 and 24 channels x 9 taps) are past the
    implicit-GEMM strategy's, so cuDNN runs them, with pointwise ops after each."""

    def __init__(self, channels: int = 20):
        super().__init__()
        self.first = nn.Conv2d(channels, 24, 3, padding=1)
        self.second = nn.Conv2d(24, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.second(torch.relu(self.first(x))))


def _apart(report) -> int:
    """How many convolutions of the planned forward run as ``F.conv2d`` without their bias."""
    return sum(1 for n in report.graph if n.target.endswith("conv2d") and n.op == "call_function")


@pytest.mark.parametrize("batch", [1, 3])
def test_the_bias_gradient_is_a_fused_column_sum_and_training_matches_eager(batch):
    report = trains_like_eager(_Convs(), torch.randn(batch, 20, 9, 7), steps=2)
    assert _apart(report) == 2, str(report)
    backward_sums = [g for g in report.fused if g.phase == "backward" and "reduction.sum" in g.ops]
    assert len(backward_sums) == 2, str(report)


def test_under_autocast_the_gradients_match_eager():
    model = _Convs()
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    x = torch.randn(3, 20, 9, 7)
    for module in (reference, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, **BF16)
    assert _apart(fused.report()) == 2, str(fused.report())


def _forward_report(model, x, **options):
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False, **options)
    out = fused(x)
    if out.requires_grad:
        out.sum().backward()
    return fused.report()


@pytest.mark.parametrize("case", ["no gradients", "frozen bias", "implicit GEMM", "hooked", "option off"])
def test_where_a_condition_fails_the_convolution_keeps_its_bias(case):
    model = _Convs(channels=3 if case == "implicit GEMM" else 20)
    x = torch.randn(2, model.first.in_channels, 9, 7)
    options = {"conv_bias_apart": False} if case == "option off" else {}
    if case == "frozen bias":
        model.first.bias.requires_grad_(False)
        model.second.bias.requires_grad_(False)
    if case == "hooked":
        for conv in (model.first, model.second):
            conv.register_forward_hook(lambda m, i, o: None)
    if case == "no gradients":
        with torch.no_grad():
            report = _forward_report(model, x)
    else:
        report = _forward_report(model, x, **options)
    # The implicit-GEMM case: the first convolution (3 x 9 taps) is fused with its bias;
    # the second, past the strategy's reduction, has its bias apart.
    assert _apart(report) == (1 if case == "implicit GEMM" else 0), str(report)
