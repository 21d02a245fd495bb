"""``F.leaky_relu(x, negative_slope)`` and ``nn.LeakyReLU``: x if x > 0 else slope * x."""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec

from ._common import lowering, number, refuse_inplace, require_float_output, unary_samples


@lowering
def lower_leaky_relu(ctx, input, negative_slope=0.01, inplace=False):
    if ctx.module is not None:
        negative_slope, inplace = ctx.module.negative_slope, ctx.module.inplace
    refuse_inplace(ctx, inplace)
    require_float_output(ctx)
    slope = number(ctx, negative_slope, "negative_slope")
    # torch's own form (x > 0 ? x : x * slope): NaN * slope stays NaN.
    return ctx.pointwise("tl.where({0} > 0, {0}, {0} * {1})", input, slope)


SPECS = [
    LoweringSpec(
        name="elementwise.leaky_relu",
        description="x if x > 0 else negative_slope * x",
        targets=(F.leaky_relu, torch.nn.LeakyReLU),
        kind="pointwise",
        lower=lower_leaky_relu,
        samples=lambda dtype: unary_samples(dtype, nans=True),
        references=(
            F.leaky_relu,
            lambda x: F.leaky_relu(x, 0.2),
            lambda x: F.leaky_relu(x, negative_slope=-1.5),
            torch.nn.LeakyReLU(),
            torch.nn.LeakyReLU(negative_slope=0.3),
        ),
    ),
]
