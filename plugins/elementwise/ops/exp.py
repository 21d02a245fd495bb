"""``torch.exp``, ``x.exp()``."""

import torch

from autofuser import LoweringSpec

from ._common import lowering, refuse_out, require_float_output, unary_samples


@lowering
def lower_exp(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("tl.exp({0})", input)


SPECS = [
    LoweringSpec(
        name="elementwise.exp",
        description="e ** x",
        targets=(torch.exp, "exp"),
        kind="pointwise",
        lower=lower_exp,
        # scale 2 reaches e**8 and beyond, yet stays clear of fp16's overflow at e**11.1.
        samples=lambda dtype: unary_samples(dtype, scale=2.0),
        references=(torch.exp, lambda x: x.exp()),
    ),
]
