"""``F.elu(x, alpha)`` and ``nn.ELU``: x if x > 0 else alpha * (exp(x) - 1)."""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec

from ._common import EXPM1, helper, lowering, number, refuse_inplace, require_float_output, unary_samples


@lowering
def lower_elu(ctx, input, alpha=1.0, inplace=False):
    if ctx.module is not None:
        alpha, inplace = ctx.module.alpha, ctx.module.inplace
    refuse_inplace(ctx, inplace)
    require_float_output(ctx)
    alpha = number(ctx, alpha, "alpha")
    expm1 = helper(ctx, EXPM1)
    return ctx.pointwise("tl.where({0} > 0, {0}, {1} * " + expm1 + "({0}))", input, alpha)


SPECS = [
    LoweringSpec(
        name="elementwise.elu",
        description="x if x > 0 else alpha * (exp(x) - 1)",
        targets=(F.elu, torch.nn.ELU),
        kind="pointwise",
        lower=lower_elu,
        samples=lambda dtype: unary_samples(dtype, scale=3.0, nans=True),
        references=(F.elu, lambda x: F.elu(x, alpha=0.5), torch.nn.ELU(), torch.nn.ELU(alpha=2.0)),
    ),
]
