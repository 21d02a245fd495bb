"""Patterns of real solver code around the elementwise lowerings, end to end: each
small model is fused, compared with eager on fresh random inputs at awkward shapes in
fp32, fp16 and bf16 (the conformance test's default tolerances), and its report must
show the pattern inside one fused group."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn

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


def fused_group_with(report, *ops):
    group = next((g for g in report.fused if all(op in g.ops for op in ops)), None)
    assert group is not None, f"no fused group holds {ops}:\n{report}"
    return group


class TimeEmbedding(nn.Module):
    """A diffusion / neural-operator time embedding, sin and cos of t times frequencies,
    mixed into the features."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("freqs", torch.exp(-torch.arange(width) * (9.2 / width)))

    def forward(self, x, t):
        phase = t[:, None] * self.freqs * 100.0
        return x * torch.sin(phase) + phase.cos() * 0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [1, 5])
def test_sinusoidal_embedding_is_one_kernel(dtype, batch):
    width = 37
    model = TimeEmbedding(width).to(dtype)
    x = torch.randn(batch, width, dtype=dtype)
    t = torch.rand(batch, dtype=dtype)
    report = fuse_and_compare(model, x, t)
    fused_group_with(report, "elementwise.sin", "elementwise.cos", "elementwise.mul", "elementwise.add")
