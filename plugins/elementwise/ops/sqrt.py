"""``torch.sqrt`` and ``torch.rsqrt`` (1 / sqrt(x)) with their methods."""

import torch

from autofuser import LoweringSpec

from ._common import lowering, refuse_out, require_float_output, unary_samples


@lowering
def lower_sqrt(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("tl.sqrt({0})", input)


@lowering
def lower_rsqrt(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("tl.rsqrt({0})", input)


SPECS = [
    LoweringSpec(
        name="elementwise.sqrt",
        description="square root",
        targets=(torch.sqrt, "sqrt"),
        kind="pointwise",
        lower=lower_sqrt,
        samples=lambda dtype: unary_samples(dtype, scale=3.0, positive=True),
        references=(torch.sqrt, lambda x: x.sqrt()),
    ),
    LoweringSpec(
        name="elementwise.rsqrt",
        description="reciprocal square root",
        targets=(torch.rsqrt, "rsqrt"),
        kind="pointwise",
        lower=lower_rsqrt,
        samples=lambda dtype: unary_samples(dtype, scale=3.0, positive=True),
        references=(torch.rsqrt, lambda x: x.rsqrt()),
    ),
]
