"""Upsampling (``F.interpolate``, ``F.upsample*``, ``nn.Upsample``) in the modes
``nearest``, ``nearest-exact``, ``linear``, ``bilinear`` and ``trilinear``.

Lowered as an extern op: only the ``upsample_fused`` strategy generates it,
with the ``cat`` and pointwise ops after it, reading the low-resolution input
directly (``strategy.py``; the index formulas are in ``resampling.py``).
Bicubic and area modes and anti-aliasing stay eager.
"""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample

from ..resampling import INTERPOLATE_FUNCTIONS, parse_resample


def lower_resample(ctx, *args, **kwargs):
    parsed = parse_resample(ctx.node, ctx.root)
    if isinstance(parsed, str):
        ctx.refuse("unsupported_argument", f"upsampling: {parsed}")
    return ctx.extern()


def _samples(dtype):
    return [
        Sample(args=(torch.randn(2, 3, 9, 5, dtype=dtype),), note="2-d, odd sizes"),
        Sample(args=(torch.randn(1, 4, 7, 4, dtype=dtype),), note="batch 1"),
    ]


def _upsample(**kwargs):
    return torch.nn.Upsample(**kwargs)


SPECS = [
    LoweringSpec(
        name="conv.interpolate",
        description="F.interpolate in nearest, nearest-exact, (bi/tri)linear modes",
        targets=INTERPOLATE_FUNCTIONS,
        kind="layout",
        lower=lower_resample,
        samples=_samples,
        references=(
            lambda x: F.interpolate(x, size=(19, 11), mode="bilinear", align_corners=False),
            lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
            lambda x: F.interpolate(x, scale_factor=(1.7, 2.5), mode="bilinear", recompute_scale_factor=False),
            lambda x: F.interpolate(x, size=(23, 9), mode="bilinear", align_corners=True),
            lambda x: F.interpolate(x, scale_factor=1.5, mode="nearest-exact", recompute_scale_factor=True),
            lambda x: F.interpolate(x.flatten(2), scale_factor=3, mode="linear"),
            lambda x: F.interpolate(x.unsqueeze(2), scale_factor=(2, 1.5, 2), mode="trilinear"),
        ),
    ),
    LoweringSpec(
        name="conv.upsample_module",
        description="nn.Upsample (and UpsamplingNearest2d / UpsamplingBilinear2d)",
        targets=(torch.nn.Upsample,),
        kind="layout",
        lower=lower_resample,
        samples=_samples,
        references=(
            _upsample(scale_factor=2, mode="bilinear"),
            _upsample(size=(20, 11), mode="nearest"),
            torch.nn.UpsamplingBilinear2d(scale_factor=2),
            torch.nn.UpsamplingNearest2d(size=(13, 7)),
        ),
    ),
]
