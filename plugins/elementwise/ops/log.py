"""``torch.log``, ``x.log()`` (natural logarithm)."""

import torch

from autofuser import LoweringSpec

from ._common import lowering, refuse_out, require_float_output, unary_samples


@lowering
def lower_log(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("tl.log({0})", input)


SPECS = [
    LoweringSpec(
        name="elementwise.log",
        description="natural logarithm",
        targets=(torch.log, "log"),
        kind="pointwise",
        lower=lower_log,
        samples=lambda dtype: unary_samples(dtype, scale=3.0, positive=True),
        references=(torch.log, lambda x: x.log()),
    ),
]
