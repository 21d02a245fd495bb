"""``abs(x)``, ``torch.abs``, ``torch.absolute``."""

import operator

import torch

from autofuser import LoweringSpec

from ._common import lowering, refuse_out, require_float_output, unary_samples


@lowering
def lower_abs(ctx, input, *, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    return ctx.pointwise("tl.abs({0})", input)


SPECS = [
    LoweringSpec(
        name="elementwise.abs",
        description="|x|",
        targets=(torch.abs, torch.absolute, operator.abs, "abs", "absolute"),
        kind="pointwise",
        lower=lower_abs,
        samples=lambda dtype: unary_samples(dtype, nans=True),
        references=(lambda x: abs(x), torch.abs, torch.absolute, lambda x: x.abs(), lambda x: x.absolute()),
    ),
]
