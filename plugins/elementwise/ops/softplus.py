"""``F.softplus(x, beta, threshold)`` and ``nn.Softplus``:
log(1 + exp(beta * x)) / beta, and x itself where beta * x > threshold."""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec

from ._common import LOG1P, helper, lowering, number, require_float_output, unary_samples


@lowering
def lower_softplus(ctx, input, beta=1.0, threshold=20.0):
    if ctx.module is not None:
        beta, threshold = ctx.module.beta, ctx.module.threshold
    require_float_output(ctx)
    beta = number(ctx, beta, "beta")
    threshold = number(ctx, threshold, "threshold")
    log1p = helper(ctx, LOG1P)
    return ctx.pointwise(
        "tl.where({0} * {1} > {2}, {0}, " + log1p + "(tl.exp({0} * {1})) / {1})", input, beta, threshold
    )


SPECS = [
    LoweringSpec(
        name="elementwise.softplus",
        description="log(1 + exp(beta x)) / beta, linear above the threshold",
        targets=(F.softplus, torch.nn.Softplus),
        kind="pointwise",
        lower=lower_softplus,
        # scale 8 puts many values past the threshold for beta=2, threshold=5.
        samples=lambda dtype: unary_samples(dtype, scale=8.0, nans=True),
        references=(
            F.softplus,
            lambda x: F.softplus(x, beta=2.0, threshold=5.0),
            lambda x: F.softplus(x, 0.5),
            torch.nn.Softplus(),
            torch.nn.Softplus(beta=2, threshold=5),
        ),
    ),
]
