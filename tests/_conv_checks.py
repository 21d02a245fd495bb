"""Checks shared by the convolution tests (not a test module itself)."""

from __future__ import annotations

import torch

from autofuser_plugins.conv.convolution import MAX_REDUCTION, reduction


def assert_3x3_convs_split_at_max_reduction(model: torch.nn.Module, report, activation: str, count: int) -> None:
    """Of the ``count`` 3x3 conv - batch norm - ``activation`` triples of ``model``, those
    whose reduction is within ``MAX_REDUCTION`` are one implicit-GEMM group each; the
    others are refused (``cudnn_faster``: cuDNN's product) with their batch norm and
    activation fused on their own. The model must have some of each."""
    short = sum(
        reduction(m.in_channels, m.kernel_size) <= MAX_REDUCTION
        for m in model.modules()
        if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)
    )
    assert 0 < short < count
    chain = ["conv.conv2d_module", "conv.batch_norm_module", activation]
    assert sum(g.ops == chain and g.strategy == "implicit_gemm" for g in report.fused) == short, str(report)
    refused = [g for g in report.groups if g.strategy == "implicit_gemm" and not g.fused]
    assert len(refused) == count - short and {g.reason_code for g in refused} == {"cudnn_faster"}, str(report)
    assert sum(g.ops == chain[1:] for g in report.fused) == count - short, str(report)
