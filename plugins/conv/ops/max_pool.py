"""``F.max_pool2d``, ``torch.max_pool2d`` and ``nn.MaxPool2d``: the largest value of each
window over the last two dims.

Lowered as a small window reduction: one shifted read per tap
(``ctx.read_shifted``; stride as the scale, ``tap * dilation - padding`` as the
offset, ``-inf`` outside the input, which is also what a ``ceil_mode`` window
reaching past the end reads) combined with a NaN-propagating maximum, as eager's
kernel does. The window's values are computed where they are read, so a
pointwise op before the pool and the activation after it are one kernel with it
and the full-resolution result is never written. Indices
(``return_indices=True``) stay eager, as do windows of more than ``MAX_TAPS``.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample

from ._common import float_tensor, int_tuple, module_forward_is

#: Taps (kernel height x width) one output element may read: each is a read of the
#: window's values, computed again for every tap, in one straight-line kernel.
MAX_TAPS = 49

#: Both inputs' maximum is NaN where either is, as eager's max-pool keeps a NaN it meets.
MAXIMUM = "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)"


def lower_max_pool2d(ctx, *args, **kwargs):
    if ctx.module is not None:
        return _module(ctx, *args, **kwargs)
    return _function(ctx, *args, **kwargs)


def _function(ctx, input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    return _pool(ctx, "max_pool2d", input, kernel_size, stride, padding, dilation, return_indices)


def _module(ctx, input):
    m = ctx.module
    module_forward_is(ctx, nn.MaxPool2d)
    return _pool(ctx, "MaxPool2d", input, m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices)


def _pool(ctx, op, input, kernel_size, stride, padding, dilation, return_indices):
    if return_indices:
        ctx.refuse("unsupported_argument", f"{op}: return_indices=True (the indices stay eager)")
    shape = float_tensor(ctx, op, input)
    if len(shape) not in (3, 4) or ctx.out_shape is None or len(ctx.out_shape) != len(shape):
        ctx.refuse("unsupported_shape", f"{op}: a {len(shape)}-d input (expected [C, H, W] or [B, C, H, W])")
    kernel = int_tuple(ctx, op, "kernel_size", kernel_size, 2)
    stride = kernel if stride is None or stride == [] or stride == () else int_tuple(ctx, op, "stride", stride, 2)
    padding = int_tuple(ctx, op, "padding", padding, 2)
    dilation = int_tuple(ctx, op, "dilation", dilation, 2)
    if kernel[0] * kernel[1] > MAX_TAPS:
        ctx.refuse("window_too_large", f"{op}: a {kernel[0]}x{kernel[1]} window reads more than {MAX_TAPS} taps")
    lead = len(shape) - 2
    scales = (1,) * lead + stride
    result = None
    for ty in range(kernel[0]):
        for tx in range(kernel[1]):
            offsets = (0,) * lead + (ty * dilation[0] - padding[0], tx * dilation[1] - padding[1])
            tap = ctx.read_shifted(input, ctx.out_shape, offsets, scales=scales, fill=float("-inf"))
            result = tap if result is None else ctx.pointwise(MAXIMUM, result, tap)
    return result


def _samples(dtype):
    return [
        Sample(args=(torch.randn(2, 3, 9, 7, dtype=dtype),), note="(2, 3, 9, 7)"),
        Sample(args=(torch.randn(1, 5, 6, 11, dtype=dtype),), note="batch 1"),
        Sample(args=(torch.randn(4, 13, 10, dtype=dtype),), note="unbatched"),
    ]


SPECS = [
    LoweringSpec(
        name="conv.max_pool2d",
        description="the largest value of each window: one shifted read per tap, combined with maximum",
        targets=(F.max_pool2d, torch.max_pool2d, nn.MaxPool2d),
        kind="pointwise",
        lower=lower_max_pool2d,
        samples=_samples,
        references=(
            lambda x: torch.relu(F.max_pool2d(x * 2 - 1, 2)),
            lambda x: F.max_pool2d(x, 3, stride=2, padding=1) + 1,
            lambda x: F.max_pool2d(torch.tanh(x), (3, 2), stride=(1, 2), padding=(1, 0), dilation=(1, 2)),
            lambda x: F.max_pool2d(x, 3, stride=2, ceil_mode=True) * 0.5,
            nn.MaxPool2d(2, stride=1, padding=1),
            lambda x: torch.max_pool2d(x, [2, 2], [2, 1]) - x.mean(),
        ),
    ),
]
