"""2-D convolutions fed the channels-last view the model copies from (``plugins/conv/
layout_pass.py``): the copies to row-major before and after them go, the fused model
matches eager on fresh random inputs at awkward shapes and trains like it; where any
condition fails (another reader of a copy, a result read otherwise, a layout that is not
channels-last, a write anywhere in the graph, a convolution the implicit-GEMM kernels
take, float64) the graph keeps its copies."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser_core.report_html import coverage
from autofuser_plugins.conv.layout_pass import feed_convolutions_channels_last

from _helpers import fuse_and_compare, trains_like_eager


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


class _GridProjections(nn.Module):
    """A field kept as [batch, height, width, channels], projected by two 3x3 convolutions
    (a module and ``F.conv2d``) of one row-major copy, each result permuted back and
    copied, as the structured-mesh Transolver writes its slice projections. ``variant``
    breaks one condition of the pass."""

    def __init__(self, channels: int = 17, out: int = 10, variant: str = ""):
        super().__init__()
        self.variant = variant
        self.norm = nn.LayerNorm(channels)
        self.conv = nn.Conv2d(channels, out, 3, padding=1)
        self.weight = nn.Parameter(torch.randn(out, channels, 3, 3) * 0.2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        dims = (0, 3, 2, 1) if self.variant == "not channels-last" else (0, 3, 1, 2)
        x = h.permute(*dims).contiguous()
        if self.variant == "source written after the copy":
            h += 1  # the copy holds the values before: the convolutions must not see these
        a = self.conv(x)
        b = F.conv2d(x, self.weight, padding=1)
        if self.variant == "result read otherwise":
            return a.flatten(2).sum(-1)[:, :, None, None] + b
        back = (0, 3, 2, 1) if self.variant == "not channels-last" else (0, 2, 3, 1)
        out = a.permute(*back).contiguous() * torch.sigmoid(b.permute(*back).contiguous())
        if self.variant == "copy read otherwise":
            out = out + x.mean()
        if self.variant == "source written after the copy":
            out = out + h.mean()
        if self.variant == "result copied twice":
            again = a.permute(*back).contiguous()
            again.add_(1)  # its own copy in eager: the other reader must not see this
            out = out * again
        return out


def _captured(model, *inputs):
    gm = autofuser.capture(model, *inputs)
    copies = sum(1 for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous")
    return gm, copies


def test_the_copy_before_the_convolutions_goes_and_their_results_are_filed_channels_last():
    model = _GridProjections()
    gm, copies = _captured(model, torch.randn(2, 7, 5, 17))
    assert feed_convolutions_channels_last(gm) == 1
    gm.recompile()
    left = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous"]
    assert len(left) == copies - 1  # the two after the convolutions stay, now returning their input
    convolutions = [n for n in gm.graph.nodes if n.target in ("conv", F.conv2d)]
    assert len(convolutions) == 2
    for conv in convolutions:
        assert conv.args[0].target == "permute"
        assert tuple(conv.meta["tensor_meta"].stride) == (35 * 10, 1, 5 * 10, 10)
        (permute,) = conv.users
        assert tuple(permute.meta["tensor_meta"].stride) == (35 * 10, 5 * 10, 10, 1)
    # The graph computes the model's values, each convolution's result in the layout filed.
    seen = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            seen[n] = value.stride()
            return value

    h = torch.randn(2, 7, 5, 17)
    with torch.no_grad():
        torch.testing.assert_close(Recorder(gm).run(h), model(h), atol=1e-5, rtol=1e-5)
    for node in [*convolutions, *(p for c in convolutions for p in c.users)]:
        assert seen[node] == tuple(node.meta["tensor_meta"].stride), node


@pytest.mark.parametrize("shape", [(1, 7, 5, 17), (3, 4, 9, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_fused_model_matches_eager_without_the_copies(shape, dtype):
    model = _GridProjections().to(dtype)
    report = fuse_and_compare(model, torch.randn(shape, dtype=dtype))
    assert coverage(report).eager == 0, str(report)
    # The copy before the convolutions was a kernel of its own; without it, and with the
    # copies after them returning their input, the model runs one kernel fewer.
    with torch.no_grad():
        kept = autofuser.fuse(model, progress=False, tune=False, verify_speed=False, conv_channels_last=False)
        kept(torch.randn(shape, dtype=dtype))
    assert len(report.fused) == len(kept.report().fused) - 1, f"{report}\n{kept.report()}"


def test_the_pass_can_be_turned_off():
    model = _GridProjections()
    h = torch.randn(2, 7, 5, 17)
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False, conv_channels_last=False)
        torch.testing.assert_close(fused(h), model(h), atol=1e-5, rtol=1e-5)
    copies = [n for n in fused.report().graph if n.target.endswith("contiguous")]
    assert len(copies) == 3, str(fused.report())


def test_the_model_without_the_copies_trains_like_eager():
    # Two steps: the helper's plain SGD on a summed loss grows these weights fast enough
    # that a third step amplifies rounding past its limits, with or without the pass.
    trains_like_eager(_GridProjections(), torch.randn(3, 7, 5, 17), steps=2)


def test_under_autocast_the_fused_model_matches_eager():
    model = _GridProjections()
    h = torch.randn(2, 7, 5, 17)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(h)
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got = fused(h)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "variant",
    [
        "not channels-last",
        "result read otherwise",
        "copy read otherwise",
        "source written after the copy",
        "result copied twice",
        "implicit GEMM",
        "float64",
    ],
)
def test_where_a_condition_fails_the_copies_stay(variant):
    channels = 6 if variant == "implicit GEMM" else 17  # 6 x 9 taps: the implicit-GEMM kernels' reduction
    model = _GridProjections(channels, variant="" if variant in ("float64", "implicit GEMM") else variant)
    dtype = torch.float64 if variant == "float64" else torch.float32
    model = model.to(dtype)
    h = torch.randn(2, 7, 5, channels, dtype=dtype)
    gm, copies = _captured(model, h)
    assert feed_convolutions_channels_last(gm) == 0
    left = sum(1 for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous")
    assert left == copies
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        torch.testing.assert_close(fused(h), model(h), atol=1e-5, rtol=1e-5)
