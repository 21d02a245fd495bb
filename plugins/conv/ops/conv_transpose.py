"""Transposed convolutions whose stride equals their kernel (``nn.ConvTranspose1d/2d/3d``,
``F.conv_transpose*d``; no padding, one group): a learned upsampling in which each
output pixel comes from one input pixel. Lowered as an extern op that the
``upsample_fused`` strategy generates with the cat and pointwise ops after it,
reading the low-resolution input directly. Other geometries stay eager."""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample, Tolerance

from ..resampling import TRANSPOSED_FUNCTIONS, parse_transposed_conv

# A sum over input channels in another order than cuDNN's / oneDNN's.
TOLERANCES = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4),
    "float16": Tolerance(atol=2e-3, rtol=1e-2),
    "bfloat16": Tolerance(atol=2e-2, rtol=4e-2),
}


def lower_conv_transpose(ctx, *args, **kwargs):
    parsed = parse_transposed_conv(ctx.node, ctx.root)
    if isinstance(parsed, str):
        ctx.refuse("unsupported_argument", f"transposed convolution: {parsed}")
    return ctx.extern()


def _function_samples(dtype):
    return [
        Sample(
            args=(
                torch.randn(2, 6, 9, 5, dtype=dtype),
                torch.randn(6, 4, 2, 2, dtype=dtype) * 0.3,
                torch.randn(4, dtype=dtype),
            )
        ),
        Sample(
            args=(torch.randn(1, 3, 7, 4, dtype=dtype), torch.randn(3, 5, 3, 2, dtype=dtype) * 0.3, None),
            note="kernel 3 x 2, batch 1, no bias",
        ),
    ]


def _module(**kwargs):
    layer = torch.nn.ConvTranspose2d(6, 4, **kwargs)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    return layer


SPECS = [
    LoweringSpec(
        name="conv.conv_transpose",
        description="F.conv_transpose1d/2d/3d with stride == kernel",
        targets=tuple(TRANSPOSED_FUNCTIONS),
        kind="layout",
        lower=lower_conv_transpose,
        samples=_function_samples,
        references=(
            lambda x, w, b: F.conv_transpose2d(x, w, b, stride=tuple(w.shape[2:])),
            lambda x, w, b: F.gelu(F.conv_transpose2d(x, w, b, stride=tuple(w.shape[2:]))) * 2,
        ),
        tolerances=TOLERANCES,
    ),
    LoweringSpec(
        name="conv.conv_transpose_module",
        description="nn.ConvTranspose1d/2d/3d with stride == kernel",
        targets=(torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d),
        kind="layout",
        lower=lower_conv_transpose,
        samples=lambda dtype: [Sample(args=(torch.randn(2, 6, 9, 5, dtype=dtype),))],
        references=(_module(kernel_size=2, stride=2), _module(kernel_size=(3, 2), stride=(3, 2), bias=False)),
        tolerances=TOLERANCES,
    ),
]
