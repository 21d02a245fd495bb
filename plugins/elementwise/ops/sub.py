"""``x - y``, ``torch.sub(x, y, alpha=a)``: ``x - a * y``; and ``torch.rsub(x, y, alpha=a)``: ``y - a * x``."""

import operator

import torch

from autofuser import LoweringSpec

from ._common import binary_samples, lowering, number, refuse_out, require_float_output


@lowering
def lower_sub(ctx, input, other, *, alpha=1, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    alpha = number(ctx, alpha, "alpha")
    if alpha == 1:
        return ctx.pointwise("{0} - {1}", input, other)
    return ctx.pointwise("{0} - {2} * {1}", input, other, alpha)


@lowering
def lower_rsub(ctx, input, other, *, alpha=1, out=None):
    refuse_out(ctx, out)
    require_float_output(ctx)
    alpha = number(ctx, alpha, "alpha")
    if alpha == 1:
        return ctx.pointwise("{1} - {0}", input, other)
    return ctx.pointwise("{1} - {2} * {0}", input, other, alpha)


SPECS = [
    LoweringSpec(
        name="elementwise.sub",
        description="x - alpha * y (tensors or Python numbers, broadcast)",
        targets=(torch.sub, torch.subtract, operator.sub, "sub", "subtract"),
        kind="pointwise",
        lower=lower_sub,
        samples=lambda dtype: binary_samples(dtype),
        references=(
            lambda x, y: x - y,
            torch.sub,
            torch.subtract,
            lambda x, y: x.sub(y),
            lambda x, y: x.subtract(y, alpha=1.5),
            lambda x, y: torch.sub(x, y, alpha=-0.25),
            lambda x, y: 1 - x,  # recorded as operator.sub(1, x)
            lambda x, y: y - 0.75,
        ),
    ),
    LoweringSpec(
        name="elementwise.rsub",
        description="torch.rsub(x, y, alpha): y - alpha * x",
        targets=(torch.rsub,),
        kind="pointwise",
        lower=lower_rsub,
        samples=lambda dtype: binary_samples(dtype),
        references=(
            torch.rsub,
            lambda x, y: torch.rsub(x, y, alpha=3),
            lambda x, y: torch.rsub(x, 2.0),
        ),
    ),
]
