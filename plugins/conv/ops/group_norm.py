"""Group norm (``nn.GroupNorm``, ``F.group_norm``) over a channels-first input:
each group of ``C / G`` channels of each sample normalised over those channels
and the spatial dims, then the per-channel affine parameters.

Two group counts are row reductions over whole dims and join the
row-reduction strategy: ``G == C`` (each channel over its spatial dims, as
instance norm) and ``G == 1`` (each sample over all its channels and spatial
dims). Between them a group covers part of the channel dim, which needs the
channel dim split in two - a reshape the kernels' indexing doesn't express:
those stay eager, and the report says so.
"""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec, Sample

from ._common import float_tensor, module_forward_is, per_channel
from .instance_norm import normalize_over_space


def lower_group_norm_function(ctx, input, num_groups, weight=None, bias=None, eps=1e-5):
    op = "group_norm"
    shape = float_tensor(ctx, op, input)
    if len(shape) < 2 or isinstance(num_groups, bool) or not isinstance(num_groups, int):
        ctx.refuse("unsupported_argument", f"{op}: num_groups={num_groups!r} on a {len(shape)}-d input")
    channels = shape[1]
    if num_groups == channels and len(shape) > 2:
        return normalize_over_space(ctx, op, input, weight, bias, eps)
    if num_groups == 1:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            ctx.refuse("unsupported_argument", f"{op}: eps={eps!r} is not a number")
        dims = tuple(range(1, len(shape)))
        n = 1
        for d in dims:
            n *= shape[d]
        spatial = len(shape) - 2
        weight = per_channel(ctx, weight, channels, spatial, op, "weight") if weight is not None else None
        bias = per_channel(ctx, bias, channels, spatial, op, "bias") if bias is not None else None
        return ctx.normalize(ctx.tensor(input), dims, n, float(eps), weight, bias)
    ctx.refuse(
        "partial_channel_groups",
        f"{op}: {num_groups} groups of {channels} channels split the channel dim, "
        "which fused kernels don't index yet (1 group or one per channel fuse)",
    )


def lower_group_norm_module(ctx, input):
    module = ctx.module
    module_forward_is(ctx, torch.nn.GroupNorm)
    weight = ctx.attr("weight") if module.weight is not None else None
    bias = ctx.attr("bias") if module.bias is not None else None
    return lower_group_norm_function(ctx, input, module.num_groups, weight, bias, module.eps)


def _samples(dtype):
    def affine(c):
        return torch.randn(c, dtype=dtype), torch.randn(c, dtype=dtype)

    return [
        Sample(
            args=(torch.randn(2, 6, 13, 7, dtype=dtype) * 2 + 1, *affine(6)),
            kwargs={"num_groups": 6},
            note="one group per channel",
        ),
        Sample(args=(torch.randn(3, 4, 9, 5, dtype=dtype) - 1, *affine(4)), kwargs={"num_groups": 1}, note="one group"),
        Sample(args=(torch.randn(1, 5, 17, dtype=dtype), *affine(5)), kwargs={"num_groups": 1}, note="1-d"),
    ]


def _affine(module):
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
    return module


def _module_samples(dtype):
    return [
        Sample(args=(torch.randn(2, 8, 13, 7, dtype=dtype) * 2 + 1,)),
        Sample(args=(torch.randn(1, 8, 37, 3, dtype=dtype).transpose(2, 3),), note="transposed"),
    ]


SPECS = [
    LoweringSpec(
        name="conv.group_norm",
        description="F.group_norm with one group or one group per channel",
        targets=(F.group_norm,),
        kind="reduction",
        lower=lower_group_norm_function,
        samples=_samples,
        references=(
            lambda x, w, b, num_groups: F.group_norm(x, num_groups, w, b, eps=1e-3),
            lambda x, w, b, num_groups: F.group_norm(x, num_groups),
        ),
    ),
    LoweringSpec(
        name="conv.group_norm_module",
        description="nn.GroupNorm with one group or one group per channel",
        targets=(torch.nn.GroupNorm,),
        kind="reduction",
        lower=lower_group_norm_module,
        samples=_module_samples,
        references=(
            _affine(torch.nn.GroupNorm(8, 8)),
            _affine(torch.nn.GroupNorm(1, 8)),
            torch.nn.GroupNorm(8, 8, affine=False),
        ),
    ),
]
